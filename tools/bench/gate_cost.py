"""What the attention gate costs in training speed, against what its FLOPs predict.

    .venv/bin/python tools/bench/gate_cost.py [--model dense|moe] [--flavor debug]
        [--seq-len 256] [--batch 8] [--reps 21] [--steps 1] [--quick]

One model shape with attention_gate = "none", "headwise" and "elementwise", timed in
turns (tools/bench/common.py). The prediction is the ratio of training FLOPs per token
that `gamma-titan inspect` reports (gate projection included; tests/test_flops.py checks
that count against the matmuls a step executes). Targets:
  elementwise: (time per token with the gate / without) / (predicted FLOP ratio) <= 1.02
  headwise:    time per token with the gate / without <= 1.02
The ratio lines come last.
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

GATES = ("none", "headwise", "elementwise")
MODELS = {"dense": (GammaDense, dense_flavors), "moe": (GammaMoE, moe_flavors)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(MODELS), default="dense")
    parser.add_argument("--flavor", default="debug")
    add_round_args(parser)
    ns = parser.parse_args(argv)
    apply_quick(ns)
    model_cls, flavors = MODELS[ns.model]
    if ns.flavor not in flavors:
        parser.error(f"--flavor {ns.flavor!r}: allowed for {ns.model}: {', '.join(flavors)}")

    variants, flops = [], {}
    for gate in GATES:
        args = dataclasses.replace(flavors[ns.flavor], attention_gate=gate, max_seq_len=ns.seq_len)
        args.check()
        flops[gate] = args.flops_per_token(ns.seq_len)
        torch.manual_seed(0)
        model = reference.build(model_cls, args, device())
        tokens = random_tokens(args.vocab_size, ns.batch, ns.seq_len)
        variants.append(Variant(f"{ns.model} {ns.flavor}, gate {gate}", model, tokens, flops[gate]))
    interleave(variants, ns.reps, ns.steps)
    for v in variants:
        peak_step_memory(v)

    print(header(f"attention gate cost, {ns.model} {ns.flavor}", ns.batch, ns.seq_len, ns.reps, ns.steps))
    for v, gate in zip(variants, GATES):
        print(describe(v) + f"   {flops[gate] / 1e6:,.2f} MFLOP/token")
    none, headwise, elementwise = variants
    slow_head = paired_ratio(none, headwise)
    slow_elem = paired_ratio(none, elementwise)
    predicted = flops["elementwise"] / flops["none"]
    print(f"\nratio headwise: {slow_head:.4f}x the time per token of no gate "
          f"(FLOPs predict {flops['headwise'] / flops['none']:.4f}x; target <= 1.02)")
    print(f"ratio elementwise: {slow_elem:.4f}x the time per token of no gate, FLOPs predict {predicted:.4f}x: "
          f"{slow_elem / predicted:.4f} of the prediction (target <= 1.02)")


if __name__ == "__main__":
    main()
