"""Build the trainer as `gamma_titan.train` would (parallelised, then initialised) and
save the full initial weights from rank 0; with --checkpoint.enable, also save them as the
sharded DCP checkpoint `step-0` (with model.json), as a run at this layout would.
Usage (under torchrun or plain python):

    python tests/scripts/dump_init_weights.py OUT.pt --job.config_file ... [overrides]
"""

import sys

import torch
from torch.distributed.tensor import DTensor

import gamma_titan  # noqa: F401
from gamma_titan.config import load_job_config
from gamma_titan.init import canonical_name
from gamma_titan.training.preflight import preflight
from gamma_titan.training.main import single_process_env


def main(out: str, argv: list[str]) -> None:
    from gamma_titan.training.trainer import GammaTrainer

    config = load_job_config(argv)
    preflight(config)
    single_process_env()
    trainer = GammaTrainer(config)
    full = {}
    for name, param in trainer.model_parts[0].named_parameters():
        tensor = param.full_tensor() if isinstance(param, DTensor) else param
        full[canonical_name(name)] = tensor.detach().clone()
    if torch.distributed.get_rank() == 0:
        torch.save(full, out)
    if config.checkpoint.enable:
        trainer.checkpointer.save(0, last_step=True)
    trainer.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
