"""Test machinery: train with TorchTitan's own Trainer or with GammaTrainer in this
process and count, per training step, what stalls a GPU's queue: host syncs (a tensor read
on the host: item, tolist, bool, float, int, numpy), blocking device-to-host transfers, and
all-reduces.

    python count_host_syncs.py OUT.json titan|gamma --job.config_file ... [overrides]
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.overrides import TorchFunctionMode

import gamma_titan  # noqa: F401  (CPU platform shims before torchtitan)
from all_reduce_count import all_reduces, count_all_reduces
from torchtitan.models.moe import kernels as moe_kernels
from gamma_titan.config import load_job_config
from gamma_titan.training.preflight import preflight
from gamma_titan.training.main import single_process_env

HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "numpy"}


class Counter(TorchFunctionMode):
    """host_reads: every read of a tensor's value on the host. transfers: the blocking
    device-to-host transfers a GPU would make for those reads: a read of a tensor counts
    once, unless the tensor is a host copy (.cpu(), .to("cpu")), when the copy counts instead,
    once, if it was blocking (a non_blocking copy is waited for by a later blocking one).
    Copies whose values are never read on the host (inputs moved to the device) count nothing.
    uploads: tensors made from host values on a named device (torch.tensor / as_tensor with
    `device=`): on a GPU a copy from pageable memory, which waits for the queue to drain."""

    def __init__(self):
        super().__init__()
        self.host_reads = 0
        self.transfers = 0
        self.uploads = 0
        self.copies: dict[int, list] = {}  # id -> [the copy (held: ids stay unique), blocking, counted]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if paused[0]:
            return out
        if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
            self.uploads += 1
        elif name in HOST_READS:
            self.host_reads += 1
            copy = self.copies.get(id(args[0]))
            if copy is None:
                self.transfers += 1
            elif copy[1] and not copy[2]:
                self.transfers += 1
                copy[2] = True
        elif name == "cpu" or (name == "to" and _to_cpu(args[1:], kwargs)):
            self.copies[id(out)] = [out, not kwargs.get("non_blocking", False), False]
        return out


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def counted(base):
    class Counted(base):
        steps: list[dict] = []

        def train_step(self, data_iterator):
            reduces = all_reduces[0]
            with Counter() as counter:
                super().train_step(data_iterator)
            self.steps.append({"step": self.step, "host_reads": counter.host_reads, "transfers": counter.transfers,
                               "uploads": counter.uploads, "all_reduces": all_reduces[0] - reduces})

    return Counted


paused = [False]


def uncounted(fill_indices_cpu):
    """TorchTitan's CPU stand-in for its Triton token-permutation kernel reads every count on
    the host; the kernel a GPU runs reads none: not counted."""
    def fill(*args, **kwargs):
        paused[0] = True
        try:
            return fill_indices_cpu(*args, **kwargs)
        finally:
            paused[0] = False

    return fill


moe_kernels.fill_indices_cpu = uncounted(moe_kernels.fill_indices_cpu)


# The trainers call both through their modules, so the module attributes are what count.
count_all_reduces(dist, funcol)


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
