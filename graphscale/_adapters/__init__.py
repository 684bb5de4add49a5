"""The adapters: each framework graphscale governs (DeepSpeed, FSDP2) plugs in
from here, registering one adapter into ``_core/registry.py``.  Nothing below
imports them."""
