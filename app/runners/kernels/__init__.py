"""Triton kernels of the lean forward: int8 GEMVs for a few rows, one-token attention read in place."""
