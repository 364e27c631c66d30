"""gamma_dense flavors: every shape in one table (fields, checks and counts: models/common/decoder_args.py).

The paper's dense models are the GPT-3 family widths (Brown et al. 2020, Table 2.1) with
RMSNorm and SwiGLU in place of LayerNorm and the GELU MLP. The SwiGLU width is ≈ 8/3·d
rounded up to a multiple of 256, which keeps the FFN's parameter count at the GPT-3
MLP's 8·d². Vocabulary sizes are the model's embedding rows; the tokenizer in use must
fit (checked before launch).
"""

from __future__ import annotations

from dataclasses import dataclass

from gamma_titan.models.common.decoder_args import AttentionFFNArgs
from gamma_titan.models.common.flavors import Flavors


@dataclass
class DenseModelArgs(AttentionFFNArgs):
    """The fields, checks and counts of models/common/decoder_args.py; the flavors below."""

    ATTENTION = "attention"
    FFN = "feed_forward"


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
