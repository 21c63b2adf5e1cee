"""Every compiled kernel of kvtier, called through one typed face: `kvtier.kernels.ops`."""
