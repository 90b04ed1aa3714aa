"""Compute kernels, each with a PyTorch reference beside it: xa_estimate.py (XAttention's block-mass estimate)."""
