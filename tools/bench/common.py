"""What the model benchmarks share: the training step, interleaved timing, peak memory,
and how results are printed.

A benchmark builds a few `Variant`s (a model and its optimizer) and `interleave` times
them in turns, `reps` rounds of `steps` training steps each, so every variant sees the
same machine state (these machines are noisy: ratios are only meaningful side by side).
Each variant reports median tokens/s with its spread (min..max over the rounds); ratios
are the median of per-round ratios (`paired_ratio`).

Peak memory is what one training step needs at its highest point, parameters and
optimizer state included: `torch.cuda.max_memory_allocated` on a GPU, and on the CPU the
same quantity reconstructed from the PyTorch profiler's memory timeline (every tensor
allocation and free of the step, plus the tensors alive when it starts).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from gamma_titan.config.flags import count


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TorchTitan's training loss: summed cross-entropy in fp32, divided by the token count."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(logits, labels) / labels.numel()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               max_norm: float = 1.0, loss=loss_fn) -> None:
    """What TorchTitan's Trainer.train_step does for one micro-batch: forward, loss,
    backward, gradient clipping, optimizer step."""
    logits = model(tokens[:, :-1])
    loss = loss(logits, tokens[:, 1:])
    del logits  # as the Trainer does: free the logits before backward
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@dataclass
class Variant:
    name: str
    model: torch.nn.Module
    tokens: torch.Tensor  # (batch, seq_len + 1)
    flops_per_token: int | None = None
    optimizer: torch.optim.Optimizer | None = None
    loss: Callable = loss_fn
    tokens_per_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=torch.cuda.is_available())

    @property
    def tokens_per_step(self) -> int:
        return self.tokens[:, 1:].numel()

    def step(self) -> None:
        train_step(self.model, self.optimizer, self.tokens, loss=self.loss)

    def median(self) -> float:
        return statistics.median(self.tokens_per_s)


def interleave(variants: list[Variant], reps: int, steps: int, warmup: int = 1) -> None:
    """Time the variants in turns: `warmup` untimed steps each, then `reps` rounds of
    `steps` timed steps per variant; tokens/s of each round go to `variant.tokens_per_s`."""
    for v in variants:
        for _ in range(warmup):
            v.step()
    synchronize()
    for rep in range(reps):
        order = variants if rep % 2 == 0 else variants[::-1]  # no variant always goes first
        for v in order:
            start = time.perf_counter()
            for _ in range(steps):
                v.step()
            synchronize()
            v.tokens_per_s.append(steps * v.tokens_per_step / (time.perf_counter() - start))


def paired_ratio(a: Variant, b: Variant) -> float:
    """Median over rounds of a's tokens/s over b's in the same round: the machine's drift
    between rounds cancels, which a ratio of medians would keep."""
    return statistics.median(x / y for x, y in zip(a.tokens_per_s, b.tokens_per_s))


def peak_step_memory(variant: Variant) -> int:
    """Bytes at the highest point of one training step (after a warm-up step, so the
    optimizer state exists), parameters and optimizer state included."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        variant.step()
        torch.cuda.synchronize()
        variant.peak_bytes = torch.cuda.max_memory_allocated()
        return variant.peak_bytes
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfileTimeline

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        variant.step()
    _, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(torch.device("cpu"))
    variant.peak_bytes = max(sum(categories) for categories in sizes)
    return variant.peak_bytes


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):>12,.0f} tokens/s  ({min(values):,.0f} .. {max(values):,.0f})"


def describe(v: Variant) -> str:
    line = f"  {v.name:<42} {spread(v.tokens_per_s)}"
    if v.peak_bytes is not None:
        line += f"   peak {v.peak_bytes / 2**20:,.1f} MiB"
    return line


def header(title: str, batch: int, seq_len: int, reps: int, steps: int) -> str:
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    return (f"{title}\n  batch {batch} x seq {seq_len}, {reps} rounds x {steps} steps per variant, "
            f"median (min .. max) over rounds, {where}")


def add_round_args(parser, reps: int = 21, steps: int = 1,
                   quick_help: str = "small batch, 1 round of 1 step (CI)") -> None:
    """The shape and timing flags every model benchmark takes."""
    parser.add_argument("--seq-len", type=count(1), default=256)
    parser.add_argument("--batch", type=count(1), default=8)
    parser.add_argument("--reps", type=count(1), default=reps, help="rounds per variant")
    parser.add_argument("--steps", type=count(1), default=steps, help="timed training steps per round")
    parser.add_argument("--quick", action="store_true", help=quick_help)


def apply_quick(ns) -> None:
    """--quick: batch 2 x 64 tokens, one round of one step."""
    if ns.quick:
        ns.batch, ns.seq_len, ns.reps, ns.steps = 2, 64, 1, 1


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, seq_len + 1), generator=gen).to(device())
