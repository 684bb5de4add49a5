"""The native walker and route (graphscale/_native) against the Python reference: the
same plans, the same gradients, the front and the straight call to torch's engine,
which route governs a backward and the path one backward takes."""
