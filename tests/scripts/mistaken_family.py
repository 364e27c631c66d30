"""Test machinery: a family author's mistake, for the layout matrix to show that its copies
check catches it (tests/test_layouts.py). gamma_dense with per-head QK-norms inside each
attention, planned NoParallel under tensor parallelism: their weights are replicated
DTensors whose gradient is each rank's own heads' alone, so the ranks' "replicated" norms
drift apart while the losses still agree with one process's (issue 58: parameters 1.1e-2
off, no run noticed). Pre-flight's plan check passes it: a style places every weight.
`register()` adds it to TorchTitan's registry as NAME."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchtitan.distributed import NoParallel

from gamma_titan.models.common import GatedAttention
from gamma_titan.models.common.parallelize import attention_tp_plan
from gamma_titan.models.common.rope import apply_rope
from gamma_titan.models.dense.model import GammaDense

NAME = "dense_noparallel_qk_norms"


class NoParallelQKNormAttention(GatedAttention):
    def __init__(self, args):
        super().__init__(args.dim, args.n_heads, args.kv_heads, args.head_dim, args.attention_gate)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps)

    def qkv(self, x: torch.Tensor, rope: torch.Tensor):
        bs, seqlen, _ = x.shape
        q = self.q_norm(self.wq(x).view(bs, seqlen, -1, self.head_dim))
        k = self.k_norm(self.wk(x).view(bs, seqlen, -1, self.head_dim))
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def tensor_parallel_plan(self, styles) -> dict:
        # the mistake: replicated, as MLA's low-rank norms are, but these see each rank's heads only
        return attention_tp_plan(self, styles) | {"q_norm": NoParallel(), "k_norm": NoParallel()}


class MistakenDense(GammaDense):
    def __init__(self, args):
        super().__init__(args)
        for block in self.layers.values():
            block.attention = NoParallelQKNormAttention(args)


def register() -> None:
    from torchtitan.protocols import train_spec as registry

    from gamma_titan.training.train_spec import register_families

    register_families()
    if NAME not in registry._extra_train_specs:
        registry.register_train_spec(NAME, dataclasses.replace(registry.get_train_spec("gamma_dense"),
                                                               model_cls=MistakenDense))
