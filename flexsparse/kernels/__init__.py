"""Compute kernels, each with a PyTorch reference beside it: xa_estimate.py (XAttention's block-mass estimate),
router_infer.py (a router's inference in one launch; the reference is ``Router.route``'s torch path)."""
