"""Compute kernels, each with a PyTorch reference beside it, one idea a module:

* ESA's gather attention: ``esa.py`` (the entry, :func:`~flexsparse.kernels.esa.esa_attention`, and its autograd
  Function), ``esa_launch.py`` (block sizes, tuned settings, launchers), the Triton kernels ``esa_forward.py``,
  ``esa_decode.py``, ``esa_backward.py`` (dQ), ``esa_dkdv.py`` (dK/dV and its work list) on ``esa_shared.py`` and
  ``esa_index_triton.py``; ``esa_index.py`` (the index parameters the kernels take,
  :class:`~flexsparse.kernels.esa_index.EsaIndexRule`) and ``esa_reference.py`` (the reference and the argument
  checks) import no triton;
* decode attention over KV caches: ``decode.py`` (the entries and the plan cache), ``decode_launch.py`` (plans),
  ``decode_kernels.py`` (the split and combine kernels), ``decode_reference.py`` (the references, the checks and
  ``DecodeGroup``; no triton);
* xa_estimate.py (XAttention's block-mass estimate; its kernel in xa_estimate_triton.py), router_infer.py (a
  router's inference in one launch; the reference is ``Router.route``'s torch path); launch.py (a Triton launch with
  its non-tensor arguments fixed).

Nothing here imports :mod:`flexsparse.masks` (masks may import kernels). triton is optional: the Triton modules are
imported only where a kernel runs; :mod:`flexsparse.kernels.availability` is the one place that asks whether one can
(``kernels_run_on``) and whether a path that chooses for itself takes it (``kernels_preferred_on``)."""
