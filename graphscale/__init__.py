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
from ._core.errors import AuditError, ConfigurationError, GraphscaleError
from ._core.group import Group
from ._entry.install import Installation, install
from ._tools.audit import Audit, audit
from ._tools.diagnose import Diagnosis, diagnose
from ._tools.explain import ExplainedPlan, explain

__all__ = [
    "Group", "install", "Installation", "GraphscaleError", "ConfigurationError",
    "explain", "ExplainedPlan", "audit", "Audit", "AuditError", "diagnose", "Diagnosis", "observe",
]
__version__ = "0.1.0"

# The adapters (graphscale/_adapters/) register themselves into the core's
# registry on import; a new adapter is a new module there and one name here.
from ._adapters import deepspeed as _deepspeed  # noqa: E402,F401,I001
from ._adapters import fsdp as _fsdp  # noqa: E402,F401
