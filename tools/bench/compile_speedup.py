"""torch.compile against eager for the debug shapes, with the gate and with MoE.

    .venv/bin/python tools/bench/compile_speedup.py [--models dense moe moe_mla]
        [--gate elementwise] [--seq-len 256] [--batch 8] [--reps 5] [--steps 3] [--quick]

Each model is built twice from its config (configs/dense/debug.toml, configs/moe/debug.toml,
configs/moe/debug_mla.toml) and goes through its TrainSpec's `parallelize_fn` on one
process, once with [compile] enable = false and once with enable = true, components
["model", "loss"]: the compiled variant is exactly what the trainer runs (TorchTitan's
per-block compile, the loss compiled too). Compile time (the warm-up steps) is reported
apart from the timed rounds. The ratio lines (compiled / eager tokens/s) come last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import reference  # noqa: E402  (imports gamma_titan first: CPU shims)
from common import (Variant, add_round_args, apply_quick, describe, device, header, interleave,  # noqa: E402
                    paired_ratio, random_tokens)

from gamma_titan.config import load_job_config  # noqa: E402
from gamma_titan.training.train_spec import resolve_model  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = {"dense": "configs/dense/debug.toml", "moe": "configs/moe/debug.toml",
           "moe_mla": "configs/moe/debug_mla.toml"}


def variant(model_name: str, gate: str, compiled: bool, seq_len: int, batch: int) -> Variant:
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.distributed import ParallelDims

    config = load_job_config([
        "--job.config_file", str(REPO / CONFIGS[model_name]), "--gamma.attention_gate", gate,
        "--training.seq_len", str(seq_len), "--compile.enable", str(compiled).lower(),
        "--compile.components", "model,loss",
    ])
    spec, args = resolve_model(config)
    torch.manual_seed(0)
    model = reference.build(spec.model_cls, args, device())
    one_process = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = spec.parallelize_fn(model, one_process, config)
    loss = build_cross_entropy_loss(config)  # compiled when [compile] says so
    name = f"{model_name} debug, gate {gate}, {'compiled' if compiled else 'eager'}"
    return Variant(name, model, random_tokens(args.vocab_size, batch, seq_len),
                   loss=lambda logits, labels: loss(logits, labels) / labels.numel())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(CONFIGS), default=["dense", "moe"])
    parser.add_argument("--gate", default="elementwise", choices=["none", "headwise", "elementwise"])
    add_round_args(parser, reps=5, steps=3, quick_help="dense only, small batch, 1 round of 1 step (CI)")
    ns = parser.parse_args(argv)
    apply_quick(ns)
    if ns.quick:
        ns.models = ["dense"]

    speedups = {}
    for name in ns.models:
        eager = variant(name, ns.gate, False, ns.seq_len, ns.batch)
        compiled = variant(name, ns.gate, True, ns.seq_len, ns.batch)
        start = time.perf_counter()
        compiled.step()  # compiles
        compile_s = time.perf_counter() - start
        with reference.cpu_histc():
            interleave([eager, compiled], ns.reps, ns.steps, warmup=2)
        print(header(f"\n[{name}] torch.compile (first step with compilation: {compile_s:.1f} s)",
                     ns.batch, ns.seq_len, ns.reps, ns.steps))
        print(describe(eager))
        print(describe(compiled))
        speedups[name] = paired_ratio(compiled, eager)
    print()
    for name, speedup in speedups.items():
        print(f"ratio {name} compiled / eager tokens/s: {speedup:.3f}")


if __name__ == "__main__":
    main()
