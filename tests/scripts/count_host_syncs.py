"""Test machinery: train with TorchTitan's own Trainer or with GammaTrainer in this
process and count, per training step, what stalls a GPU's queue: host syncs (a tensor read
on the host: item, tolist, bool, float, int, numpy) and all-reduces.

    python count_host_syncs.py OUT.json titan|gamma --job.config_file ... [overrides]
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.overrides import TorchFunctionMode

import gamma_titan  # noqa: F401  (CPU platform shims before torchtitan)
from gamma_titan.config import load_job_config
from gamma_titan.training.preflight import preflight
from gamma_titan.training.main import single_process_env

HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "numpy"}


class Counter(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host_reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.host_reads += 1
        return func(*args, **(kwargs or {}))


def counted(base):
    class Counted(base):
        steps: list[dict] = []

        def train_step(self, data_iterator):
            reduces = all_reduces[0]
            with Counter() as counter:
                super().train_step(data_iterator)
            self.steps.append({"step": self.step, "host_reads": counter.host_reads,
                               "all_reduces": all_reduces[0] - reduces})

    return Counted


all_reduces = [0]


def counting(all_reduce):
    def counted_all_reduce(*args, **kwargs):
        all_reduces[0] += 1
        return all_reduce(*args, **kwargs)

    return counted_all_reduce


# The trainers call both through their modules, so the module attributes are what count.
dist.all_reduce = counting(dist.all_reduce)
funcol.all_reduce = counting(funcol.all_reduce)


def main() -> None:
    out, which, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = load_job_config(argv)
    preflight(config)
    single_process_env()
    if which == "titan":
        from torchtitan.train import Trainer as base
    else:
        from gamma_titan.training.trainer import GammaTrainer as base
    trainer = counted(base)(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(trainer.steps, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
