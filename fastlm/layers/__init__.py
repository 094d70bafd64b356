"""Building blocks of the decoders. `LMHead` lives in `fastlm.layers.lm_head` (import it from there)."""

from fastlm.layers.attention import Attention
from fastlm.layers.attention_kernels import attend, attention_mask
from fastlm.layers.block import DecoderBlock
from fastlm.layers.embedding import Embeddings, document_positions
from fastlm.layers.init import init_linear
from fastlm.layers.mlp import GatedMLP, GeluMLP
from fastlm.layers.norm import build_norm
from fastlm.layers.rotary import apply_rotary, rotary_angles

__all__ = [
    "Attention",
    "DecoderBlock",
    "Embeddings",
    "GatedMLP",
    "GeluMLP",
    "apply_rotary",
    "attend",
    "attention_mask",
    "build_norm",
    "document_positions",
    "init_linear",
    "rotary_angles",
]
