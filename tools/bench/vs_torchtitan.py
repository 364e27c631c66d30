"""Training speed and peak memory of gamma_titan's models against TorchTitan's own at the
identical shape, side by side in one process.

    .venv/bin/python tools/bench/vs_torchtitan.py [--pairs dense moe moe_mla] [--dense-flavor debug]
        [--moe-flavor debug] [--moe-mla-flavor debug_mla] [--seq-len 256] [--batch 8] [--reps 21]
        [--steps 1] [--compile] [--quick]

  dense: gamma_dense with attention_gate = "none" vs TorchTitan llama3
         (targets: tokens/s ratio >= 0.97, peak memory ratio <= 1.03)
  moe:   gamma_moe, MHA, gate "none", MoE in every layer vs TorchTitan qwen3 MoE
         (target: tokens/s ratio >= 0.95)
  moe_mla: gamma_moe, MLA, gate "none" vs TorchTitan deepseek_v3, same dense and MoE
         layers, experts, shared experts and routing (target: tokens/s ratio >= 1.0)

The MoE pairs add gamma_moe with its knobs on (elementwise gate; γ and ε change no
arithmetic): its tokens/s against TorchTitan's, next to what the gate's FLOPs predict
(target: within 2% of the prediction).

Both models of a pair get the same tokens, the same AdamW and the same training step
(tools/bench/common.py: forward, TorchTitan's loss, backward, clipping, step); their
parameter counts are checked to be equal. γ, ε and the init do not change the arithmetic,
so each model keeps its own. With --compile, each model goes through its own TrainSpec's
parallelize function with [compile] on (per-block torch.compile, as its trainer does) and
both losses are compiled. Rounds alternate between the two; the ratio lines come last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import reference  # noqa: E402  (imports gamma_titan first: CPU shims)
from common import (Variant, add_round_args, apply_quick, describe, device, header, interleave,  # noqa: E402
                    paired_ratio, peak_step_memory, random_tokens)  # noqa: E402

from gamma_titan.models.dense import GammaDense, dense_flavors  # noqa: E402
from gamma_titan.models.moe import GammaMoE, moe_flavors  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def settings(compile_: bool):
    """The [compile] / [activation_checkpoint] settings both models of a pair get."""
    from gamma_titan.config import load_job_config

    return load_job_config(["--job.config_file", str(REPO / "configs/dense/debug.toml"),
                            "--compile.enable", str(compile_).lower(), "--compile.components", "model,loss",
                            "--activation_checkpoint.mode", "none"])


def pair(ours, theirs, names: tuple[str, ...], spec_names: tuple[str, ...], vocab: int, seq_len: int,
         batch: int, compile_: bool, knobs_on=None) -> list[Variant]:
    """Ours, theirs (and ours with the knobs on, when given), ready to time."""
    from torchtitan.components.loss import build_cross_entropy_loss

    reference.same_parameter_count(ours, theirs)
    config = settings(compile_)
    tokens = random_tokens(vocab, batch, seq_len)
    variants = []
    models = (ours, theirs) if knobs_on is None else (ours, theirs, knobs_on)
    for model, name, spec in zip(models, names, spec_names):
        if compile_:
            model = reference.parallelize_one_process(model, spec, config)
            name += ", compiled"
        loss = build_cross_entropy_loss(config)
        variants.append(Variant(name, model, tokens, loss=lambda logits, labels, f=loss: f(logits, labels) / labels.numel()))
    return variants


def dense_pair(flavor: str, seq_len: int, batch: int, compile_: bool = False) -> list[Variant]:
    args = dataclasses.replace(dense_flavors[flavor], attention_gate="none", max_seq_len=seq_len)
    args.check()
    ours = reference.build(GammaDense, args, device())
    theirs = reference.llama3_model(args, device())
    return pair(ours, theirs, (f"gamma_dense {flavor}, gate none", "TorchTitan llama3, same shape"),
                ("gamma_dense", "llama3"), args.vocab_size, seq_len, batch, compile_)


def moe_pair(flavor: str, seq_len: int, batch: int, compile_: bool = False) -> list[Variant]:
    """gamma_moe MHA with MoE in every layer against TorchTitan's qwen3 MoE."""
    args = dataclasses.replace(moe_flavors[flavor], attention="mha", attention_gate="none", n_dense_layers=0,
                               max_seq_len=seq_len)
    return moe_against(args, reference.qwen3_moe_model, "qwen3", "TorchTitan qwen3 MoE", flavor, seq_len, batch,
                       compile_)


def moe_mla_pair(flavor: str, seq_len: int, batch: int, compile_: bool = False) -> list[Variant]:
    """gamma_moe MLA against TorchTitan's deepseek_v3."""
    args = dataclasses.replace(moe_flavors[flavor], attention="mla", attention_gate="none", max_seq_len=seq_len)
    return moe_against(args, reference.deepseek_v3_model, "deepseek_v3", "TorchTitan deepseek_v3", flavor, seq_len,
                       batch, compile_)


def moe_against(args, build_theirs, their_spec: str, their_name: str, flavor: str, seq_len: int, batch: int,
                compile_: bool) -> list[Variant]:
    """Ours (gate none), theirs at the same shape, and ours with the knobs on (the
    elementwise gate; γ and ε change no arithmetic), with their training FLOPs per token."""
    args.check()
    on = dataclasses.replace(args, attention_gate="elementwise")
    on.check()
    kind = args.attention.upper()
    variants = pair(reference.build(GammaMoE, args, device()), build_theirs(args, device()),
                    (f"gamma_moe {flavor}, {kind}, gate none", f"{their_name}, same shape",
                     f"gamma_moe {flavor}, {kind}, gate elementwise"),
                    ("gamma_moe", their_spec, "gamma_moe"), args.vocab_size, seq_len, batch, compile_,
                    knobs_on=reference.build(GammaMoE, on, device()))
    ours, theirs, gated = variants
    ours.flops_per_token = theirs.flops_per_token = args.flops_per_token(seq_len)  # the same arithmetic
    gated.flops_per_token = on.flops_per_token(seq_len)  # the gate's projection added
    return variants


#: pair: (TorchTitan's model, tokens/s target, peak memory target or None).
TARGETS = {"dense": ("llama3", 0.97, 1.03), "moe": ("qwen3 MoE", 0.95, None), "moe_mla": ("deepseek_v3", 1.0, None)}
PAIRS = {"dense": dense_pair, "moe": moe_pair, "moe_mla": moe_mla_pair}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument("--dense-flavor", default="debug", choices=list(dense_flavors))
    parser.add_argument("--moe-flavor", default="debug", choices=[f for f in moe_flavors if "mla" not in f])
    parser.add_argument("--moe-mla-flavor", default="debug_mla", choices=list(moe_flavors))
    parser.add_argument("--compile", action="store_true", help="both models compiled, as their trainers do")
    add_round_args(parser)
    ns = parser.parse_args(argv)
    apply_quick(ns)

    flavors = {"dense": ns.dense_flavor, "moe": ns.moe_flavor, "moe_mla": ns.moe_mla_flavor}
    results = {}
    for kind in ns.pairs:
        torch.manual_seed(0)
        variants = PAIRS[kind](flavors[kind], ns.seq_len, ns.batch, ns.compile)
        with reference.cpu_histc():
            interleave(variants, ns.reps, ns.steps, warmup=2 if ns.compile else 1)
            for v in variants:
                peak_step_memory(v)
        print(header(f"\n[{kind}]", ns.batch, ns.seq_len, ns.reps, ns.steps))
        for v in variants:
            print(describe(v))
        ours, theirs = variants[:2]
        knobs = None
        if len(variants) == 3:  # ours with the knobs on: against TorchTitan, and what FLOPs predict
            knobs = (paired_ratio(variants[2], theirs), theirs.flops_per_token / variants[2].flops_per_token)
        results[kind] = (paired_ratio(ours, theirs), ours.peak_bytes / theirs.peak_bytes, knobs)
        del variants, ours, theirs

    print()
    compiled = ", compiled" if ns.compile else ""
    for kind, (speed, memory, knobs) in results.items():
        name, speed_target, memory_target = TARGETS[kind]
        memory_note = f" (target <= {memory_target})" if memory_target else ""
        print(f"ratio {kind} gamma/{name}{compiled}: tokens/s {speed:.3f} (target >= {speed_target}), "
              f"peak memory {memory:.3f}{memory_note}")
        if knobs:
            on, predicted = knobs
            print(f"ratio {kind} gamma knobs on/{name}{compiled}: tokens/s {on:.3f}, the gate's FLOPs predict "
                  f"{predicted:.3f}: {on / predicted:.3f} of the prediction (target >= 0.98)")


if __name__ == "__main__":
    main()
