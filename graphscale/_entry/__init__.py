"""The entry: what replaces ``torch.autograd.backward`` while graphscale is
installed (``entry.py``), and ``install`` (``install.py``), which switches it on."""
