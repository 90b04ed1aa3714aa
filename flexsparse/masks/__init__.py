"""Attention patterns: composable FlexAttention mask_mod / BlockMask generators with dense references."""

from flexsparse.masks.base import EMPTY, FULL, PARTIAL, Geometry, MaskMod, Pattern
from flexsparse.masks.block_table import BlockTable
from flexsparse.masks.blocks import BlockMaskStack, block_density, block_mask_from_classes
from flexsparse.masks.combine import Intersection, PerHead, PerLayer, Union, dispatch_mask_mod
from flexsparse.masks.esa import ESA
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
    "ESA",
    "Geometry",
    "Intersection",
    "MaskMod",
    "Pattern",
    "PerHead",
    "PerLayer",
    "SinkWindow",
    "TriangleMix",
    "Union",
    "XAttention",
    "block_density",
    "block_mask_from_classes",
    "dispatch_mask_mod",
]
