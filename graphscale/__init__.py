"""graphscale: exact per-group gradient-accumulation scaling for any autograd graph.

Gradient accumulation divides gradients by GAS so that GAS micro-batches add
up to a mean.  graphscale puts that division where it belongs: on the leaves
each group (a DeepSpeed engine, or a :class:`Group` of parameters) owns, for
any graph and any backward style.

    >>> import torch, graphscale
    >>> actor, critic = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)
    >>> with graphscale.install(graphscale.Group(actor, gas=2), graphscale.Group(critic, gas=4)):
    ...     critic(actor(torch.ones(1, 2))).sum().backward()
    >>> critic.bias.grad  # 1 / 4
    tensor([0.2500])
"""
from __future__ import annotations

from . import observe
from ._audit import Audit, audit
from ._diagnose import Diagnosis, diagnose
from ._errors import AuditError, ConfigurationError, GraphscaleError
from ._explain import ExplainedPlan, explain
from ._group import Group
from ._install import Installation, install

__all__ = [
    "Group", "install", "Installation", "GraphscaleError", "ConfigurationError",
    "explain", "ExplainedPlan", "audit", "Audit", "AuditError", "diagnose", "Diagnosis", "observe",
]
__version__ = "0.1.0"

# The adapters (graphscale/_adapters.py) register themselves on import; a new
# adapter is a new module and one name here.
from . import _deepspeed, _fsdp  # noqa: E402,F401,I001
