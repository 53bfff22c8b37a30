"""How a pass computes: the device, caches, routed ops and their kernels. Imports no model and
no part of the decoding loop."""
