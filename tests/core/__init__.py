"""The contract on plain PyTorch groups: every graph shape and random programs against a
plain-PyTorch oracle, the install handle, errors, observation, touching only what is
governed, and newer torch or DeepSpeed releases."""
