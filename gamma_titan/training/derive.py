"""Settings a config leaves to the machine or the model, filled in before TorchTitan reads
them, so that one config runs unchanged on one node or on many:

* `parallelism.data_parallel_replicate_degree = -1`: HSDP, i.e. FSDP inside a node
  (`data_parallel_shard_degree = -1`: the node's GPUs over TP) and replication across
  nodes. Parameters are gathered over NVLink; only gradients cross nodes, once a step.
  When TP (or CP) fills a node, nothing is left to shard inside it, and replicas without
  shards (DDP) take no other parallelism: then FSDP spans the nodes instead (replicate 1).
* `parallelism.expert_parallel_degree = -1`: the largest degree that divides the routed
  experts, the data-parallel shard degree and the GPUs of one node (all-to-all stays
  inside a node); 1 on one GPU.
* float8: the layers that must stay in high precision are added to
  `quantize.linear.float8.filter_fqns`, as the model family says (`float8_excluded_fqns`).

`preflight` calls `derive_settings` first, so every check sees the derived values, and
the run record stores them.
"""

from __future__ import annotations

import math

from gamma_titan.config.titan_keys import AUTO
from gamma_titan.errors import ConfigError
from gamma_titan.models.common.parallelize import FLOAT8_LINEAR


def derive_settings(config, args, world_size: int, local_world_size: int) -> None:
    _derive_hsdp(config, world_size, local_world_size)
    _derive_expert_parallel(config, args, world_size, local_world_size)
    if FLOAT8_LINEAR in config.model.converters:
        fqns = config.quantize.linear.float8.filter_fqns
        fqns += [f for f in args.float8_excluded_fqns() if f not in fqns]


def _derive_hsdp(config, world_size: int, local_world_size: int) -> None:
    p = config.parallelism
    if p.data_parallel_replicate_degree != AUTO:
        return
    if world_size % local_world_size:
        raise ConfigError(f"parallelism.data_parallel_replicate_degree = -1 (one replica per node): the world size "
                          f"{world_size} is not a multiple of the GPUs per node ({local_world_size})")
    inner = p.tensor_parallel_degree * p.context_parallel_degree
    if p.data_parallel_shard_degree == AUTO:
        if local_world_size % inner:
            raise ConfigError(f"parallelism.data_parallel_replicate_degree = -1: the {local_world_size} GPUs of a "
                              f"node do not divide into tensor x context parallel groups of {inner}")
        p.data_parallel_shard_degree = local_world_size // inner
        if p.data_parallel_shard_degree == 1 and inner > 1:
            p.data_parallel_shard_degree = max(1, world_size // inner)
    p.data_parallel_replicate_degree = max(1, world_size // (p.data_parallel_shard_degree * inner))


def _derive_expert_parallel(config, args, world_size: int, local_world_size: int) -> None:
    p = config.parallelism
    if p.expert_parallel_degree != AUTO:
        return
    experts = args.expert_parallel_divisor()
    if experts == 1:  # no experts: nothing to shard by expert
        p.expert_parallel_degree = 1
        return
    shard = p.data_parallel_shard_degree
    if shard == AUTO:
        non_dp = p.tensor_parallel_degree * p.context_parallel_degree * p.data_parallel_replicate_degree
        shard = max(1, world_size // non_dp)
    degree = math.gcd(experts, shard * p.context_parallel_degree, local_world_size)
    p.expert_parallel_degree = 1 if p.tensor_parallel_degree > 1 else degree  # TP with EP is not wired
