"""What the step guard ([gamma.reliability]: non-finite check, loss spikes, SIGTERM
agreement) costs per training step, side by side with the same step without it.

    .venv/bin/python tools/bench/step_guard.py [--flavor debug] [--seq-len 256] [--batch 8]
        [--reps 21] [--steps 1] [--quick]

Both variants run TorchTitan's step on the same model shape and tokens (forward, loss,
backward, gradient clipping, AdamW). The guarded one also does what GammaTrainer adds to
each step: `step_verdict` (the one host read of the step's loss, gradient norm and
SIGTERM votes; on several ranks also one all-reduce of three numbers, not timed here),
the guard's decision and the loss-spike window, and applies the update only when the
guard allows. Target: <= 1.01x the time per token. The ratio line comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import reference  # noqa: E402  (imports gamma_titan first: CPU shims)
from common import (Variant, add_round_args, apply_quick, describe, device, header, interleave,  # noqa: E402
                    loss_fn, paired_ratio, random_tokens)

from gamma_titan.config import Reliability  # noqa: E402
from gamma_titan.models.dense import GammaDense, dense_flavors  # noqa: E402
from gamma_titan.training.step_guard import StepGuard, step_verdict  # noqa: E402


@dataclasses.dataclass
class GuardedVariant(Variant):
    guard: StepGuard | None = None

    def step(self) -> None:
        loss = loss_fn(self.model(self.tokens[:, :-1]), self.tokens[:, 1:])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        apply = True
        if self.guard is not None:
            verdict = step_verdict(loss.detach(), norm, stop_requested=False)
            apply = self.guard.check(0, verdict.grad_norm, verdict.loss)
            self.guard.spikes.observe(verdict.loss)
        if apply:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debug")
    add_round_args(parser, reps=41)
    ns = parser.parse_args(argv)
    apply_quick(ns)
    args = dataclasses.replace(dense_flavors[ns.flavor], max_seq_len=ns.seq_len)
    args.check()
    tokens = random_tokens(args.vocab_size, ns.batch, ns.seq_len)
    variants = []
    for name, guard in (("no guard", None), ("guard (gamma.reliability defaults)", StepGuard(Reliability()))):
        torch.manual_seed(0)
        model = reference.build(GammaDense, args, device())
        variants.append(GuardedVariant(f"dense {ns.flavor}, {name}", model, tokens, guard=guard))
    interleave(variants, ns.reps, ns.steps)

    print(header(f"step guard cost, dense {ns.flavor}", ns.batch, ns.seq_len, ns.reps, ns.steps))
    for v in variants:
        print(describe(v))
    plain, guarded = variants
    # The guard's own work, timed alone (a few microseconds: far below the rounds' spread).
    loss, norm, guard = torch.tensor(2.5, device=device()), torch.tensor(1.0, device=device()), StepGuard(Reliability())
    calls = 2000
    start = time.perf_counter()
    for _ in range(calls):
        verdict = step_verdict(loss, norm, stop_requested=False)
        guard.check(0, verdict.grad_norm, verdict.loss)
        guard.spikes.observe(verdict.loss)
    per_call = (time.perf_counter() - start) / calls
    step = plain.tokens_per_step / plain.median()
    print(f"\nthe guard's own work: {per_call * 1e6:.1f} us per step, {per_call / step:.5%} of a step "
          f"({step * 1e3:.0f} ms)")
    print(f"ratio guard on/off: {paired_ratio(plain, guarded):.4f}x the time per token (target <= 1.01)")


if __name__ == "__main__":
    main()
