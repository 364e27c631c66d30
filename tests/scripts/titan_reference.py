"""Test machinery: the initial weights and first losses of a run in this process, trained
by TorchTitan's own Trainer with TorchTitan's own TrainSpec for the model (`titan`), or by
gamma_titan's trainer with the spec gamma_titan registers under that name (`gamma`).

    python titan_reference.py OUT.pt titan|gamma --job.config_file ... [overrides]

OUT.pt holds {"init": {name: full tensor}, "losses": [float per step]}.
"""

import contextlib
import importlib
import sys

import torch
from torch.distributed.tensor import DTensor

import gamma_titan  # noqa: F401  (the CPU fallback, before TorchTitan's trainer is imported)
from gamma_titan.config import load_job_config
from gamma_titan.init import canonical_name
from gamma_titan.models.common.moe import IntegerHistcByScatter
from gamma_titan.training.main import single_process_env
from gamma_titan.training.preflight import preflight


def recording(base):
    class Recorded(base):
        losses: list[float] = []

        def forward_backward_step(self, *args, **kwargs):
            loss = super().forward_backward_step(*args, **kwargs)
            Recorded.losses.append(float(loss.detach()))
            return loss

    return Recorded


def main(out: str, which: str, argv: list[str]) -> None:
    config = load_job_config(argv)
    single_process_env()
    if which == "titan":
        from torchtitan.protocols import train_spec
        from torchtitan.train import Trainer as base

        own = importlib.import_module(f"torchtitan.models.{config.model.name}").get_train_spec()
        train_spec._extra_train_specs[config.model.name] = own  # TorchTitan's, not gamma_titan's
    else:
        preflight(config)
        from gamma_titan.training.trainer import GammaTrainer as base
    trainer = recording(base)(config)
    init = {}
    for name, param in trainer.model_parts[0].named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        init[canonical_name(name)] = tensor.detach().clone()
    # TorchTitan's MoE counts routed tokens with torch.histc of int64, which CPUs lack: its
    # own model trains here with those counts taken by scatter-add (the same integers)
    on_cpu = which == "titan" and not torch.cuda.is_available()
    with IntegerHistcByScatter() if on_cpu else contextlib.nullcontext():
        trainer.train()
    torch.save({"init": init, "losses": trainer.losses, "model_class": type(trainer.model_parts[0]).__name__}, out)
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
