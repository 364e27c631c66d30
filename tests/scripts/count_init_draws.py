"""Test machinery: build GammaTrainer (which parallelizes and γ-initialises the model) on every
rank and report what the init drew there against what it had to: the values the rank's
`γ-init` log line says it drew, and, found independently, the chunks that hold its shards'
values (DTensor's cut of the tensor of flat positions).

    torchrun --nproc_per_node N count_init_draws.py OUT_DIR --job.config_file ... [overrides]

Writes OUT_DIR/rank{r}.json: {"logged": [drawn, held], "chunk_cover": values in the chunks
that cover the rank's shards, "held": values of its shards, "total": values of every weight}.
"""

import json
import logging
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

import gamma_titan  # noqa: F401  (CPU platform shims before torchtitan)
from gamma_titan.config import load_job_config
from gamma_titan.init import CHUNK
from gamma_titan.training.preflight import preflight


class Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    config = load_job_config(argv)
    preflight(config)
    from torchtitan.tools.logging import init_logger

    init_logger()  # INFO, as the trainer's entry point sets it
    capture = Capture()
    logging.getLogger("gamma_titan.init").addHandler(capture)
    from gamma_titan.training.trainer import GammaTrainer

    trainer = GammaTrainer(config)
    [line] = [x for x in capture.lines if x.startswith("γ-init")]
    drawn, held_logged = (int(n.replace(",", "")) for n in re.findall(r"([\d,]+) ", line)[:2])
    cover = held = total = 0
    for part in trainer.model_parts:
        for param in part.parameters():
            if param.ndim < 2:
                continue  # norm scales: filled with 1, nothing drawn
            numel = param.numel()
            positions = torch.arange(numel).view(param.shape)
            if isinstance(param, DTensor):
                positions = distribute_tensor(positions, param.device_mesh, param.placements, src_data_rank=None)
                positions = positions.to_local()
            chunks = (positions.flatten() // CHUNK).unique().tolist()
            cover += sum(min(CHUNK, numel - k * CHUNK) for k in chunks)
            held += positions.numel()
            total += numel
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"logged": [drawn, held_logged], "chunk_cover": cover, "held": held, "total": total}))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
