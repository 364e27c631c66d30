"""Pre-flight: the settings a config leaves to the machine, derived (derive.py), then every
check that can run before training starts, so that bad input ends in one ConfigError line
before any process group starts or any file is written."""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import read_toml
from gamma_titan.training.train_spec import resolve_model
from gamma_titan.models.common.parallelize import FLOAT8_LINEAR


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def global_batch_size(training, data_parallel_degree: int) -> int:
    """Sequences per optimizer step, as TorchTitan's Trainer computes it: pinned by
    training.global_batch_size, else one local batch per data-parallel rank."""
    pinned = training.global_batch_size
    return pinned if pinned > 0 else training.local_batch_size * data_parallel_degree


def check_parallelism(config, world_size: int, args, cuda: bool | None = None, model_cls=None) -> None:
    """The layout (training/layout.py: one line naming a layout that works, the parallelize
    function's own refusals included), then what it needs of the other keys, and what the
    family's parallelize reads of `model_cls` (its TP plan; the blocks the function's
    contract asks for, such as parallelize_moe's); `cuda`: whether the ranks have GPUs
    (default: this machine)."""
    from gamma_titan.training.layout import LayoutRules
    from gamma_titan.training.pipeline import check_pipeline

    p = config.parallelism  # each degree is an integer >= 1, or -1 where allowed (config/titan_keys.py)
    cuda = torch.cuda.is_available() if cuda is None else cuda
    rules = LayoutRules(args, config.model.name, cuda=cuda)
    layout = rules.resolve(p, world_size)
    if layout.pp > 1:
        check_pipeline(config, args.pipeline_blocks(), cuda=cuda)
    if model_cls is not None:
        args.check_model(model_cls, layout)
        check_model = rules.parallelize_contract().check_model
        if check_model is not None:
            with torch.device("meta"):
                check_model(model_cls(args), layout)
    ep = layout.ep
    ac = config.activation_checkpoint
    if ep > 1 and ac.mode == "selective" and ac.selective_ac_option == "op" and sac_replays_fsdp_hooks():
        # Measured (gamma_moe debug, EP 2 on 2 gloo ranks): the first backward fails with
        # "profiler._record_function_enter_new ... invocation index 3 encountered during backward
        # but not found in storage" on torch 2.13, trains on 2.11. Under EP the experts are a
        # FSDP module of their own inside each checkpointed block, and torch 2.13's FSDP2 hooks
        # emit profiler ops that selective AC replays by count; recompute emits more of them
        # (TorchTitan issue #3427, PyTorch PR #185178, not merged). Full AC does not replay ops.
        raise ConfigError(f"parallelism.expert_parallel_degree = {ep} with activation_checkpoint.mode = \"selective\" "
                          f"and selective_ac_option = \"op\" fails at the first backward on torch {torch.__version__} "
                          "(FSDP's hooks inside the checkpointed experts); use --activation_checkpoint.mode full, "
                          "a per-layer selective_ac_option such as 2, or expert_parallel_degree 1")
    tp_sdpa = layout.tp > 1 and args.tensor_parallel_shards_sdpa()
    if tp_sdpa and sdpa_dtype(config, layout.shard) == "float32":
        # DTensor SDPA has sharding rules for the flash, cuDNN and memory-efficient kernels,
        # and TorchTitan's attention allows only cuDNN, flash (both bf16/fp16) and math (no
        # rule): in float32 the first forward fails.
        raise ConfigError(f"parallelism.tensor_parallel_degree = {layout.tp}: {config.model.name}'s "
                          "tensor parallelism hands SDPA sharded inputs, which have no float32 kernel; train in "
                          "bf16: with FSDP (data_parallel_shard_degree > 1) --training.mixed_precision_param "
                          "bfloat16, without it --training.dtype bfloat16")
    per_step = config.training.local_batch_size * layout.data_parallel
    gbs = config.training.global_batch_size
    if gbs != -1 and (gbs < per_step or gbs % per_step):
        raise ConfigError(f"training.global_batch_size = {gbs!r}: must be -1 or a multiple of local_batch_size x "
                          f"data-parallel degree = {per_step} (the rest is gradient accumulation)")
    if config.training.seq_len % layout.tp:
        raise ConfigError(f"training.seq_len = {config.training.seq_len} must be divisible by "
                          f"parallelism.tensor_parallel_degree = {layout.tp} (sequence parallelism)")
    if layout.cp > 1:
        check_context_parallel(config, layout, args)


def check_context_parallel(config, layout, args) -> None:
    """What TorchTitan's context parallelism needs of the sequence and the attention."""
    divisor = 2 * layout.cp * layout.tp  # 2 x cp load-balanced chunks, each split by sequence parallelism
    for section in ("training", "validation"):
        seq_len = getattr(config, section).seq_len
        if (section == "training" or config.validation.enable) and seq_len % divisor:
            raise ConfigError(f"{section}.seq_len = {seq_len} must be divisible by 2 x context_parallel_degree x "
                              f"tensor_parallel_degree = {divisor} (the sequence's load-balanced chunks)")
    balancer, allowed = config.parallelism.context_parallel_load_balancer, args.context_parallel_balancers()
    if balancer not in allowed:
        names = ", ".join("none" if b is None else repr(b) for b in allowed)
        raise ConfigError(f"parallelism.context_parallel_load_balancer = {balancer!r}: {config.model.name}'s attention "
                          f"takes {names} (\"ptrr\" reorders a flex attention block mask)")


def check_training(config, world_size: int, cuda: bool | None = None) -> None:
    """What float8 and TorchTitan's Trainer need of the machine (each key's own range is
    gamma_titan/config/titan_keys.py's); `cuda`: whether the ranks have GPUs (default: this
    machine)."""
    custom = config.experimental.custom_import
    if custom and not _importable(custom):  # TorchTitan's Trainer imports it
        raise ConfigError(f"experimental.custom_import = {custom!r}: no such module on this Python's path")
    needs = {"metrics.enable_wandb": (config.metrics.enable_wandb, "wandb", '".[wandb]" (this project\'s extra)'),
             "parallelism.expert_parallel_comm_backend": (
                 config.parallelism.expert_parallel_comm_backend == "deepep", "deep_ep", "DeepEP (CUDA only)")}
    for key, (asked, module, package) in needs.items():
        if asked and not _importable(module):
            raise ConfigError(f"{key}: needs the {module} package, which this Python does not have; pip install "
                              f"{package}, or leave {key} at its default")
    csv = config.parallelism.pipeline_parallel_schedule_csv
    if csv and not os.path.isfile(csv):
        raise ConfigError(f"parallelism.pipeline_parallel_schedule_csv = {csv!r}: no such file")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    prof = config.profiling
    for key, asked in (("profiling.enable_profiling", prof.enable_profiling),
                       ("profiling.enable_memory_snapshot", prof.enable_memory_snapshot)):
        # Measured on a CPU: TorchTitan 0.2's profiler passes a None activity for the absent
        # GPU (TypeError at the first step); its memory snapshot calls torch.cpu.memory.
        if asked and not cuda:
            raise ConfigError(f"{key} = true needs a CUDA GPU (TorchTitan's profiler and memory snapshot record "
                              "CUDA); leave it false on this machine")
    if config.checkpoint.async_mode == "async_with_pinned_mem" and not cuda:
        raise ConfigError("checkpoint.async_mode = \"async_with_pinned_mem\" stages in pinned CUDA host memory; on "
                          "this machine use \"async\" or \"disabled\"")
    if config.checkpoint.create_seed_checkpoint and not config.checkpoint.enable:
        raise ConfigError("checkpoint.create_seed_checkpoint = true writes the seed checkpoint only with "
                          "checkpoint.enable = true (without it nothing is written); set both")
    p = config.parallelism
    if p.enable_async_tensor_parallel:
        if p.tensor_parallel_degree == 1:
            raise ConfigError("parallelism.enable_async_tensor_parallel = true applies to tensor parallelism; set "
                              "parallelism.tensor_parallel_degree > 1, or leave it false")
        if not (config.compile.enable and "model" in config.compile.components):
            raise ConfigError("parallelism.enable_async_tensor_parallel = true needs compile.enable = true with "
                              "\"model\" in compile.components (TorchTitan's rule: the compiler overlaps the "
                              "collectives)")
        if not cuda:
            raise ConfigError("parallelism.enable_async_tensor_parallel = true needs CUDA (symmetric memory); leave "
                              "it false on this machine")
    if config.checkpoint.create_seed_checkpoint and world_size != 1:
        raise ConfigError("checkpoint.create_seed_checkpoint = true runs on one process (TorchTitan's rule); "
                          f"this launch has {world_size}")
    converters = config.model.converters
    if any(c.endswith(".mx") for c in converters) and not _cuda_capability((10, 0), cuda):
        raise ConfigError(f"model.converters = {converters}: MX training needs an SM100 (Blackwell) GPU "
                          "(TorchTitan's rule); use quantize.linear.float8")
    if "quantize.grouped_mm.float8" in converters:
        p = config.parallelism
        if not _cuda_capability((8, 9), cuda):
            raise ConfigError("model.converters: quantize.grouped_mm.float8 needs an SM89+ GPU (TorchTitan's float8 MoE "
                              "training has no emulation)")
        if p.pipeline_parallel_degree > 1 or p.context_parallel_degree > 1:
            raise ConfigError("model.converters: quantize.grouped_mm.float8 needs pipeline_parallel_degree and "
                              "context_parallel_degree 1 (TorchTitan's float8 MoE prototype)")
    if FLOAT8_LINEAR in converters:

        compiled = config.compile.enable and "model" in config.compile.components
        if not _cuda_capability((8, 9), cuda):
            recipe = config.quantize.linear.float8.recipe_name
            if recipe is not None:
                raise ConfigError(f"quantize.linear.float8.recipe_name = {recipe!r} needs an SM89+ GPU (TorchTitan "
                                  "never emulates a recipe); on this machine unset it and set "
                                  "quantize.linear.float8.emulate = true (tensorwise float8, emulated)")
            if not config.quantize.linear.float8.emulate:
                raise ConfigError("quantize.linear.float8.emulate must be true without an SM89+ GPU "
                                  "(float8 runs emulated on this machine)")
            if compiled:
                raise ConfigError("compile.enable must be false with emulated float8 "
                                  "(quantize.linear.float8.emulate)")


def _cuda_capability(least: tuple[int, int], cuda: bool) -> bool:
    """Whether the ranks' GPUs are at least of compute capability `least`. For GPUs elsewhere
    (a job submitted from a login node) it is taken that they are: each rank checks again on
    its own GPU before it trains."""
    if not cuda:
        return False
    return torch.cuda.get_device_capability() >= least if torch.cuda.is_available() else True


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing
        return False


def sac_replays_fsdp_hooks() -> bool:
    """Whether this torch's selective activation checkpointing counts the profiler ops of
    FSDP2's hooks: 2.13, 2.14.1 and 2.15.0 do (measured), 2.11 does not (measured); 2.12,
    not measured, is taken to as well."""
    return torch.__version__ >= "2.12"


def check_checkpoint(config) -> None:
    """What TorchTitan's CheckpointManager would only reject once the run is under way: at
    the first load, or at the final save, after the whole run."""
    c = config.checkpoint
    if not c.enable:
        return
    if c.last_save_in_hf and not c.last_save_model_only:
        # TorchTitan asserts it in _save_last_step, i.e. after the last training step.
        raise ConfigError("checkpoint.last_save_in_hf = true needs checkpoint.last_save_model_only = true (the "
                          "Hugging Face form holds the model only; TorchTitan would stop at the final save); or keep "
                          "the full last save and run `gamma-titan convert to-hf` on it")
    if c.initial_load_in_hf and not c.initial_load_model_only:
        raise ConfigError("checkpoint.initial_load_in_hf = true needs checkpoint.initial_load_model_only = true "
                          "(a Hugging Face folder holds the model only)")
    if c.initial_load_in_hf_quantized and not c.initial_load_in_hf:
        raise ConfigError("checkpoint.initial_load_in_hf_quantized = true needs checkpoint.initial_load_in_hf = true")
    if c.initial_load_path and not os.path.isdir(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path = {c.initial_load_path!r}: no such folder")


def sdpa_dtype(config, dp_shard: int) -> str:
    """The dtype SDPA's inputs have in training (`dp_shard`: the FSDP degree): FSDP (or
    context parallelism, which shards with it) casts to training.mixed_precision_param; one
    device or DDP runs under autocast to it; TP or PP without FSDP train in training.dtype
    (TorchTitan's maybe_enable_amp)."""
    p = config.parallelism
    fsdp = dp_shard > 1 or p.context_parallel_degree > 1
    if fsdp or (p.tensor_parallel_degree == 1 and p.pipeline_parallel_degree == 1):
        return config.training.mixed_precision_param
    return config.training.dtype


def launch_warnings(config, args, world_size: int, local_world_size: int) -> list[str]:
    """What a config can run with, but may lose a run: a SIGTERM grace period shorter than
    the model's estimated save (gamma_titan/training/launch.py: 12 bytes a parameter at
    1 GB/s per node), or shorter than this torch's torchrun allows."""
    from gamma_titan.training.launch import WRITE_BYTES_PER_SECOND_PER_NODE, save_seconds, shutdown_warning

    warnings = []
    grace = config.gamma.reliability.stop_grace_seconds
    if config.checkpoint.enable:
        params = sum(math.prod(shape) for shape in parameter_shapes(config.model.name, args).values())
        nodes = max(1, world_size // max(1, local_world_size))
        save = save_seconds(params, nodes)
        if grace < save:
            warnings.append(
                f"warning: gamma.reliability.stop_grace_seconds = {grace:g} is shorter than a full save of this "
                f"model ({params / 1e9:.3g}B parameters x 12 bytes at {WRITE_BYTES_PER_SECOND_PER_NODE / 1e9:g} GB/s "
                f"per node on {nodes} node{'s' if nodes > 1 else ''}: about {save:.0f} s): a SIGTERM would lose that "
                f"checkpoint; set it to at least {math.ceil(1.5 * save)}")
    if (warning := shutdown_warning(grace)) is not None:
        warnings.append(warning)
    return warnings


def check_data(config, args, world_size: int = 1) -> None:
    """Dataset names and paths (shard datasets: opened, so every shard is checked; "hf"
    sources: opened and their text checked), and a tokenizer whose vocabulary fits the model."""
    from gamma_titan.data.names import HF, is_shard_dataset
    from gamma_titan.data.registry import check_dataset, check_hf_source
    from gamma_titan.data.shard_sources import open_samples
    from gamma_titan.data.tokenizer import resolve_tokenizer_path, tokenizer_vocab_size

    path = resolve_tokenizer_path(config.model.hf_assets_path)
    vocab = tokenizer_vocab_size(path)
    if vocab > args.vocab_size:
        raise ConfigError(
            f"model.hf_assets_path: the tokenizer at {path} has {vocab} tokens but "
            f"model_args.vocab_size = {args.vocab_size}; use vocab_size >= {vocab}"
        )
    dp = data_parallel_degree(config, world_size)
    sections = [("training", config.training.seq_len, config.training.local_batch_size)]
    if config.validation.enable or config.gamma.diagnostics.enable:  # the probe batch reads validation data
        sections.append(("validation", config.validation.seq_len, config.validation.local_batch_size))
    for section, _, _ in sections:  # every name and path first: opening shards may build the cache
        cfg = getattr(config, section)
        check_dataset(cfg.dataset, cfg.dataset_path, section)
    for section, _, _ in sections:  # an "hf" source opened and its text checked before any run folder
        cfg = getattr(config, section)
        if cfg.dataset.lower() == HF:
            check_hf_source(cfg.dataset_path, f"{section}.dataset_path")
    for section, seq_len, batch in sections:
        cfg = getattr(config, section)
        if not is_shard_dataset(cfg.dataset):
            continue
        samples = open_samples(config, section, seq_len, path)
        if section == "validation":  # one pass when steps = -1, else it wraps (TorchTitan's behaviour)
            stops = config.validation.enable and config.validation.steps == -1
        else:
            stops = config.gamma.data.on_exhausted == "stop"
        if stops and samples.epoch_samples < dp * batch:
            raise ConfigError(
                f"{section}.dataset: {samples.epoch_samples} sequences of seq_len {seq_len}, fewer than one "
                f"global batch ({dp} x {batch}); add data or lower {section}.seq_len or local_batch_size")


def check_diagnostics(config, spec, args) -> None:
    """The probe batch's dataset and the weights named for row-cosine maps."""
    from gamma_titan.data.loader import probe_tokens
    from gamma_titan.data.names import is_shard_dataset
    from gamma_titan.diagnostics.live import weight_matrices

    d = config.gamma.diagnostics
    if not d.enable:
        return
    if config.parallelism.pipeline_parallel_degree > 1:  # the probe runs the whole model on one rank
        raise ConfigError("gamma.diagnostics.enable = true needs parallelism.pipeline_parallel_degree = 1 "
                          "(the probe runs the whole model); set it false for pipeline-parallel runs")
    if config.parallelism.context_parallel_degree > 1:  # and whole sequences, which CP's ring attention splits
        raise ConfigError("gamma.diagnostics.enable = true needs parallelism.context_parallel_degree = 1 "
                          "(the probe runs whole sequences); set it false for context-parallel runs")
    if is_shard_dataset(config.validation.dataset):  # cheap: reads probe_batch sequences
        probe_tokens(config, d.probe_batch, tokenizer=None)
    if d.cosine_params:
        import torch

        with torch.device("meta"):
            matrices = [n for n, w in weight_matrices(spec.model_cls(args)).items() if w.ndim == 2]
        for name in d.cosine_params:
            if name not in matrices:
                raise ConfigError(f"gamma.diagnostics.cosine_params: {name!r} is not a weight matrix of "
                                  f"{config.model.name}; e.g. {', '.join(matrices[:4])}, ...")


def parameter_shapes(model_name: str, args) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, from a model built on the meta device."""
    import torch

    from gamma_titan.models import TRAIN_SPECS

    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in TRAIN_SPECS[model_name].model_cls(args).named_parameters()}


def check_resume(config, args, world_size: int) -> None:
    """The checkpoint a run would resume from must be a full one of this model. DCP
    itself reports either problem only after the process group is up, as a raw traceback."""
    import json

    from gamma_titan.convert.model_record import model_record, read_model_record
    from gamma_titan.files import MODEL_FILE, step_folder
    from gamma_titan.training.checkpoint_folders import checkpoint_steps, saved_progress

    ckpt = config.checkpoint
    folder = Path(config.job.dump_folder) / ckpt.folder
    if not ckpt.enable or not folder.is_dir():
        return
    skip_damaged(config, folder)
    complete, _ = checkpoint_steps(folder)
    step = ckpt.load_step if ckpt.load_step != -1 else (complete[-1] if complete else -1)
    if step <= 0 or step not in complete:  # none yet, step-0 (a seed: model only), or TorchTitan's own error
        return
    if (folder / MODEL_FILE).is_file():
        saved_name, saved_args, saved = read_model_record(folder, key="checkpoint.folder")
        if parameter_shapes(saved_name, saved_args) != parameter_shapes(config.model.name, args):
            ours = json.loads(json.dumps(model_record(config.model.name, config.model.flavor, args, None)))
            differ = [f"model_args.{k} = {saved['args'].get(k)!r} there, {v!r} here" for k, v in ours["args"].items()
                      if k not in ("init", "max_seq_len") and saved["args"].get(k) != v]
            if saved_name != config.model.name:
                differ.insert(0, f"model.name = {saved_name!r} there, {config.model.name!r} here")
            raise ConfigError(f"checkpoint.folder: {folder} holds checkpoints of another model shape "
                              f"({'; '.join(differ)}); use another job.dump_folder, or the model they were saved with")
    saved = saved_progress(folder / step_folder(step))
    keys = saved["keys"]
    if not any(key.startswith("train_state") for key in keys):
        raise ConfigError(
            f"checkpoint.folder: {step_folder(step)} in {folder} holds the model only (checkpoint.last_save_model_only = "
            f"true), which cannot resume a run; start a new job.dump_folder with --checkpoint.initial_load_path "
            f"{folder / step_folder(step)} for its weights, or resume from a full checkpoint (--checkpoint.load_step)")
    check_resume_layout(config, world_size, folder / step_folder(step), saved)


def data_parallel_degree(config, world_size: int) -> int:
    """Ranks a global batch is split over (TorchTitan's batch mesh): all but TP, CP and PP."""
    p = config.parallelism
    return max(1, world_size // (p.tensor_parallel_degree * p.context_parallel_degree * p.pipeline_parallel_degree))


def damaged_fallback(folder: Path) -> tuple[int | None, str | None]:
    """(the step to resume from instead, the line that says why) when the newest complete
    checkpoint's files were damaged after its save (a file missing or cut short); (None,
    None) when it is intact. A ConfigError if no checkpoint is intact."""
    from gamma_titan.files import step_folder
    from gamma_titan.training.checkpoint_folders import newest_intact

    step, damaged = newest_intact(folder)
    if not damaged:
        return None, None
    what = "; ".join(f"{step_folder(s)}: {why}" for s, why in damaged)
    if step is None:
        raise ConfigError(f"checkpoint: every complete checkpoint in {folder} is damaged ({what}); restore one, or "
                          "move them aside to start from step 1")
    return step, (f"checkpoint {folder / step_folder(damaged[0][0])} is damaged ({what}): resuming from "
                  f"{step_folder(step)}, the newest intact one (the damaged folder is left as it is)")


def skip_damaged(config, folder: Path) -> None:
    """Resume from the newest intact checkpoint (checkpoint.load_step) when the newest is
    damaged; resume_notes says so at start. Nothing when load_step is chosen."""
    if config.checkpoint.load_step == -1:
        step, _ = damaged_fallback(folder)
        if step is not None:
            config.checkpoint.load_step = step


def check_resume_layout(config, world_size: int, step_path, saved: dict) -> None:
    """A resume at another data-parallel degree needs the data position every degree can
    continue (the shard datasets' ShardDataloader); a checkpoint that holds the position
    per rank (TorchTitan's text loader, or written before) resumes at its own degree only."""
    from gamma_titan.data.names import is_shard_dataset

    before, now = saved["data_parallel_degree"], data_parallel_degree(config, world_size)
    if before is None or before == now or "dataloader" in config.checkpoint.exclude_from_loading:
        return
    if saved["position"] is None:
        why = (f"training.dataset {config.training.dataset!r} is read per rank (TorchTitan's text loader)"
               if "dataloader.position" not in saved["keys"] and not is_shard_dataset(config.training.dataset)
               else "it holds the data position per rank (written before positions were global)")
        raise ConfigError(
            f"checkpoint.folder: {step_path} was saved at data-parallel degree {before} and this launch has {now}; "
            f"{why}, so only degree {before} continues its data: launch with that degree, pretokenize the data "
            "(gamma-titan pretokenize: any degree resumes shards), or start its data over with "
            "--checkpoint.exclude_from_loading dataloader")


def resume_notes(config, world_size: int) -> list[str]:
    """What a resume changes, said at start: another data-parallel degree or global batch
    (the data continues at its next sequence; the step and the LR schedule go on counting
    optimizer steps), or data started over (exclude_from_loading)."""
    from gamma_titan.files import step_folder
    from gamma_titan.training.checkpoint_folders import checkpoint_steps, saved_progress

    ckpt = config.checkpoint
    folder = Path(config.job.dump_folder) / ckpt.folder
    if not ckpt.enable or not folder.is_dir():
        return []
    complete, _ = checkpoint_steps(folder)
    step = ckpt.load_step if ckpt.load_step != -1 else (complete[-1] if complete else -1)
    if step <= 0 or step not in complete:
        return []
    saved = saved_progress(folder / step_folder(step))
    notes, dp = [], data_parallel_degree(config, world_size)
    fallback_step, fallback = damaged_fallback(folder)
    if fallback is not None and fallback_step == step:  # pre-flight chose it (skip_damaged)
        notes.append(fallback)
    position, name = saved["position"], step_folder(step)
    if position is not None and saved["data_parallel_degree"] != dp:
        notes.append(f"resuming {name} at data-parallel degree {dp} (saved at {saved['data_parallel_degree']}): the "
                     f"model and optimizer are resharded, and the data continues at sequence {position}")
    batch = global_batch_size(config.training, dp)
    if position is not None and saved["global_batch_size"] != batch:
        notes.append(f"resuming {name} with a global batch of {batch} sequences (saved with "
                     f"{saved['global_batch_size']}): the data continues at sequence {position}, and the step and "
                     f"the LR schedule at step {saved['step']} (they count optimizer steps, not sequences)")
    if "dataloader" in ckpt.exclude_from_loading:
        notes.append(f"resuming {step_folder(step)} with checkpoint.exclude_from_loading = dataloader: the data "
                     "starts again from its first sequence")
    previous = previous_steps(Path(config.job.dump_folder))
    sched = config.lr_scheduler
    if previous is not None and previous != config.training.steps and sched.total_steps is None \
            and sched.min_lr_factor < 1 and sched.decay_ratio != 0:  # a decay that spans training.steps
        notes.append(f"resuming {name} with training.steps {config.training.steps} (the last run had {previous}): the "
                     f"{sched.decay_type} decay of the learning rate now ends at step {config.training.steps}, not "
                     f"{previous}, so steps {step + 1}+ follow a re-spanned schedule (set lr_scheduler.total_steps "
                     "to keep one schedule across extensions)")
    return notes


def previous_steps(dump_folder: Path) -> int | None:
    """training.steps of the newest run record in `dump_folder` (run_record.py), if any."""
    from gamma_titan.training.run_record import RUNS_FOLDER

    records = sorted((dump_folder / RUNS_FOLDER).glob("*/config.toml"))
    if not records:
        return None
    record = read_toml(records[-1], "the record of this run's last start: move that runs/ entry aside to go on")
    return record.get("training", {}).get("steps")


def finished_run(config) -> str | None:
    """The line for a rerun with nothing to do: its newest complete checkpoint is at (or
    past) training.steps. None otherwise (no checkpoint, or load_step chosen)."""
    from gamma_titan.training.checkpoint_folders import checkpoint_steps

    ckpt = config.checkpoint
    folder = Path(config.job.dump_folder) / ckpt.folder
    if not ckpt.enable or ckpt.load_step != -1 or not folder.is_dir():
        return None
    complete, _ = checkpoint_steps(folder)
    if not complete or complete[-1] < config.training.steps:
        return None
    return (f"nothing to do: step {complete[-1]} of {config.training.steps} is done ({folder}); raise "
            "--training.steps to extend")


def preflight(config, world_size: int | None = None, local_world_size: int | None = None,
              cuda: bool | None = None):
    """Settings derived from the world size (gamma_titan/training/derive.py), then every check that
    can run before training starts; returns (spec, model args). `world_size` defaults to
    torchrun's WORLD_SIZE, `local_world_size` (GPUs per node) to LOCAL_WORLD_SIZE, else
    the world size (one node); `cuda`, whether the ranks have GPUs, to this machine's answer
    (`gamma-titan submit` checks a GPU job on a login node without one)."""
    from gamma_titan.config.key_support import check_key_support
    from gamma_titan.training.derive import derive_settings

    world_size = world_size_from_env() if world_size is None else world_size
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    spec, args = resolve_model(config)
    derive_settings(config, args, world_size, local_world_size)
    check_key_support(config, args)
    check_training(config, world_size, cuda)
    args.check_training_device(torch.cuda.is_available() if cuda is None else cuda)
    check_checkpoint(config)
    check_parallelism(config, world_size, args, cuda, model_cls=spec.model_cls)
    check_data(config, args, world_size)
    check_diagnostics(config, spec, args)
    check_resume(config, args, world_size)
    if config.checkpoint.enable and config.checkpoint.last_save_in_hf:
        spec.state_dict_adapter(args, None).hf_config()  # a model HF form cannot hold: refused now, not at the end
    return spec, args
