"""Attention patterns: composable FlexAttention mask_mod / BlockMask generators over token positions, with dense
references."""

from flexsparse.masks.base import (DecodeReads, Intersection, MaskMod, Pattern, Union, pattern_class,
                                   registered_patterns)
from flexsparse.masks.block_table import BlockTable
from flexsparse.masks.blocks import BlockMaskStack, block_density, block_mask_from_classes
from flexsparse.masks.combine import PerHead, PerLayer, dispatch_mask_mod, gather_heads
from flexsparse.masks.esa import ESA
from flexsparse.masks.geometry import EMPTY, FULL, PARTIAL, Geometry, Positions
from flexsparse.masks.triangle import TriangleMix
from flexsparse.masks.window import Causal, SinkWindow
from flexsparse.masks.xattention import XAttention

__all__ = [
    "EMPTY",
    "FULL",
    "PARTIAL",
    "BlockMaskStack",
    "BlockTable",
    "Causal",
    "DecodeReads",
    "ESA",
    "Geometry",
    "Intersection",
    "MaskMod",
    "Pattern",
    "PerHead",
    "PerLayer",
    "Positions",
    "SinkWindow",
    "TriangleMix",
    "Union",
    "XAttention",
    "block_density",
    "block_mask_from_classes",
    "dispatch_mask_mod",
    "gather_heads",
    "pattern_class",
    "registered_patterns",
]
