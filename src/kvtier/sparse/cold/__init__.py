"""The cold tier on flash: per-token K|V records and their low-precision key sketches, a stored image under them."""
