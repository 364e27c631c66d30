"""Test machinery: gamma_dense and gamma_moe (MHA and MLA) under context parallelism on
gloo, against one process (tests/test_context_parallel.py).

    torchrun --nproc_per_node N tests/scripts/context_parallel.py OUT.json

A CPU has no ring attention (PyTorch's CP dispatches the CUDA SDPA kernels only), so each
block's SDPA module is replaced by `GatheredAttention`: this rank's queries against every
CP rank's keys and values (all-gathered, with autograd), masked by the tokens' global
positions, which is what ring attention computes. Everything else is the real path:
TorchTitan's `prepare_context_parallel_input` shards the batch (head-tail load balancing)
and hands the model `positions`; the rotary embedding, the gate and the MoE layers run on
the rank's tokens; the sequence-wise balance loss sums over the CP group. Each rank also
runs the whole batch in one process; rank 0 writes per model the differences (logits at
the rank's positions, loss, every gradient summed over the ranks) and what each rank saw.
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import gamma_titan  # noqa: F401  (platform shims before torchtitan)

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))  # tests/: helpers

SEQ, BATCH = 32, 2


class Gather(torch.autograd.Function):
    """Every rank's `x` concatenated on `dim`; backward: the sum of every rank's gradient
    for this rank's part. (torch.distributed.nn's all_gather gets the gradient wrong on
    gloo, measured with torch 2.13: its all-to-all emulation of reduce-scatter.)"""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group, ctx.size = dim, group, x.shape[dim]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad.narrow(ctx.dim, dist.get_rank(ctx.group) * ctx.size, ctx.size), None, None


class GatheredAttention(nn.Module):
    """Causal SDPA of the local queries over the keys and values of every rank in `group`,
    by global position (`positions`: this rank's, set before each forward)."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group, self.positions = group, None

    def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_causal=True):
        keys, values = Gather.apply(k, 2, self.group), Gather.apply(v, 2, self.group)
        with torch.no_grad():
            key_positions = Gather.apply(self.positions, 1, self.group)
        mask = key_positions[:, None, None, :] <= self.positions[:, None, :, None]  # (batch, 1, q, k)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


def models():
    from gamma_titan.models.dense import GammaDense, dense_flavors
    from gamma_titan.models.moe import GammaMoE, moe_flavors

    dense = dense_flavors["debug"]
    dense.n_layers, dense.n_kv_heads, dense.attention_gate = 2, 2, "elementwise"
    out = {"dense": (GammaDense, dense)}
    for name, flavor in (("moe_mha", "debug"), ("moe_mla", "debug_mla")):
        args = moe_flavors[flavor]
        args.n_layers, args.aux_loss_coeff = 3, 0.1  # the balance loss large enough to show in the gradients
        out[name] = (GammaMoE, args)
    for _, args in out.values():
        args.max_seq_len = SEQ
        args.check()
    return out


def run(model_cls, args, dims) -> dict:
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    from gamma_titan.models.common.moe import set_sequence_group
    from gamma_titan.training.trainer import largest_rank_loss

    torch.manual_seed(0)  # the same model and batch on every rank
    model = model_cls(args)
    model.init_weights()
    tokens = torch.randint(0, args.vocab_size, (BATCH, SEQ + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    logits = model(inputs)
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    mesh = dims.get_mesh("cp")
    group = mesh.get_group()
    local_inputs, local_labels, extra = prepare_context_parallel_input(inputs, labels, {}, mesh, torch.device("cpu"),
                                                                       "headtail")
    positions = extra["positions"]
    for block in model.layers.values():
        block.attention.sdpa = GatheredAttention(group)
        block.attention.sdpa.positions = positions
    set_sequence_group(model, group)
    local_logits = model(local_inputs, positions=positions)
    local_sum = F.cross_entropy(local_logits.flatten(0, 1), local_labels.flatten(), reduction="sum")
    share = local_sum / labels.numel()  # TorchTitan: the local sum over the global token count
    share.backward()
    count = torch.tensor(float(labels.numel()))  # before the split: the trainer's local_tokens
    max_loss = largest_rank_loss(share.detach(), count, count, dims)
    total = local_sum.detach().clone()
    dist.all_reduce(total, group=group)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for g in grads.values():
        dist.all_reduce(g, group=group)  # FSDP's reduction over the CP ranks

    columns = positions[0].long()
    grad_diff = max(((grads[n] - whole[n]).norm() / whole[n].norm().clamp_min(1e-30)).item() for n in whole)
    return {
        "positions": positions.tolist(),
        "tokens_match": bool(torch.equal(local_inputs, inputs[:, columns]) and torch.equal(local_labels,
                                                                                           labels[:, columns])),
        "logits_max_diff": (local_logits - logits.detach()[:, columns]).abs().max().item(),
        "loss": loss.item(), "cp_loss": (total / labels.numel()).item(), "max_loss": max_loss,
        "grad_max_rel_diff": grad_diff,
        "grads_compared": len(whole),
    }


class Recorder:
    """The metrics processor's part the validator uses: what it logs."""

    def __init__(self) -> None:
        self.ntokens_since_last_log, self.logged = 0, []

    def log_validation(self, loss, step, extra_metrics=None):
        self.logged.append(loss)


def validation(model_cls, args, dims) -> dict:
    """GammaValidator's loss under CP 2 (the ring stood in for by GatheredAttention) and the
    loss of the same validation set computed directly in one process, with the same weights."""
    import contextlib

    from torchtitan.components.loss import cross_entropy_loss

    from gamma_titan.config import load_job_config
    from gamma_titan.data.loader import validation_set
    from gamma_titan.training.validator import build_validator
    from helpers import DEBUG_TOML

    config = load_job_config(["--job.config_file", str(DEBUG_TOML), "--validation.seq_len", str(SEQ),
                              "--validation.local_batch_size", "2", "--validation.steps", "3"])
    torch.manual_seed(0)
    model = model_cls(args)
    model.init_weights()
    model.eval()
    total, count = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for inputs, labels, _ in validation_set(config).rank_batches(0, 1, 2):
            total += cross_entropy_loss(model(inputs), labels).double()
            count += int((labels != -100).sum())
    group = dims.get_mesh("cp").get_group()
    for block in model.layers.values():
        block.attention.sdpa = GatheredAttention(group)

    def positions(module, args_, kwargs):  # what ring attention learns from the sharded batch
        for block in module.layers.values():
            block.attention.sdpa.positions = kwargs["positions"]

    model.register_forward_pre_hook(positions, with_kwargs=True)
    recorder = Recorder()
    validator = build_validator(config, 1, 0, None, dims, cross_entropy_loss, lambda *_: contextlib.nullcontext(),
                                contextlib.nullcontext(), recorder)
    validator.validate([model], step=1)
    return {"one_process": (total / count).item(), "cp": recorder.logged[0], "sequences": 6}


def main() -> None:
    from torchtitan.distributed import ParallelDims

    dist.init_process_group("gloo")
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=dist.get_world_size(), tp=1, pp=1, ep=1, etp=1,
                        world_size=dist.get_world_size())
    dims.build_mesh()
    results = {name: run(cls, args, dims) for name, (cls, args) in models().items()}
    results["validation"] = validation(*models()["dense"], dims)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, results)
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump({name: [rank[name] for rank in every] for name in results}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
