"""tessera.kernels."""
