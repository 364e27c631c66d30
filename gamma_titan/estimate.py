"""What one rank of a cluster holds, estimated on any machine (`gamma-titan inspect CONFIG
--memory [--gpus N] [--gpu-memory GiB]`), in the config's parallel layout at N GPUs: the
memory of one training step, and the values the γ-init draws there (and how long that takes).

How, as TorchTitan 0.2.x's own estimation script does it: a fake process group of N ranks
(this process is rank 0), the model built on the meta device and parallelized by the
family's own `parallelize` (FSDP2, TP, EP, activation checkpointing; eager: compile is
left out), then one micro-batch's forward and backward on fake tensors under PyTorch's
FSDPMemTracker, which follows every tensor's storage: parameters and gradients (sharded
and unsharded), activations and temporaries, FSDP's all-gather and reduce-scatter buffers,
the logits and the loss. Nothing is allocated, so a 16B model is estimated on a laptop.

Written here where the tracker does not reach:
  * AdamW's two fp32 moments are counted from the shards' sizes (8 bytes a local value):
    under FakeTensorMode the tracker books the fused optimizer's in-place outputs as new
    storages (1.5B at FSDP 8: 24.4 GiB of "optimizer state" for 1.44 GiB of moments);
  * MoE routing has no values to read under fake tensors, so the token permutation and the
    expert-parallel split sizes take the tokens as evenly spread (their padded buffers have
    the same size whatever the routing: models/common/moe.py).

The peak is of live tensors; CUDA's caching allocator reserves more (fragmentation) and the
context takes about a GiB, so a config `fits` when peak x ALLOCATOR_SLACK + CONTEXT_GIB is
within the GPU's memory.

The init's values are counted on the same sharded model: each rank draws the chunks that
cover its shards (gamma_titan/init.py), on INIT_THREADS_PER_RANK CPU threads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: What the caching allocator reserves beyond live tensors (fragmentation), as a factor.
ALLOCATOR_SLACK = 1.15
#: The CUDA context and the kernels' workspaces, per GPU.
CONTEXT_GIB = 1.0
#: AdamW's state per parameter value: exp_avg and exp_avg_sq in fp32.
OPTIMIZER_BYTES_PER_VALUE = 8
#: CPU threads a rank draws its init with (a node's cores over its 8 GPUs, say 96 / 8 = 12).
INIT_THREADS_PER_RANK = 8
GIB = 2**30


@dataclass
class RankEstimate:
    world_size: int
    layout: dict[str, int]
    local_batch: int
    seq_len: int
    parts: dict[str, int] = field(default_factory=dict)  # bytes at the step's peak, by kind
    peak: int = 0  # live tensors at the peak of the step, optimizer states included
    init_values: int = 0  # values the γ-init draws on rank 0

    @property
    def init_seconds(self) -> float:
        from gamma_titan.init import DRAW_SECONDS_PER_VALUE

        return self.init_values * DRAW_SECONDS_PER_VALUE / INIT_THREADS_PER_RANK

    def needed_gib(self) -> float:
        return self.peak * ALLOCATOR_SLACK / GIB + CONTEXT_GIB

    def fits(self, gpu_gib: float) -> bool:
        return self.needed_gib() <= gpu_gib

    def format(self, gpu_gib: float) -> str:
        layout = ", ".join(f"{k} {v}" for k, v in self.layout.items() if v > 1) or "one GPU"
        lines = [f"memory per GPU at {self.world_size} GPUs ({layout}), local batch {self.local_batch} x "
                 f"{self.seq_len} tokens, eager (compile left out):"]
        lines += [f"  {name:<28} {nbytes / GIB:8.2f} GiB" for name, nbytes in self.parts.items() if nbytes]
        lines.append(f"  {'peak of live tensors':<28} {self.peak / GIB:8.2f} GiB")
        verdict = "fits" if self.fits(gpu_gib) else "does not fit"
        lines.append(f"  with the allocator's slack (x{ALLOCATOR_SLACK}) and the context ({CONTEXT_GIB:g} GiB): "
                     f"{self.needed_gib():.1f} GiB, {verdict} on a {gpu_gib:g} GiB GPU")
        lines.append(f"γ-init per rank: {self.init_values:,} values drawn, about {self.init_seconds:.1f} s on "
                     f"{INIT_THREADS_PER_RANK} CPU threads")
        return "\n".join(lines)

    def as_dict(self, gpu_gib: float) -> dict:
        return {"world_size": self.world_size, "layout": self.layout, "local_batch": self.local_batch,
                "seq_len": self.seq_len, "parts": self.parts, "peak": self.peak, "needed_gib": self.needed_gib(),
                "gpu_gib": gpu_gib, "fits": self.fits(gpu_gib), "init_values": self.init_values,
                "init_seconds": self.init_seconds}


def estimate_rank(config, spec, args, world_size: int) -> RankEstimate:
    """Rank 0's memory of one training step and the values its init draws, for `config`
    (checked and derived by preflight at this world size) on `world_size` GPUs."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters

    from gamma_titan.init import values_drawn

    if dist.is_initialized():
        raise RuntimeError("estimate_rank needs a process without a process group (it starts a fake one)")
    p = config.parallelism
    dims = ParallelDims(dp_shard=p.data_parallel_shard_degree, dp_replicate=p.data_parallel_replicate_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=world_size)
    compile_enabled = config.compile.enable
    config.compile.enable = False  # the tracker follows eager tensors
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        dims.build_mesh()
        # Built on the meta device and parallelized outside the fake mode, as the trainer does:
        # FSDP builds device meshes for expert-parallel shards, whose rank tensors are real.
        with torch.device("meta"):
            model = spec.model_cls(args)
        build_model_converters(config, dims).convert(model)
        spec.parallelize_fn(model, dims, config)
        with FakeTensorMode(allow_non_fake_inputs=True):  # the meta tensors become fake ones
            model.to_empty(device="cpu")  # fake tensors: shapes and devices, no storage
            model.train()
            batch, seq = config.training.local_batch_size, config.training.seq_len
            tokens = torch.randint(0, args.vocab_size, (batch, seq))
            if isinstance(model, FSDPModule):
                tracker = FSDPMemTracker(mod=model)
                tracker.track_inputs((tokens,))
            else:  # one GPU, or TP alone: PyTorch's plain tracker
                tracker = MemTracker()
                tracker.track_external(model, tokens)
            loss_fn = spec.build_loss_fn(config)
            with tracker:
                loss = loss_fn(model(tokens), tokens)
                loss.backward()
            snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
            moments = sum((q.to_local() if isinstance(q, DTensor) else q).numel() for q in model.parameters()
                          if q.requires_grad) * OPTIMIZER_BYTES_PER_VALUE
        init_values = sum(values_drawn(q) for q in model.parameters())  # real index tensors: outside fake mode
    finally:
        config.compile.enable = compile_enabled
        dist.destroy_process_group()
    parts = {_label(kind): nbytes for kind, nbytes in snapshot.items() if kind != "Total"}
    parts["optimizer states (AdamW)"] = moments
    layout = {"FSDP": dims.dp_shard, "HSDP replicas": dims.dp_replicate, "TP": dims.tp, "CP": dims.cp,
              "EP": dims.ep, "PP": dims.pp}
    return RankEstimate(world_size, layout, batch, seq, parts, snapshot["Total"] + moments, init_values)


def _label(kind) -> str:
    """The tracker's category, as the breakdown names it."""
    return {"Sharded Param": "parameters (sharded)", "Unsharded Param": "parameters (gathered)",
            "Sharded Grad": "gradients (sharded)", "Unsharded Grad": "gradients (unsharded)",
            "Activation": "activations", "Temp": "temporaries (backward)", "All Gather": "all-gather buffers",
            "Reduce Scatter": "reduce-scatter buffers", "Buffer": "buffers", "Inputs": "inputs",
            "Parameter": "parameters", "Gradient": "gradients", "Other": "other", "Optstate": "optimizer (tracked)",
            "OptState": "optimizer (tracked)"}.get(getattr(kind, "value", kind), str(kind))

