"""gamma_moe shapes: every flavor in one table, the checks a shape must pass, and the
parameter and FLOP counts (total and active per token).

The paper's MoE models (§2.3, §4.1) have many small routed experts plus shared experts,
with conventional multi-head attention (MHA) or multi-head latent attention (MLA). Their
exact shapes are not published; ours follow the same design at the stated sizes: about
1.5B total / 0.25B active and 3B / 0.5B (active counted without the embedding and the
output head, which add 0.1B / 0.15B).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.models.moe.moe import MoEArgs

from gamma_titan.errors import ConfigError
from gamma_titan.init import GammaInit
from gamma_titan.models.common.args import GammaArgs
from gamma_titan.models.common.flavors import Flavors
from gamma_titan.models.common.moe import EXPERT_KERNELS
from gamma_titan.models.common.sdpa_kernels import AttentionShape
from gamma_titan.models.common.shapes import (
    HeadShape,
    check_heads,
    check_rope,
    check_positive_ints,
    check_tensor_parallel,
)

ATTENTION_KINDS = ("mha", "mla")
SCORE_FUNCS = ("sigmoid", "softmax")


@dataclass
class MoEModelArgs(HeadShape, GammaArgs):
    dim: int = 1024
    n_layers: int = 13
    n_heads: int = 16
    n_kv_heads: int | None = None  # MHA only: fewer = grouped-query attention
    vocab_size: int = 50304
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    attention: str = "mha"  # "mha" | "mla"
    # MLA (attention = "mla")
    q_lora_rank: int = 0  # 0: queries straight from the input
    kv_lora_rank: int = 256
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 32
    v_head_dim: int = 64
    # feed-forward: the first n_dense_layers are dense SwiGLU, the rest MoE
    n_dense_layers: int = 1
    ffn_hidden_dim: int = 2816  # width of the dense layers' SwiGLU
    moe_hidden_dim: int = 512  # width of one expert (shared experts: the same each)
    n_routed_experts: int = 72
    n_shared_experts: int = 2
    top_k: int = 6
    score_func: str = "sigmoid"
    route_norm: bool = True
    route_scale: float = 1.0
    load_balance_coeff: float | None = 1e-3  # aux-loss-free expert-bias step; None = off
    aux_loss_coeff: float = 0.0  # α of the optional auxiliary balance loss; 0 = off
    # the routed experts' kernel: "auto" (grouped GEMMs on CUDA, the exact fp32 loop
    # elsewhere), "grouped" or "loop" everywhere (models/common/moe.py, RoutedExperts)
    expert_kernel: str = "auto"
    # The paper's three knobs, set from [gamma].
    norm_eps: float = 1e-12
    attention_gate: str = "elementwise"
    init: GammaInit = field(default_factory=GammaInit)

    # --- derived --------------------------------------------------------------------

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.attention == "mha" else self.qk_rope_head_dim

    def attention_shapes(self) -> list[AttentionShape]:
        """The attention kinds of the model in SDPA's numbers (for the start-up kernel
        report): MHA/GQA, or MLA with q/k head dim nope + rope and its own v head dim
        (keys and values per head)."""
        if self.attention == "mha":
            return [AttentionShape("mha", self.head_dim, self.head_dim, self.n_heads, self.kv_heads)]
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return [AttentionShape("mla", qk, self.v_head_dim, self.n_heads, self.n_heads)]

    def moe_args(self) -> MoEArgs:
        return MoEArgs(
            num_experts=self.n_routed_experts,
            num_shared_experts=self.n_shared_experts,
            score_func=self.score_func,
            route_norm=self.route_norm,
            route_scale=self.route_scale,
            top_k=self.top_k,
            use_grouped_mm=self.expert_kernel != "loop",  # RoutedExperts decides per call
            load_balance_coeff=self.load_balance_coeff,
        )

    # --- checks ---------------------------------------------------------------------

    def check(self) -> None:
        check_positive_ints(self, ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "moe_hidden_dim",
                                   "n_routed_experts", "top_k", "ffn_hidden_dim", "kv_lora_rank",
                                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"))
        for key in ("n_dense_layers", "n_shared_experts", "q_lora_rank"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"model_args.{key} = {value!r}: must be an integer >= 0")
        if self.attention not in ATTENTION_KINDS:
            raise ConfigError(f"model_args.attention = {self.attention!r}: allowed {', '.join(ATTENTION_KINDS)}")
        check_rope(self)
        if self.expert_kernel not in EXPERT_KERNELS:
            raise ConfigError(f"model_args.expert_kernel = {self.expert_kernel!r}: allowed {', '.join(EXPERT_KERNELS)}")
        if self.score_func not in SCORE_FUNCS:
            raise ConfigError(f"model_args.score_func = {self.score_func!r}: allowed {', '.join(SCORE_FUNCS)}")
        if self.top_k > self.n_routed_experts:
            raise ConfigError(f"model_args.top_k = {self.top_k} exceeds model_args.n_routed_experts = "
                              f"{self.n_routed_experts}")
        if self.n_dense_layers >= self.n_layers:
            raise ConfigError(f"model_args.n_dense_layers = {self.n_dense_layers} leaves no MoE layer "
                              f"of model_args.n_layers = {self.n_layers}")
        if not self.route_scale > 0:
            raise ConfigError(f"model_args.route_scale = {self.route_scale!r}: must be > 0")
        if not isinstance(self.aux_loss_coeff, (int, float)) or self.aux_loss_coeff < 0:
            raise ConfigError(f"model_args.aux_loss_coeff = {self.aux_loss_coeff!r}: must be >= 0 (0 = off)")
        if self.load_balance_coeff is not None and not self.load_balance_coeff > 0:
            raise ConfigError(f"model_args.load_balance_coeff = {self.load_balance_coeff!r}: must be > 0 (or unset)")
        if self.attention == "mha":
            check_heads(self)
            return
        if self.n_kv_heads is not None:
            raise ConfigError("model_args.n_kv_heads does not apply to MLA (attention = \"mla\")")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model_args.qk_rope_head_dim = {self.qk_rope_head_dim}: must be even (rotary)")
        if self.kv_lora_rank >= self.dim or self.q_lora_rank >= self.dim:
            raise ConfigError(
                f"MLA ranks must compress: model_args.kv_lora_rank = {self.kv_lora_rank} and "
                f"model_args.q_lora_rank = {self.q_lora_rank} must be < model_args.dim = {self.dim}"
            )

    def float8_excluded_fqns(self) -> list[str]:
        """The dense model's (output head, headwise gate) and the router: its scores pick
        the experts, and float8 rounding would reorder near-ties."""
        return ["output", "moe.router.gate"] + (["attention.gate_proj"] if self.attention_gate == "headwise" else [])

    def check_parallelism(self, layout) -> None:
        """Heads and MLP widths split by TP; routed experts by EP (parallelize_moe's own
        contract refuses EP with TP)."""
        check_tensor_parallel(self, layout.tp, ("ffn_hidden_dim", "moe_hidden_dim"))
        if layout.ep <= 1:
            return
        if self.n_routed_experts % layout.ep:
            raise ConfigError(f"parallelism.expert_parallel_degree = {layout.ep} must divide "
                              f"model_args.n_routed_experts = {self.n_routed_experts}")

    def expert_parallel_divisor(self) -> int:
        return self.n_routed_experts

    def supports_pipeline_parallel(self) -> bool:
        return True  # the decoder's forward takes a stage's cut (models/common/decoder.py)

    def supports_context_parallel(self) -> bool:
        return True  # the decoder's forward takes `positions`; attention's SDPA is a module

    def unsupported_keys(self) -> dict[str, str]:
        return super().unsupported_keys() | {
            "parallelism.expert_parallel_comm_backend": "its expert parallelism is its own all-to-all "
                                                        "(models/moe/expert_parallel.py); DeepEP is not wired"}

    def default_cosine_params(self) -> list[str]:
        """First and last block: the attention output projection and the first FFN input
        projection (a dense layer's, else the shared experts', if any)."""
        chosen = []
        for layer in sorted({0, self.n_layers - 1}):
            chosen.append(f"layers.{layer}.attention.wo.weight")
            if layer < self.n_dense_layers:
                chosen.append(f"layers.{layer}.feed_forward.w1.weight")
            elif self.n_shared_experts:
                chosen.append(f"layers.{layer}.moe.shared_experts.w1.weight")
        return chosen

    # --- counts ---------------------------------------------------------------------

    def _attention_params(self) -> int:
        d, h = self.dim, self.n_heads
        if self.attention == "mha":
            hd, kv = self.head_dim, self.kv_heads
            params = d * h * hd * 2 + d * kv * hd * 2
            v_width = hd
        else:
            qk = self.qk_nope_head_dim + self.qk_rope_head_dim
            q = d * h * qk if self.q_lora_rank == 0 else d * self.q_lora_rank + self.q_lora_rank * h * qk
            params = (q + d * (self.kv_lora_rank + self.qk_rope_head_dim)
                      + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
                      + h * self.v_head_dim * d)
            v_width = self.v_head_dim
        gate = {"none": 0, "headwise": d * h, "elementwise": d * h * v_width}[self.attention_gate]
        return params + gate

    def _expert_params(self) -> int:
        return 3 * self.dim * self.moe_hidden_dim

    def matmul_params(self, active: bool) -> int:
        """Matmul weights (no embedding lookup, no norm scales); `active`: only those one
        token passes through (top_k of the routed experts)."""
        n_moe = self.n_layers - self.n_dense_layers
        routed = self.top_k if active else self.n_routed_experts
        moe = (routed + self.n_shared_experts) * self._expert_params() + self.dim * self.n_routed_experts
        dense = 3 * self.dim * self.ffn_hidden_dim
        return (self.n_layers * self._attention_params() + self.n_dense_layers * dense + n_moe * moe
                + self.dim * self.vocab_size)

    def active_params(self) -> int:
        """Parameters one token uses: active matmul weights, its embedding row aside."""
        return self.matmul_params(active=True)

    def flops_per_token(self, seq_len: int) -> int:
        """6 per active matmul weight + attention (TorchTitan's convention, no causal discount)."""
        if self.attention == "mha":
            per_head = 2 * self.head_dim
        else:
            per_head = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        return 6 * self.matmul_params(active=True) + 6 * self.n_layers * self.n_heads * per_head * seq_len



def _mla(**shape) -> dict:
    return dict(attention="mla", **shape)


_DEBUG = dict(dim=256, n_layers=4, n_heads=4, vocab_size=4096, max_seq_len=512, n_dense_layers=1,
              ffn_hidden_dim=704, moe_hidden_dim=128, n_routed_experts=8, n_shared_experts=1, top_k=2)
_DEBUG_MLA = dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
_TINY = dict(dim=64, n_layers=2, n_heads=2, vocab_size=512, max_seq_len=256, n_dense_layers=1,
             ffn_hidden_dim=192, moe_hidden_dim=32, n_routed_experts=16, n_shared_experts=1, top_k=2)
_GPU = dict(dim=512, n_layers=8, n_heads=8, vocab_size=4096, max_seq_len=1024, n_dense_layers=1,
            ffn_hidden_dim=1408, moe_hidden_dim=256, n_routed_experts=32, n_shared_experts=1, top_k=4)
_1_5B = dict(dim=1024, n_layers=13, n_heads=16, n_dense_layers=1, ffn_hidden_dim=2816,
             moe_hidden_dim=512, n_routed_experts=72, n_shared_experts=2, top_k=6)
_1_5B_MLA = dict(kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64)
_3B = dict(dim=1536, n_layers=14, n_heads=16, n_dense_layers=1, ffn_hidden_dim=4096,
           moe_hidden_dim=640, n_routed_experts=64, n_shared_experts=2, top_k=6)
_3B_MLA = dict(kv_lora_rank=384, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=96)

moe_flavors = Flavors(
    {
        "debug": MoEModelArgs(**_DEBUG),
        "debug_mla": MoEModelArgs(**_mla(**_DEBUG, **_DEBUG_MLA)),
        # The recipes' CPU scale (--scale tiny): the paper's two MoE sizes shrunk to a
        # 512-token vocabulary, one dense layer then one MoE layer of 16 small experts.
        "tiny": MoEModelArgs(**_TINY),
        "tiny-2x": MoEModelArgs(**{**_TINY, "dim": 96, "ffn_hidden_dim": 256, "moe_hidden_dim": 48}),
        # The recipes' one-GPU scale (--scale gpu): 8 layers (1 dense) of 32 fine-grained
        # experts, top-4, plus a shared one, 4096-token vocabulary.
        "gpu": MoEModelArgs(**_GPU),
        "gpu-2x": MoEModelArgs(**{**_GPU, "dim": 768, "n_heads": 12, "ffn_hidden_dim": 2048, "moe_hidden_dim": 384}),
        "1.5B-A0.25B": MoEModelArgs(**_1_5B),
        "1.5B-A0.25B-mla": MoEModelArgs(**_mla(**_1_5B, **_1_5B_MLA)),
        "3B-A0.5B": MoEModelArgs(**_3B),
        "3B-A0.5B-mla": MoEModelArgs(**_mla(**_3B, **_3B_MLA)),
        # Cluster size: DeepSeek-V2-Lite-like (MLA, 64 routed + 2 shared experts, top-6).
        "16B-A2.4B": MoEModelArgs(**_mla(
            dim=2048, n_layers=27, n_heads=16, vocab_size=102400, n_dense_layers=1,
            ffn_hidden_dim=10944, moe_hidden_dim=1408, n_routed_experts=64, n_shared_experts=2,
            top_k=6, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
            max_seq_len=4096,
        )),
    }
)
