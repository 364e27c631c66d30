"""The args of a decoder whose blocks hold gated multi-head (grouped-query) attention and a
SwiGLU feed-forward, however the block wires them (pre-norm in sequence, as gamma_dense;
in parallel, as PaLM): the fields, the checks and the counts they determine.

A family built from these two modules subclasses `AttentionFFNArgs` (a dataclass), names
its attention and feed-forward children (`ATTENTION`, `FFN`: the only names these methods
use) and brings its flavors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from gamma_titan.init import GammaInit

from .args import GammaArgs
from .sdpa_kernels import AttentionShape
from .shapes import HeadShape, check_heads, check_positive_ints, check_rope, check_tensor_parallel


@dataclass
class AttentionFFNArgs(HeadShape, GammaArgs):
    #: The block's children, by the names the family gives them (float8 exclusions, the
    #: default cosine maps).
    ATTENTION: ClassVar[str]
    FFN: ClassVar[str]

    dim: int = 768
    n_layers: int = 12
    n_heads: int = 12
    n_kv_heads: int | None = None  # None: multi-head attention; fewer: grouped-query
    ffn_hidden_dim: int = 2048
    vocab_size: int = 50304
    rope_theta: float = 10000.0
    max_seq_len: int = 4096  # length of the rotary cache; raised to training.seq_len
    # The paper's three knobs, set from [gamma] (GammaArgs.update_from_config).
    norm_eps: float = 1e-12
    attention_gate: str = "elementwise"
    init: GammaInit = field(default_factory=GammaInit)

    def check(self) -> None:
        """Raise ConfigError (naming the [model_args] key) for a shape that cannot work."""
        check_positive_ints(self, ("dim", "n_layers", "n_heads", "ffn_hidden_dim", "vocab_size", "max_seq_len"))
        check_heads(self)
        check_rope(self)

    def check_parallelism(self, layout) -> None:
        check_tensor_parallel(self, layout.tp, ("ffn_hidden_dim",))

    def supports_pipeline_parallel(self) -> bool:
        return True  # the decoder's forward takes a stage's cut (models/common/decoder.py)

    def supports_context_parallel(self) -> bool:
        return True  # the decoder's forward takes `positions`; attention's SDPA is a module

    def float8_excluded_fqns(self) -> list[str]:
        """Linear layers that stay in high precision under float8 training: the output head
        (the loss is sensitive to it), and the headwise gate (n_heads columns, 8 or 16 per
        TP rank, which float8's _scaled_mm refuses: it needs multiples of 16)."""
        return ["output"] + ([f"{self.ATTENTION}.gate_proj"] if self.attention_gate == "headwise" else [])

    def attention_shapes(self) -> list[AttentionShape]:
        """The attention kinds of the model in SDPA's numbers (for the start-up kernel report)."""
        return [AttentionShape("mha", self.head_dim, self.head_dim, self.n_heads, self.kv_heads)]

    def matmul_params(self) -> int:
        """Weights that take part in a matmul per token (everything but the embedding
        lookup and the norm scales), computed from the shapes alone."""
        d, hd, kv = self.dim, self.head_dim, self.kv_heads
        attn = d * self.n_heads * hd * 2 + d * kv * hd * 2  # wq, wo, wk, wv
        gate = {"none": 0, "headwise": d * self.n_heads, "elementwise": d * self.n_heads * hd}
        ffn = 3 * d * self.ffn_hidden_dim
        return self.n_layers * (attn + gate[self.attention_gate] + ffn) + d * self.vocab_size

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token: 6 per matmul weight (2 forward, 4 backward), plus the
        attention scores and weighted values, 6·L·H·(2·head_dim)·seq_len, counted without
        the causal discount as TorchTitan does so MFU figures compare."""
        attention = 6 * self.n_layers * self.n_heads * 2 * self.head_dim * seq_len
        return 6 * self.matmul_params() + attention

    def default_cosine_params(self) -> list[str]:
        """First and last block: the attention output projection and the FFN's w1."""
        return [f"layers.{layer}.{w}.weight" for layer in sorted({0, self.n_layers - 1})
                for w in (f"{self.ATTENTION}.wo", f"{self.FFN}.w1")]
