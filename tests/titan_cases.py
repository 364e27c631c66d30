"""What the tests of gamma_titan/models/titan share: TorchTitan's models' debug configs, the
small batches the CPU trains them on, and their args as gamma_titan resolves them."""

import torch

from helpers import REPO
from gamma_titan.config import load_job_config
from gamma_titan.training.train_spec import resolve_model

TITAN_CONFIGS = {model: REPO / "configs" / "titan" / f"{model}_debug.toml"
                 for model in ("llama3", "qwen3", "deepseek_v3")}
#: qwen3's debug flavor (8 layers, attention 2048 wide, FFN 3072) takes ~10 s a step at the
#: config's 8 x 256 tokens on 2 cores; the tests train it on 2 x 64.
#: deepseek_v3's (MLA 16 x 192, 5 MoE layers) ~10 s too.
_SMALL = ("--training.seq_len", "64", "--training.local_batch_size", "2",
          "--validation.seq_len", "64", "--validation.local_batch_size", "2")
SMALL_BATCH = {"llama3": (), "qwen3": _SMALL, "deepseek_v3": _SMALL}


def titan_own_model(model: str, args):
    """TorchTitan's own model class for these args, on meta (the reference for what our
    class keeps: parameter names and shapes, RMSNorms)."""
    import importlib

    with torch.device("meta"):
        return importlib.import_module(f"torchtitan.models.{model}").get_train_spec().model_cls(args)


def titan_args(model: str, *overrides: str):
    """(spec, args) of the model's debug config with these overrides."""
    config = load_job_config(["--job.config_file", str(TITAN_CONFIGS[model]), *overrides])
    return resolve_model(config)
