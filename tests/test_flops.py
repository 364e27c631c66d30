"""The FLOPs per token behind the trainer's TFLOP/s and MFU, against an independent count.

TorchTitan's Trainer logs tflops = flops_per_token · tokens/s and mfu = tflops / peak,
with flops_per_token from `model_args.get_nparams_and_flops(model, training.seq_len)`.
The reference here does not look at the formula: it runs one training step (forward and
backward) under `torch.utils.flop_counter.FlopCounterMode`, which counts every matmul the
step executes from the operands' shapes: the projections, the gate, grouped KV heads,
the MLA low-rank projections, the router and exactly the experts each token was sent to.

Conventions the trainer follows (TorchTitan's, so MFU figures compare with its own):
attention is counted without the causal discount, and flash attention's recomputation
of the scores in the backward pass is not counted. FlopCounterMode knows the CUDA flash
kernels but not the CPU one, so the CPU kernel's counts are given here with the same
formulas torch uses for the CUDA kernels, minus that recomputation.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, bmm_flop, sdpa_backward_flop_count, sdpa_flop_count

import gamma_titan  # noqa: F401  (CPU shims, TrainSpecs)
from gamma_titan.config import load_job_config
from gamma_titan.training.train_spec import resolve_model
from helpers import REPO

aten = torch.ops.aten


def _cpu_flash_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    b, h, s_q, d_q = query
    recomputed_scores = bmm_flop((b * h, s_q, d_q), (b * h, d_q, key[2]))
    return sdpa_backward_flop_count(grad_out, query, key, value) - recomputed_scores


CPU_FLASH_ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}

SEQ_LEN, BATCH = 64, 2

VARIANTS = {
    "dense-none": ("configs/dense/debug.toml", ["--gamma.attention_gate", "none"]),
    "dense-headwise": ("configs/dense/debug.toml", ["--gamma.attention_gate", "headwise"]),
    "dense-elementwise": ("configs/dense/debug.toml", ["--gamma.attention_gate", "elementwise"]),
    "moe-mha-elementwise": ("configs/moe/debug.toml", []),
    "moe-mha-headwise": ("configs/moe/debug.toml", ["--gamma.attention_gate", "headwise"]),
    "moe-mla-elementwise": ("configs/moe/debug_mla.toml", []),
    "moe-mla-none": ("configs/moe/debug_mla.toml", ["--gamma.attention_gate", "none"]),
}


def counted_training_flops(model: torch.nn.Module, vocab_size: int) -> int:
    tokens = torch.randint(0, vocab_size, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False, custom_mapping=CPU_FLASH_ATTENTION) as counter:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("variant", VARIANTS)
def test_trainer_flops_per_token_match_counted_flops(variant):
    toml, overrides = VARIANTS[variant]
    config = load_job_config(["--job.config_file", str(REPO / toml), "--training.seq_len", str(SEQ_LEN),
                              *overrides])
    spec, args = resolve_model(config)  # the spec and args the Trainer builds
    torch.manual_seed(0)
    model = spec.model_cls(args)
    model.init_weights()
    _, trainer_flops = args.get_nparams_and_flops(model, config.training.seq_len)  # as Trainer.__init__

    counted = counted_training_flops(model, args.vocab_size) / (BATCH * SEQ_LEN)
    assert trainer_flops == counted, f"{variant}: trainer {trainer_flops:,} vs counted {counted:,.0f} FLOPs/token"


def test_gate_flops_are_counted():
    """The three gates differ by exactly their projection's 6·d_in·d_out per layer."""
    config = load_job_config(["--job.config_file", str(REPO / "configs/dense/debug.toml")])
    flops = {}
    for gate in ("none", "headwise", "elementwise"):
        _, args = resolve_model(load_job_config(
            ["--job.config_file", str(REPO / "configs/dense/debug.toml"), "--gamma.attention_gate", gate]))
        flops[gate] = args.flops_per_token(config.training.seq_len)
    d, heads, layers = args.dim, args.n_heads, args.n_layers
    assert flops["headwise"] - flops["none"] == 6 * layers * d * heads
    assert flops["elementwise"] - flops["none"] == 6 * layers * d * heads * args.head_dim
