"""gamma_dense shapes: every flavor in one table, and the checks a shape must pass.

The paper's dense models are the GPT-3 family widths (Brown et al. 2020, Table 2.1) with
RMSNorm and SwiGLU in place of LayerNorm and the GELU MLP. The SwiGLU width is ≈ 8/3·d
rounded up to a multiple of 256, which keeps the FFN's parameter count at the GPT-3
MLP's 8·d². Vocabulary sizes are the model's embedding rows; the tokenizer in use must
fit (checked before launch).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gamma_titan.init import GammaInit
from gamma_titan.models.common.args import GammaArgs
from gamma_titan.models.common.flavors import Flavors
from gamma_titan.models.common.sdpa_kernels import AttentionShape
from gamma_titan.models.common.shapes import (
    HeadShape,
    check_heads,
    check_rope,
    check_positive_ints,
    check_tensor_parallel,
)


@dataclass
class DenseModelArgs(HeadShape, GammaArgs):
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
        return ["output"] + (["attention.gate_proj"] if self.attention_gate == "headwise" else [])

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
                for w in ("attention.wo", "feed_forward.w1")]


dense_flavors = Flavors(
    {
        # Small enough to train at thousands of tokens/s on 2 CPU cores; GQA on so the
        # grouped-KV path is exercised everywhere the debug model runs.
        "debug": DenseModelArgs(
            dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=704,
            vocab_size=4096, max_seq_len=512,
        ),
        # The recipes' CPU scale (recipes/*.toml, --scale tiny): a 512-token vocabulary and
        # two layers, so 20 tokens per parameter take minutes on 2 cores. The widths give
        # the scaling recipe four sizes; 128 is the narrowest where ε = 1e-5 dominates σ²(h)
        # at γ = 1 (the ε ablation's). SwiGLU width ≈ 8/3·d rounded up to 32.
        **{f"tiny-{d}": DenseModelArgs(dim=d, n_layers=2, n_heads=2, ffn_hidden_dim=ffn, vocab_size=512,
                                       max_seq_len=256)
           for d, ffn in ((32, 96), (48, 128), (64, 192), (96, 256), (128, 352))},
        # The recipes' one-GPU scale (--scale gpu): 8 layers of width 256–768 (64-wide heads)
        # with a 4096-token vocabulary: wide enough for ε to dominate at γ = 1 and for the
        # residual flow d^(1−γ) to be small at γ = 1.5, small enough for ~20 tokens per
        # parameter in minutes per run on one H100. SwiGLU ≈ 8/3·d rounded up to 128.
        **{f"gpu-{d}": DenseModelArgs(dim=d, n_layers=8, n_heads=d // 64, ffn_hidden_dim=ffn, vocab_size=4096,
                                      max_seq_len=1024)
           for d, ffn in ((256, 768), (384, 1024), (512, 1408), (768, 2048))},
        # The paper's sizes: GPT-3 Small / Medium / Large / XL.
        "0.1B": DenseModelArgs(dim=768, n_layers=12, n_heads=12, ffn_hidden_dim=2048),
        "0.3B": DenseModelArgs(dim=1024, n_layers=24, n_heads=16, ffn_hidden_dim=2816),
        "0.7B": DenseModelArgs(dim=1536, n_layers=24, n_heads=16, ffn_hidden_dim=4096),
        "1.5B": DenseModelArgs(dim=2048, n_layers=24, n_heads=16, ffn_hidden_dim=5632),
        # Cluster size: Llama-2-7B widths with GQA 4:1 and a 128k vocabulary.
        "7B": DenseModelArgs(
            dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden_dim=11008,
            vocab_size=128256, rope_theta=500000.0, max_seq_len=8192,
        ),
    }
)
