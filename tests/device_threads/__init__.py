"""CUDA's threading on this CPU: a device (``helpers.device_threads``) whose
backward runs on torch's device thread, as a GPU's does, and the contract on
it for plain groups, both routes: every shape, nested and checkpointed
backwards, every backward style, hooks, several threads at once."""
