"""Receptive-field ("attention hole") verifier, hole horizon, and causality checker.

- :func:`receptive_field`: exact connected sets of a stack of layers, the first hole, coverage per layer.
- :func:`max_hole_free_length`: the longest sequence length without a hole.
- :func:`receptive_field_bruteforce`: the same report from dense matrices (tests, small sizes).
- :func:`causal`: whether what the kernel computes ever lets a query see a later key.
"""

from flexsparse.verify.bruteforce import receptive_field_bruteforce
from flexsparse.verify.causality import CausalityReport, causal
from flexsparse.verify.field import DEFAULT_WORK_LIMIT, receptive_field
from flexsparse.verify.horizon import DEFAULT_LIMIT, HoleFreeLength, max_hole_free_length
from flexsparse.verify.layers import layer_pattern, stack_patterns
from flexsparse.verify.report import ReceptiveFieldReport

__all__ = [
    "DEFAULT_LIMIT",
    "DEFAULT_WORK_LIMIT",
    "CausalityReport",
    "HoleFreeLength",
    "ReceptiveFieldReport",
    "causal",
    "layer_pattern",
    "max_hole_free_length",
    "receptive_field",
    "receptive_field_bruteforce",
    "stack_patterns",
]
