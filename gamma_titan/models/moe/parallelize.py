"""Activation checkpointing, torch.compile and FSDP2 for gamma_moe (TorchTitan's helpers).

Tensor and expert parallelism for gamma_moe are not wired yet: the pre-flight checks
refuse them with a one-line error (see gamma_titan.train.check_parallelism).
"""

from __future__ import annotations

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.models.deepseek_v3.infra.parallelize import _op_sac_save_list
from torchtitan.models.llama3.infra.parallelize import apply_fsdp
from torchtitan.models.llama4.infra.parallelize import apply_compile
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_type

from gamma_titan.models.dense.parallelize import force_sum_reductions


def parallelize_moe(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 op_sac_save_list=_op_sac_save_list, base_folder=job_config.job.dump_folder)
    if compile_model:
        apply_compile(model, job_config.compile, parallel_dims.ep_enabled)
    if parallel_dims.fsdp_enabled:
        mesh_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(mesh_names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=False,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        if device_type == "cpu":
            force_sum_reductions(model)
        logger.info("Applied FSDP to the model")
    return model
