"""Pipeline parallelism, checked before any process group starts: what TorchTitan's
pipeline_llm will do with the [parallelism] keys, so that a split it cannot make, or one that
drops a block, is one line naming the key instead of an error on every rank (or a model
that trains without some of its layers).

The stage count follows TorchTitan 0.2: one stage per rank for single-stage schedules
(1F1B, GPipe), two per rank for the looped ones unless
`pipeline_parallel_layers_per_stage` sets it; the split is `module_fqns_per_model_part`, or
TorchTitan's generate_llm_fqn_per_model_part (embedding and head weighted as
`pipeline_parallel_first/last_stage_less_layers` blocks).
"""

from __future__ import annotations

import math

from gamma_titan.errors import ConfigError

#: Schedules that read their order from `pipeline_parallel_schedule_csv` (without one, torch
#: fails to build them: an abstract class, or a KeyError at the first step).
CSV_SCHEDULES = ("pipelineschedulesingle", "pipelineschedulemulti")
#: Schedules that need an accelerator: torch's DualPipeV asks for one at the first step
#: ("Accelerator expected", measured on gloo with torch 2.13).
ACCELERATOR_SCHEDULES = ("dualpipev",)
#: Schedules whose two stages per rank form a V (TorchTitan's pipeline_module_split).
V_SCHEDULES = ("zbvzerobubble", "dualpipev")
#: Schedules that need at least as many micro-batches as stages (torch raises at build time).
MICRO_BATCH_PER_STAGE_SCHEDULES = ("1f1b", "dualpipev")
#: Schedules that run the micro-batches in rounds of the pipeline degree.
ROUND_SCHEDULES = ("interleaved1f1b", "interleavedzerobubble")


def stage_modules(config, n_layers: int) -> list[list[str]]:
    """Each pipeline stage's modules (TorchTitan's names: tok_embeddings, layers.i, norm,
    output), as pipeline_llm will split them; ConfigError when it cannot."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    p = config.parallelism
    pp, name = p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    single = issubclass(get_schedule_class(name), PipelineScheduleSingle)
    first, last = p.pipeline_parallel_first_stage_less_layers, p.pipeline_parallel_last_stage_less_layers
    if p.module_fqns_per_model_part is not None:
        stages = [list(names) for names in p.module_fqns_per_model_part]
        _check_named_split(stages, n_layers)
    else:
        if p.pipeline_parallel_layers_per_stage is not None:
            stages_total = math.ceil((n_layers + first + last) / p.pipeline_parallel_layers_per_stage)
            where = (f"parallelism.pipeline_parallel_layers_per_stage = {p.pipeline_parallel_layers_per_stage} "
                     f"makes {stages_total} stages of {n_layers} blocks (+ {first} + {last} for embedding and head)")
        else:
            stages_total = pp * (1 if single else 2)
            where = f"parallelism.pipeline_parallel_schedule = {name!r} makes {stages_total} stages"
        try:
            stages = generate_llm_fqn_per_model_part(stages_total, n_layers, first, last)
        except ValueError as e:  # TorchTitan's words: input_weight / output_weight are first / last
            raise ConfigError(f"{where}, with pipeline_parallel_first_stage_less_layers = {first} and "
                              f"last_stage_less_layers = {last}: {e}") from None
    per_rank, rest = divmod(len(stages), pp)
    if rest:
        raise ConfigError(f"parallelism.pipeline_parallel_degree = {pp}: must divide the {len(stages)} pipeline "
                          "stages (module_fqns_per_model_part or pipeline_parallel_layers_per_stage)")
    if single and per_rank != 1:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {name!r} runs one stage per rank, but the "
                          f"split has {per_rank} per rank; use a looped schedule such as Interleaved1F1B, or "
                          f"{pp} stages")
    if name.lower() in V_SCHEDULES and per_rank != 2:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {name!r} runs two stages per rank (a V), but "
                          f"the split has {per_rank}; make it {2 * pp} stages")
    if not single and per_rank < 2:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {name!r} runs several stages per rank, but the "
                          f"split has {per_rank}; use 1F1B or GPipe, or at least {2 * pp} stages")
    _check_micro_batches(config, len(stages))
    return stages


def _check_micro_batches(config, n_stages: int) -> None:
    """What torch's schedules ask of the micro-batch count (they raise at build time on
    every rank otherwise); that the size divides the local batch is config/titan_keys.py's."""
    p, batch = config.parallelism, config.training.local_batch_size
    size, pp, name = p.pipeline_parallel_microbatch_size, p.pipeline_parallel_degree, p.pipeline_parallel_schedule
    n = batch // size
    if name.lower() in MICRO_BATCH_PER_STAGE_SCHEDULES and n < n_stages:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {name!r} needs at least as many micro-batches "
                          f"as stages ({n_stages}); training.local_batch_size / pipeline_parallel_microbatch_size = "
                          f"{batch} / {size} = {n}")
    rounds = max(1, n // pp)
    if name.lower() in ROUND_SCHEDULES and n % rounds:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {name!r} runs the micro-batches in rounds of "
                          f"{pp}: training.local_batch_size / pipeline_parallel_microbatch_size = {batch} / {size} "
                          f"= {n} is not a multiple of {rounds}")
    val = config.validation
    if val.enable and val.local_batch_size % n:
        # TorchTitan's validator runs the training schedule, which splits every batch into its
        # n micro-batches (measured: 4 sequences for 8 fail with "Expecting 8 arg_mbs but got 4")
        raise ConfigError(f"validation.local_batch_size = {val.local_batch_size}: under pipeline parallelism the "
                          f"validator runs the training schedule's {n} micro-batches (training.local_batch_size / "
                          f"pipeline_parallel_microbatch_size); use a multiple of {n}")


def _check_named_split(stages: list[list[str]], n_layers: int) -> None:
    """Every module exactly once, in order, and nothing else: TorchTitan keeps what a stage
    names and drops the rest without a word."""
    key = "parallelism.module_fqns_per_model_part"
    every = ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), "norm", "output"]
    named = [name for stage in stages for name in stage]
    unknown = sorted(set(named) - set(every))
    if unknown:
        raise ConfigError(f"{key}: no module {', '.join(map(repr, unknown))}; the model has tok_embeddings, "
                          f"layers.0 .. layers.{n_layers - 1}, norm, output")
    missing = [name for name in every if name not in named]
    twice = sorted({name for name in named if named.count(name) > 1})
    if missing or twice:
        what = "; ".join(filter(None, [missing and f"missing {', '.join(missing)}",
                                       twice and f"in more than one stage: {', '.join(twice)}"]))
        raise ConfigError(f"{key}: every module in exactly one stage ({what})")
    if named != every:
        raise ConfigError(f"{key}: the stages must take the modules in the model's order ({', '.join(every)})")
    if any(not stage for stage in stages):
        raise ConfigError(f"{key}: a stage with no module")


def check_pipeline(config, n_layers: int, cuda: bool) -> list[list[str]]:
    """The schedule and the split of a pipeline-parallel run; returns the stages."""
    p = config.parallelism
    name = p.pipeline_parallel_schedule
    if name.lower() in CSV_SCHEDULES and not p.pipeline_parallel_schedule_csv:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {name!r} runs the order in "
                          "parallelism.pipeline_parallel_schedule_csv; set that file, or use 1F1B, GPipe, "
                          "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble or ZBVZeroBubble")
    if name.lower() in ACCELERATOR_SCHEDULES and not cuda:
        raise ConfigError(f"parallelism.pipeline_parallel_schedule = {name!r} needs a GPU (torch's DualPipeV); "
                          "on this machine use ZBVZeroBubble, the other V-shaped schedule")
    return stage_modules(config, n_layers)
