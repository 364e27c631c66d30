"""Overhead of live diagnostics ([gamma.diagnostics]) relative to training, in one process.

    .venv/bin/python tools/bench/diagnostics_overhead.py [--models debug 0.1B] [--seq-len 256]
                                                         [--batch 8] [--freq 100] [--reps 5]

For each model shape it alternates, `--reps` times: a few training steps (forward,
backward, gradient clipping, AdamW: what the trainer does per step) and one diagnostics
measurement (probe forward + stable ranks of every matrix), so both see the same machine
state. With medians t_step and t_diag, a run with diagnostics every `freq` steps takes

    on / off = (freq · t_step + t_diag) / (freq · t_step)

Reported for the warm-started measurement (every measurement of a run after its first)
and for a cold start (every power iteration from a random start, `COLD_ITERS` steps
instead of `WARM_ITERS`: an upper bound, since a run starts cold once). The row-cosine
maps (every 10·freq steps) are timed too and amortised over 10·freq steps. The last line
is the ratio the ≤ 1.02 target is about: at the 0.1B shape (else the largest model
given), warm, with the cold-start upper bound beside it.
"""

from __future__ import annotations

import statistics
import time

import torch

import gamma_titan  # noqa: F401  (CPU shims before TorchTitan)
from gamma_titan.config import Diagnostics
from gamma_titan.config.flags import Parser, count
from gamma_titan.diagnostics import LiveDiagnostics
from gamma_titan.diagnostics.spectral import StableRanks
from gamma_titan.models.dense import GammaDense, dense_flavors


def train_step(model, optimizer, tokens) -> None:
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f}s (min {min(values):.3f}, max {max(values):.3f})"


def bench(flavor: str, seq_len: int, batch: int, freq: int, reps: int, steps_between: int) -> dict[str, float]:
    args = dense_flavors[flavor]
    args.max_seq_len = max(args.max_seq_len, seq_len)
    args.check()
    torch.manual_seed(0)
    model = GammaDense(args)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    batch_tokens = torch.randint(0, args.vocab_size, (batch, seq_len + 1), generator=gen)
    cfg = Diagnostics(enable=True, freq=freq)
    probe = torch.randint(0, args.vocab_size, (cfg.probe_batch, seq_len), generator=gen)
    live = LiveDiagnostics(cfg, model, probe)

    train_step(model, optimizer, batch_tokens)  # warm-up: allocator, first-call costs
    live.measure(step=1, with_images=False)     # the cold first measurement
    step_times, warm, cold, cosine = [], [], [], []
    for _ in range(reps):
        step_times += [timed(lambda: train_step(model, optimizer, batch_tokens)) for _ in range(steps_between)]
        warm.append(timed(lambda: live.measure(step=freq, with_images=False)))
        saved, live.stable_ranks = live.stable_ranks, StableRanks()
        cold.append(timed(lambda: live.measure(step=freq, with_images=False)))
        live.stable_ranks = saved
        cosine.append(timed(live.cosine_maps))
    t_step, t_warm, t_cold = (statistics.median(v) for v in (step_times, warm, cold))
    t_cosine = statistics.median(cosine) / 10  # every 10 x freq steps
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\n{flavor} ({n_params / 1e6:.1f}M params), batch {batch} x seq {seq_len}, probe {cfg.probe_batch} "
          f"sequences, {torch.get_num_threads()} threads")
    print(f"  training step            {spread(step_times)}")
    print(f"  diagnostics, warm start  {spread(warm)}")
    print(f"  diagnostics, cold start  {spread(cold)}")
    print(f"  row-cosine maps          {spread(cosine)}  (every {10 * freq} steps)")
    window = freq * t_step
    ratios = {"warm": (window + t_warm + t_cosine) / window, "cold": (window + t_cold + t_cosine) / window}
    print(f"  on/off time at freq {freq}: warm {ratios['warm']:.4f}, cold (upper bound) {ratios['cold']:.4f}")
    return ratios


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["debug", "0.1B"])
    parser.add_argument("--seq-len", type=count(1), default=256)
    parser.add_argument("--batch", type=count(1), default=8)
    parser.add_argument("--freq", type=count(1), default=100)
    parser.add_argument("--reps", type=count(1), default=3)
    parser.add_argument("--steps-between", type=count(1), default=2)
    parser.add_argument("--quick", action="store_true", help="debug model, small batch, one repetition (CI)")
    ns = parser.parse_args()
    if ns.quick:
        ns.models, ns.seq_len, ns.batch, ns.reps, ns.steps_between = ["debug"], 64, 2, 1, 1
    ratios = {m: bench(m, ns.seq_len, ns.batch, ns.freq, ns.reps, ns.steps_between) for m in ns.models}
    model = "0.1B" if "0.1B" in ratios else ns.models[-1]
    print(f"\nratio diagnostics on/off training time at freq {ns.freq} ({model}): {ratios[model]['warm']:.4f} warm, "
          f"{ratios[model]['cold']:.4f} cold start (an upper bound) (target <= 1.02)")


if __name__ == "__main__":
    main()
