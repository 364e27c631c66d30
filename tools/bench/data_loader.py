"""Tokens/s delivered to the training loop: TorchTitan's streaming text loader vs the memmap
loader, and what the debug model consumes, side by side in one process.

    .venv/bin/python tools/bench/data_loader.py [--input FILE.jsonl] [--seq-len 256] [--batch 8]
                                                [--batches 300] [--reps 5] [--num-proc N] [--quick]

On the same corpus (default: the built-in corpus's train split) and the same tokenizer
(the built-in one), sequence length and batch size:
  (a) TorchTitan's `build_text_dataloader` with dataset = "hf": reads the jsonl and
      tokenizes on the fly, in the training process (its default path);
  (b) our `build_dataloader` with dataset = "memmap": reads shards written by
      `gamma-titan pretokenize` (timed here too: tokens/s per process);
  (c) the debug model's training step (forward, backward, clipping, AdamW) on batches of
      that size: the tokens/s a loader has to keep up with.
(a), (b) and (c) alternate `--reps` times so they see the same machine state; each is
reported as median (min..max). The last lines are the ratios the targets are about:
(b)/(a) >= 20 and (b)/(c) >= 50.
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import gamma_titan  # noqa: F401  (CPU shims before TorchTitan)
import gamma_titan.training.train_spec  # noqa: F401  (registers the datasets: "hf" for the streaming loader)
from gamma_titan.config import load_job_config
from gamma_titan.config.flags import Parser, count
from gamma_titan.data.builtin_corpus import TRAIN_FILE, ensure_builtin_corpus
from gamma_titan.data.loader import build_dataloader
from gamma_titan.data.pretokenize import pretokenize
from gamma_titan.data.tokenizer import ensure_builtin_tokenizer
from gamma_titan.models.dense import GammaDense, dense_flavors

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
from diagnostics_overhead import train_step  # noqa: E402  (the same step as the other benchmark)


def job_config(dataset: str, path: str, seq_len: int, batch: int):
    config = load_job_config(["--job.config_file", str(REPO / "configs/dense/debug.toml"),
                              "--training.dataset", dataset, "--training.dataset_path", path,
                              "--training.seq_len", str(seq_len), "--training.local_batch_size", str(batch)])
    return config


def loader_tokens_per_s(loader, n_batches: int) -> float:
    it = iter(loader)
    next(it)  # first batch: opening files, building the first permutation
    start = time.perf_counter()
    tokens = sum(labels.numel() for _, labels in itertools.islice(it, n_batches))
    return tokens / (time.perf_counter() - start)


def model_tokens_per_s(model, optimizer, batch: torch.Tensor, steps: int) -> float:
    train_step(model, optimizer, batch)  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        train_step(model, optimizer, batch)
    return steps * batch[:, 1:].numel() / (time.perf_counter() - start)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):>14,.0f} tokens/s  ({min(values):,.0f} .. {max(values):,.0f})"


def main() -> None:
    parser = Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", help="jsonl with a 'text' field (default: the built-in corpus)")
    parser.add_argument("--seq-len", type=count(1), default=256)
    parser.add_argument("--batch", type=count(1), default=8)
    parser.add_argument("--batches", type=count(1), default=300, help="batches per loader measurement")
    parser.add_argument("--model-steps", type=count(1), default=3, help="training steps per model measurement")
    parser.add_argument("--reps", type=count(1), default=5)
    parser.add_argument("--num-proc", type=count(1), default=os.cpu_count() or 1, help="pretokenize processes")
    parser.add_argument("--quick", action="store_true", help="a few batches, one repetition (CI)")
    ns = parser.parse_args()
    if ns.quick:
        ns.batches, ns.model_steps, ns.reps = 20, 1, 1
    logging.getLogger("gamma_titan").setLevel(logging.ERROR)  # epoch-wrap notices

    corpus = ns.input or str(ensure_builtin_corpus() / TRAIN_FILE)
    tokenizer_dir = ensure_builtin_tokenizer()
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import build_text_dataloader

    tokenizer = HuggingFaceTokenizer(str(tokenizer_dir))

    with tempfile.TemporaryDirectory() as tmp:
        pre = {}
        for procs in sorted({1, ns.num_proc}):
            result = pretokenize(corpus, tokenizer_dir, Path(tmp) / f"shards{procs}", num_proc=procs,
                                 docs_per_shard=max(1, 400 // (4 * procs)), progress=False)
            pre[procs] = result.tokens_encoded / result.seconds
        shards = str(Path(tmp) / f"shards{ns.num_proc}")
        config = load_job_config(["--job.config_file", str(REPO / "configs/dense/debug.toml")])
        args = dense_flavors["debug"]
        args.update_from_config(config)
        args.max_seq_len = max(args.max_seq_len, ns.seq_len)
        torch.manual_seed(0)
        model = GammaDense(args)
        model.init_weights()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        batch = torch.randint(0, args.vocab_size, (ns.batch, ns.seq_len + 1))

        streaming, memmap, consumed = [], [], []
        for _ in range(ns.reps):
            text_config = job_config("hf", corpus, ns.seq_len, ns.batch)
            streaming.append(loader_tokens_per_s(build_text_dataloader(1, 0, tokenizer, text_config), ns.batches))
            memmap_config = job_config("memmap", shards, ns.seq_len, ns.batch)
            memmap.append(loader_tokens_per_s(build_dataloader(1, 0, tokenizer, memmap_config), ns.batches))
            consumed.append(model_tokens_per_s(model, optimizer, batch, ns.model_steps))

    print(f"corpus {corpus}, seq_len {ns.seq_len}, batch {ns.batch}, {ns.reps} reps, torch threads "
          f"{torch.get_num_threads()}")
    for procs, rate in pre.items():
        print(f"pretokenize, {procs} process{'es' if procs > 1 else ''}: {rate:,.0f} tokens/s "
              f"({rate / procs:,.0f} per process)")
    print(f"(a) TorchTitan streaming text loader {summary(streaming)}")
    print(f"(b) memmap loader                    {summary(memmap)}")
    print(f"(c) debug model training step        {summary(consumed)}")
    med = statistics.median
    print(f"ratio memmap / streaming loader: {med(memmap) / med(streaming):.1f}x (target >= 20)")
    print(f"ratio memmap / debug model consumption: {med(memmap) / med(consumed):.1f}x (target >= 50)")


if __name__ == "__main__":
    main()
