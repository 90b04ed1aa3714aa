"""The receptive-field report from dense reachability matrices: an independent reference for tests."""

from __future__ import annotations

import torch

from flexsparse.masks.base import Geometry
from flexsparse.verify.layers import check_seq_len, stack_patterns
from flexsparse.verify.report import ReceptiveFieldReport


def receptive_field_bruteforce(layers, seq_len: int) -> ReceptiveFieldReport:
    """The same report from dense boolean reachability matrices: O(L * S^3), for tests at small sizes."""
    seq_len = check_seq_len(seq_len)
    patterns = stack_patterns(layers)
    reach = torch.eye(seq_len, dtype=torch.bool)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    coverage, complete_depth = [], None
    for depth, pattern in enumerate(patterns, 1):
        geo = Geometry(pattern.required_heads or 1, seq_len)
        step = pattern.dense(geo)[0].any(0) | torch.eye(seq_len, dtype=torch.bool)
        reach = (step.double() @ reach.double()) > 0
        coverage.append(float(reach.sum()) / float(causal.sum()))
        if complete_depth is None and torch.equal(reach, causal):
            complete_depth = depth
    missing = causal & ~reach
    hole = None
    if missing.any():
        q = int(missing.any(1).nonzero()[0])
        hole = (q, int(missing[q].nonzero()[0]))
    return ReceptiveFieldReport(seq_len, len(patterns), hole is None, hole, coverage, complete_depth)
