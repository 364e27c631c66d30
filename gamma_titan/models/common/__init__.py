"""Layers shared by every gamma_titan model: rotary embedding, gated attention, SwiGLU."""

from .attention import ATTENTION_GATES, GatedAttention
from .ffn import SwiGLU
from .rope import apply_rope, rope_cache

__all__ = ["ATTENTION_GATES", "GatedAttention", "SwiGLU", "apply_rope", "rope_cache"]
