"""Compute kernels, each with a PyTorch reference beside it: xa_estimate.py (XAttention's block-mass estimate),
router_infer.py (a router's inference in one launch; the reference is ``Router.route``'s torch path).

triton is optional: the Triton modules are imported only where a kernel runs, and
:func:`flexsparse.kernels.availability.kernels_run_on` is the one check of whether one can."""
