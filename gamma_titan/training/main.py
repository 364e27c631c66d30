"""Training entry point, run by `torchrun ... -m gamma_titan.train --job.config_file CONFIG.toml`
(and, for one process, by `gamma-titan train` itself: `train`).

TorchTitan's Trainer does the training (GammaTrainer, trainer.py); this module parses and
checks the config first (preflight.py), so that bad input ends in one line before any
process group starts or any file is written, and logs the `inspect` summary of the model
at start-up.
"""

from __future__ import annotations

import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from gamma_titan.config import load_job_config
from gamma_titan.errors import EXIT_BAD_INPUT, EXIT_DISK_FULL, EXIT_NONFINITE, ConfigError
from gamma_titan.inspect_model import format_report, inspect_model, knobs, knobs_line, tokens_per_step, \
    weight_decay_report
from gamma_titan.training.agreement import rank_zero_decides
from gamma_titan.training.preflight import finished_run, launch_warnings, preflight, resume_notes, \
    world_size_from_env

#: Above this many parameters the startup summary skips the measured part (it draws
#: every weight once more on the CPU); `gamma-titan inspect` always measures.
STARTUP_MEASURE_MAX_PARAMS = 2_000_000_000


def startup_summary(spec, args, config, device_type: str) -> str:
    """The `inspect` report, logged by rank 0 before training. Measuring it draws every
    weight once more on rank 0's CPU (tens of seconds at 1.5B, while the other ranks
    wait), so a GPU run, or a big model, gets the static part only: its step-1 live
    diagnostics measure σ²(h) and the residual flow on the real weights anyway."""
    import torch

    from gamma_titan.training.train_spec import mask_tokenizer

    with torch.device("meta"):
        n_params = sum(p.numel() for p in spec.model_cls(args).parameters())
    measure = device_type == "cpu" and n_params <= STARTUP_MEASURE_MAX_PARAMS
    report = inspect_model(spec, args, config.training.seq_len, measure=measure,
                           tokenizer=mask_tokenizer(config, args) if measure else None)
    report["tokens_per_step"] = tokens_per_step(config)
    report["weight_decay"] = weight_decay_report(spec, args, config.optimizer.weight_decay_policy)
    report["attention_kernels"] = attention_kernels(args, config, device_type)
    text = format_report(report)
    if not measure:
        why = "on a GPU run" if device_type != "cpu" else "at this size"
        text += (f"\n(measured std, σ²(h) and residual flow skipped {why}: the live diagnostics measure them "
                 "at step 1, and `gamma-titan inspect` on the config measures them at init)")
    return text


def attention_kernels(args, config, device_type: str) -> list[str]:
    """Which SDPA kernel each attention kind will run (a WARNING line for the math kernel,
    which holds the whole T x T score matrix)."""
    from torchtitan.config import TORCH_DTYPE_MAP

    from gamma_titan.models.common.sdpa_kernels import attention_backend_lines

    dtype = TORCH_DTYPE_MAP[config.training.mixed_precision_param]  # what SDPA sees under FSDP or autocast
    deterministic = config.debug.deterministic and not config.debug.deterministic_warn_only
    return attention_backend_lines(args, dtype, device_type, deterministic, seq_len=config.training.seq_len)


def single_process_env() -> None:
    """`python -m gamma_titan.train` without torchrun: act as a world of one."""
    if "LOCAL_RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def run(config, on_stop_saved=None, graceful_stop=None) -> tuple[int, str] | None:
    """TorchTitan's `torchtitan.train.main`, with an already parsed and checked config.
    After a stop signal: (the step it checkpointed, the signal's name); else None.
    `on_stop_saved` is called as soon as that checkpoint is complete; `graceful_stop`, one
    installed before the trainer is built (a stop signal during start-up then stops it
    after its first step)."""
    import signal

    import torch
    from torchtitan.tools.logging import logger
    from gamma_titan.training.trainer import GammaTrainer

    trainer = None
    try:
        trainer = GammaTrainer(config, graceful_stop=graceful_stop)
        trainer.checkpointer.after_stop_save = on_stop_saved
        if config.checkpoint.create_seed_checkpoint:
            if world_size_from_env() != 1:
                raise ConfigError("checkpoint.create_seed_checkpoint needs a single process")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
            if trainer.stopping:
                received = trainer.graceful_stop.signal
                return trainer.step, signal.Signals(received).name if received else "a stop on another rank"
        return None
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


@record  # a rank's exception, whichever rank, reaches torchrun's summary with its traceback (below)
def main(argv: list[str] | None = None) -> None:
    """The worker's entry point. Recorded as TorchTitan's Trainer methods are: under
    `--local-ranks-filter=0` (every launch we generate) another rank's output is not shown,
    and an exception outside those methods (pre-flight, the start-up lines, close) ended in
    torchrun's summary as `error_file: <N/A>`, with no traceback."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = load_job_config(argv)
        spec, args = preflight(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    done = rank_zero_decides("finished", lambda: finished_run(config) or "") or None
    if done is not None:  # rank 0's reading of the folder: no rank starts
        if int(os.environ.get("RANK", "0")) == 0:
            print(done)
        return
    train(config, spec, args)


def start_up_lines(config, spec, args, log_file) -> None:
    """Rank 0, before training: the run record, what the run reads, the model at init, and
    the warnings and notes of this launch."""
    from torchtitan.tools.logging import logger
    from torchtitan.tools.utils import device_type

    from gamma_titan.data.reads import reads_lines, what_it_reads
    from gamma_titan.training.preflight import data_parallel_degree, global_batch_size
    from gamma_titan.training.run_record import write_run_record

    world = world_size_from_env()
    batch = global_batch_size(config.training, data_parallel_degree(config, world))
    reads = what_it_reads(config, args.vocab_size, batch)
    notes = resume_notes(config, world)  # before this launch's run record joins the ones they compare with
    record = write_run_record(config, world, reads=reads)
    logger.info(f"log: {log_file}; run record (resolved config, versions, command): {record}")
    for line in reads_lines(reads):  # a validation set the split cannot fill: a warning
        logger.warning(line.removeprefix("WARNING: ")) if line.startswith("WARNING: ") else logger.info(line)
    summary = startup_summary(spec, args, config, device_type).splitlines()
    # the warnings (the math attention kernel, an ε-dominated norm) once, as warnings
    logger.info("gamma-titan model at init:\n" + "\n".join(l for l in summary if not l.startswith("WARNING: ")))
    for line in summary:
        if line.startswith("WARNING: "):
            logger.warning(line.removeprefix("WARNING: "))
    for warning in launch_warnings(config, args, world, int(os.environ.get("LOCAL_WORLD_SIZE", world))):
        logger.warning(warning.removeprefix("warning: "))  # a grace period that cannot cover the save
    for note in notes:  # another degree or global batch, data started over, a damaged one, a longer run
        logger.warning(note)


def train(config, spec, args) -> None:
    """Train a config that pre-flight has passed (`spec`, `args`: what it returned), in this
    process: one rank of torchrun's world, or a world of one (`gamma-titan train --nproc 1`
    calls this directly). Exits 0 when it finished or stopped with a checkpoint, 2 when a
    live run holds the dump folder, 3 when the step guard stops the run, 4 when a checkpoint
    save finds the disk full; each rank tells its node's launcher how it ended (torchrun.py)."""
    from torchtitan.tools.logging import init_logger, logger
    from torchtitan.tools.utils import device_type

    from gamma_titan.training import console
    from gamma_titan.training.checkpoint import DiskFullError
    from gamma_titan.training.graceful_stop import GracefulStop
    from gamma_titan.training.run_lock import RunLock
    from gamma_titan.training.run_record import LAUNCH_COMMAND_ENV
    from gamma_titan.training.step_guard import NonFiniteError
    from gamma_titan.training.torchrun import write_stop_report

    single_process_env()
    init_logger()
    stop = GracefulStop(config.gamma.reliability.stop_grace_seconds)
    stop.install()  # from here on a stop signal ends in a checkpoint (after step 1 if it comes this early)
    rank = int(os.environ.get("RANK", "0"))
    try:  # one live run per dump folder (run_lock.py), held by rank 0; before its log is touched
        lock = RunLock(config.job.dump_folder).acquire() if rank == 0 else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)
    log_file = console.set_up(config, device_type, rank)
    code, stopped = 1, None  # how this rank ends, for the launcher (an exception leaves 1)
    try:
        if rank == 0:
            start_up_lines(config, spec, args, log_file)
        # TorchTitan's "Starting job:" line prints the description: the knobs as resolved, not as the
        # config says (set after the run record, which keeps the config's own)
        described = config.job.description
        config.job.description = f"{config.model.name} {config.model.flavor}: {knobs_line(knobs(args))}" + (
            f" (config: {described!r})" if described else "")
        stopped = run(config, on_stop_saved=lock.release if lock is not None else None, graceful_stop=stop)
        code = 0
    except NonFiniteError as e:  # [gamma.reliability]: the run stops, naming the step
        code = EXIT_NONFINITE
        logger.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(code)
    except DiskFullError as e:  # a save that found no room: the complete checkpoints stay
        code = EXIT_DISK_FULL
        logger.error(str(e))
        print(f"error: {e}", file=sys.stderr)
        sys.exit(code)
    finally:
        stop.uninstall()  # the caller's handlers again (a caller that goes on: cli, a test)
        if lock is not None:
            lock.release()
        write_stop_report(code, stopped[0] if stopped else None)
    if rank == 0:
        if stopped is not None:  # TorchTitan's "Training completed" was held back (trainer.py)
            step, why = stopped
            logger.info(f"stopped at step {step} of {config.training.steps} ({why}); the same command resumes it")
        for line in console.ending(config, os.environ.get(LAUNCH_COMMAND_ENV)):
            logger.info(line)
