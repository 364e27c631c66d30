"""Parallelism pieces every family shares: the tensor-parallel plan of the decoder
(embedding, norms, output; each block's from what its modules are: attention of any kind,
a dense SwiGLU), context parallelism, FSDP on gloo, DDP's gradient reduction, and
`parallelize_decoder`: the whole order for a family without experts.

Heads are split across TP ranks Megatron-style, as TorchTitan's llama3 plan does; the
attention gate is column-parallel like the queries, so each rank gates its own heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import NoParallel, ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_compile, apply_ddp, apply_fsdp
from torchtitan.models.attention import ScaledDotProductAttentionWrapper
from torchtitan.models.moe.moe import MoE
from torchtitan.tools.logging import logger

from .attention import GatedAttention
from .ffn import SwiGLU
from .mla import GatedMLA

#: TorchTitan's `model.converters` name of float8 linear layers (torchao).
FLOAT8_LINEAR = "quantize.linear.float8"


def force_sum_reductions(model: nn.Module) -> None:
    """TorchTitan sets FSDP's gradient divide factor to 1 (it normalises the loss by the
    global token count itself), which FSDP implements as a PREMUL_SUM reduce-scatter;
    gloo has no PREMUL_SUM. With a factor of 1 a plain SUM is the same reduction."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def sum_ddp_gradients(model: nn.Module, group) -> None:
    """DDP (TorchTitan's apply_ddp: composable replicate) averages gradients over replicas,
    but TorchTitan's loss is already divided by the global token count (as it sets FSDP's
    divide factor to 1): averaged, the gradient is divided by the replicas twice (measured:
    half the single-process gradient norm at 2 replicas, so clipping and the update differ).
    Summed, it is the single-process gradient, provided the replicas reduce once a step:
    GammaTrainer turns DDP's sync off for all but the last micro-batch (a reduction that sums
    would otherwise add the gradient reduced at the previous micro-batch in again). Call
    after apply_ddp, before the first step."""
    model.register_comm_hook(group, _all_reduce_sum)


def _all_reduce_sum(group, bucket):
    work = torch.distributed.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


@dataclass(frozen=True)
class TPStyles:
    """What a module's tensor-parallel plan is made of: torch's styles, or torchao's float8
    ones under float8 tensorwise training, and the TP mesh. Under float8, `plain` holds
    torch's styles for the linears float8 left in high precision (`fitting`)."""

    colwise: type
    rowwise: type
    prepare_input: type
    mesh: object
    plain: TPStyles | None = None
    float8_linear: type | None = None

    def fitting(self, *modules: nn.Module) -> TPStyles:
        """The styles for these modules together: the float8 ones if float8 converted every
        one of them, else torch's. torchao's float8 styles refuse a plain nn.Linear (one in
        quantize.linear.float8.filter_fqns, such as the headwise gate's projection), and a
        float8 input preparation hands float8 tensors to every linear it feeds, which a
        plain nn.Linear cannot multiply: the modules fed by one input are fitted together."""
        if self.plain is None or all(isinstance(m, self.float8_linear) for m in modules):
            return self
        return self.plain


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool, float8_tensorwise: bool) -> None:
    """Megatron-style TP with sequence-parallel norms, as TorchTitan's llama3 plan; each
    block's plan comes from its modules (`children_tp_plan`), and so does that of any top-level
    module besides the decoder's own."""
    styles = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput, tp_mesh)
    if float8_tensorwise:
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_tensor_parallel import (Float8ColwiseParallel, Float8RowwiseParallel,
                                                           PrepareFloat8ModuleInput)

        styles = TPStyles(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput, tp_mesh,
                          plain=styles, float8_linear=Float8Linear)
    parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(
                input_layouts=Shard(1),
                output_layouts=Shard(-1) if loss_parallel else Replicate(),
                use_local_output=not loss_parallel,
            ),
            **children_tp_plan(model, styles, skip=DECODER_CHILDREN),
        },
    )
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, children_tp_plan(block, styles))
    logger.info(f"Applied {'Float8 tensorwise ' if float8_tensorwise else ''}tensor parallelism")


#: The decoder skeleton's own children (DecoderLM), planned by apply_tp itself.
DECODER_CHILDREN = ("tok_embeddings", "layers", "norm", "output")


def children_tp_plan(parent: nn.Module, styles: TPStyles, skip: tuple[str, ...] = ()) -> dict:
    """The TP plan of a module's children, relative to it:

    * a child with a `tensor_parallel_plan(styles)` method gets that plan (relative to
      itself; "" is the child itself), whatever type it subclasses, an nn.RMSNorm included;
    * every other RMSNorm is sequence parallel with a local output. Between planned modules
      the residual stream is each rank's local shard of the sequence, so a norm's output can
      go wherever the block sends it: into a sublayer (whose input preparation gathers the
      sequence) or back into the residual stream (a post-norm, `h + norm(f(h))`), where a
      DTensor would meet the local stream;
    * a child of a type in MODULE_PLANS gets that plan; an MoE layer is left to
      TorchTitan's expert plans (the MoE family's parallelize);
    * a container without parameters of its own (a ModuleDict of norms, a Sequential) is
      planned child by child, by these same rules;
    * any other child with parameters is refused: accepted and left unsplit, it would
      train on each rank's shard of the sequence alone."""
    plan = {}
    for name, child in parent.named_children():
        if name in skip:
            continue
        if hasattr(child, "tensor_parallel_plan"):  # a module's own plan comes first, whatever it subclasses
            sub = child.tensor_parallel_plan(styles)
        elif isinstance(child, nn.RMSNorm):
            sub = {"": SequenceParallel(use_local_output=True)}
        elif isinstance(child, MoE):
            continue
        elif shared_plan(child) is not None:  # a shared module, or a subclass of one
            sub = shared_plan(child)(child, styles)
        elif not any(True for _ in child.parameters()):
            continue
        elif not any(True for _ in child.parameters(recurse=False)):
            sub = children_tp_plan(child, styles)
        else:
            raise ValueError(f"tensor parallelism has no plan for {type(child).__name__} ({name!r} of "
                             f"{type(parent).__name__}): give it a tensor_parallel_plan(styles) method")
        plan |= {f"{name}.{key}" if key else name: style for key, style in sub.items()}
    return plan


def swiglu_tp_plan(ffn: SwiGLU, styles: TPStyles) -> dict:
    """The hidden width split: w1, w3 column-parallel, w2 row-parallel back to sequence shards."""
    fed = styles.fitting(ffn.w1, ffn.w3)  # both read the block's input
    return {
        "": fed.prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "w1": fed.colwise(),
        "w2": styles.fitting(ffn.w2).rowwise(output_layouts=Shard(1)),
        "w3": fed.colwise(),
    }


def attention_tp_plan(attention: nn.Module, styles: TPStyles) -> dict:
    """Heads split across TP ranks: the projections into heads (and the gate) are
    column-parallel, the output projection row-parallel, and the attention runs on local
    tensors. In MLA the low-rank down-projections and their norms are replicated
    (NoParallel keeps their weights as replicated DTensors, so their gradients are
    complete on every rank); the up-projections into heads are column-parallel."""
    # the linears that read the attention's input (MLA's wq or wq_a, wkv_a): fitted together
    fed = styles.fitting(*(child for name, child in attention.named_children()
                           if isinstance(child, nn.Linear) and name != "wo"))
    colwise, prepare_input = fed.colwise, fed.prepare_input
    plan = {"wo": styles.fitting(attention.wo).rowwise(output_layouts=Shard(1))}
    if hasattr(attention, "gate_proj"):
        plan["gate_proj"] = colwise()
    if not isinstance(attention, GatedMLA):
        return plan | {
            "": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "wq": colwise(),
            "wk": colwise(),
            "wv": colwise(),
        }
    attention.tp_mesh = styles.mesh  # the rotary key's gradient is summed over the ranks' heads
    plan |= {
        "": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None),
                          use_local_output=True),
        "wkv_a": NoParallel(),
        "kv_norm": NoParallel(),
        "wkv_b": colwise(),
    }
    if hasattr(attention, "wq"):
        return plan | {"wq": colwise()}
    return plan | {"wq_a": NoParallel(), "q_norm": NoParallel(), "wq_b": colwise()}


@dataclass(frozen=True)
class ParallelizeContract:
    """What a parallelize function cannot take, declared with the function
    (`declare_contract`) so that every family reusing it inherits the refusals: pre-flight
    asks `layout_problem(layout)` (training/layout.py: a one-line problem, or None) and runs
    `check_model(model, layout)` on the family's model built on the meta device (raises
    ConfigError naming what is missing)."""

    layout_problem: Callable[[object], str | None] | None = None
    check_model: Callable[[nn.Module, object], None] | None = None


def declare_contract(contract: ParallelizeContract):
    """Decorate a parallelize function with its contract (`functools.wraps` keeps it on a
    wrapper, as training/train_spec.py's)."""
    def declare(parallelize_fn):
        parallelize_fn.contract = contract
        return parallelize_fn

    return declare


def contract_of(parallelize_fn) -> ParallelizeContract:
    """The contract a parallelize function declares; an empty one where it declares none."""
    return getattr(parallelize_fn, "contract", ParallelizeContract())


#: The TP plans of the shared modules, by type (a family's own module can bring a
#: `tensor_parallel_plan(styles)` method instead).
MODULE_PLANS = {GatedAttention: attention_tp_plan, GatedMLA: attention_tp_plan, SwiGLU: swiglu_tp_plan}


def shared_plan(module: nn.Module):
    """The plan function of the shared module the module is, or subclasses (its nearest
    base in MODULE_PLANS); None for any other module. A subclass that adds parameters the
    shared plan does not place is refused by `check_tensor_parallel_plan`, naming it."""
    return next((MODULE_PLANS[c] for c in type(module).__mro__ if c in MODULE_PLANS), None)


def check_tensor_parallel_plan(model: nn.Module) -> None:
    """Pre-flight, on the meta model: the plan `apply_tp` would apply places every
    parameter, nested ones too, outside the MoE layers (TorchTitan's expert plans). A
    parameter no style places would train on each rank's shard of the sequence alone, or
    meet DTensors as a plain tensor (`clip_grad_norm_`'s "mixed torch.Tensor and DTensor",
    naming no parameter). Raises ConfigError naming the parameter by path and the module
    whose plan should place it."""
    from gamma_titan.errors import ConfigError

    styles = TPStyles(ColwiseParallel, RowwiseParallel, PrepareModuleInput, mesh=None)
    key = "parallelism.tensor_parallel_degree"
    try:
        plan = {name: None for name in DECODER_CHILDREN if name != "layers"}
        plan |= children_tp_plan(model, styles, skip=DECODER_CHILDREN)
        for index, block in model.layers.items():
            plan |= {f"layers.{index}.{path}": style for path, style in children_tp_plan(block, styles).items()}
    except ValueError as e:
        raise ConfigError(f"{key} > 1: {e}") from None
    # an input preparation places no parameter
    placed = [path for path, style in plan.items() if not isinstance(style, (PrepareModuleInput, PrepareModuleOutput))]
    moe = [name for name, m in model.named_modules() if isinstance(m, MoE)]
    for name, _ in model.named_parameters():
        if any(name.startswith(f"{p}.") for p in moe) or any(name == p or name.startswith(f"{p}.") for p in placed):
            continue
        parts = name.split(".")[:-1]
        owner_path = next((".".join(parts[:i]) for i in range(len(parts), 0, -1)  # the innermost with a plan
                           if hasattr(model.get_submodule(".".join(parts[:i])), "tensor_parallel_plan")
                           or shared_plan(model.get_submodule(".".join(parts[:i]))) is not None), None)
        if owner_path is None:
            raise ConfigError(f"{key} > 1: no tensor-parallel plan places {name}; give the module that holds it a "
                              "tensor_parallel_plan(styles) method")
        planner = model.get_submodule(owner_path)
        rel = name[len(owner_path) + 1:].rsplit(".", 1)[0]
        if hasattr(planner, "tensor_parallel_plan"):
            raise ConfigError(f"{key} > 1: {name} is placed by no style: {type(planner).__name__}."
                              f"tensor_parallel_plan ({owner_path}) must plan {rel!r}")
        base = next(c for c in type(planner).__mro__ if c in MODULE_PLANS)
        raise ConfigError(f"{key} > 1: {name} is placed by no style: {type(planner).__name__} ({owner_path}) takes "
                          f"{base.__name__}'s plan, which does not know {rel!r}; give {type(planner).__name__} a "
                          "tensor_parallel_plan(styles) method")


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """TorchTitan's context parallelism: its CP plan on every block's SDPA module (ring
    attention over the CP ranks' chunks of the sequence; the rotary positions come with
    the batch, DecoderLM.forward), and the MoE layers' sequence-wise balance loss summed
    over the ranks that share a sequence."""
    from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

    from .moe import set_sequence_group

    sdpa = [m for m in model.modules() if isinstance(m, ScaledDotProductAttentionWrapper)]
    apply_cp_to_attention_module(sdpa, cp_mesh, "sdpa")
    set_sequence_group(model, cp_mesh.get_group())


def parallelize_decoder(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    """TP → CP → AC → compile (per block) → FSDP (or DDP, for replicas alone), in
    TorchTitan's order, for a decoder without experts: a family's `parallelize_fn` unless
    it needs more (the MoE family adds expert parallelism). Everything but the TP plan
    (`apply_tp`) is TorchTitan's llama3 code, which works on any block."""
    if parallel_dims.tp_enabled:
        float8 = FLOAT8_LINEAR in job_config.model.converters
        rowwise_recipe = job_config.quantize.linear.float8.recipe_name in ("rowwise", "rowwise_with_gw_hp")
        apply_tp(
            model,
            parallel_dims.get_mesh("tp"),
            loss_parallel=not job_config.parallelism.disable_loss_parallel,
            float8_tensorwise=float8 and not rowwise_recipe,
        )
        maybe_enable_async_tp(job_config, parallel_dims.get_mesh("tp"))
    if parallel_dims.cp_enabled:
        apply_context_parallel(model, parallel_dims.get_mesh("cp"))

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_model:
        apply_compile(model, job_config.compile)

    if parallel_dims.fsdp_enabled:
        mesh_names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(mesh_names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        logger.info("Applied FSDP to the model")
    elif parallel_dims.dp_replicate_enabled:  # replicas only: no other parallelism (training/layout.py)
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_model)
    return model
