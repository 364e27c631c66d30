"""TorchTitan's CheckpointManager with the rules a multi-week run needs
(checkpoint_folders.py has the checkpoint-folder rules themselves):

  * a checkpoint is never written from parameters that are not finite;
  * when the run stops on SIGTERM (`stopping`), the current step is saved whatever the
    interval, and an async write is awaited: the process exits right after;
  * model.json (convert/model_record.py) is written next to the checkpoints after every
    save, so that `convert` and a resume's pre-flight know the model;
  * a final save in Hugging Face form (`last_save_in_hf`) gets config.json, the modeling
    code it needs and the tokenizer (convert/hf_folder.py), so transformers loads the folder;
  * keep-last-K counts complete checkpoints only, and incomplete ones (a save killed
    midway) are reported when the manager starts;
  * the live diagnostics' warm state is saved with every checkpoint, and loaded back when
    the checkpoint resumed from holds it (one written with diagnostics off does not);
  * a save that runs out of disk stops the run in one line (DiskFullError: the folder, the
    bytes free and needed); its partial folder is removed, the complete ones stay. An
    asynchronous save's failure surfaces when it is awaited (the next save, or the stop):
    it is attributed to the step that save was of;
  * with `async_with_pinned_mem`, DCP's background save process is shielded from the stop
    signal torchrun sends the worker's process group (shielded_from_stop_signals);
  * a save's collectives may wait as long as the save needs (`save_timeouts`): TorchTitan
    shortens every group's timeout to comm.train_timeout_seconds after step 1, and DCP's
    collectives wait for the slowest writer, so a save slower on one rank than that killed
    the run and lost the save (measured on gloo: 5 s, one rank's save 20 s slower).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from typing import Callable

from torch.distributed.checkpoint import FileSystemReader
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from gamma_titan.files import step_folder
from gamma_titan.training.agreement import broadcast_from_rank_zero
from gamma_titan.training.checkpoint_folders import checkpoint_steps, purge_keeping_complete, report_incomplete_checkpoints
from gamma_titan.training.step_guard import NonFiniteError, parameters_finite

DIAGNOSTICS_STATE = "diagnostics"  # key of LiveDiagnostics in the checkpoint


@contextlib.contextmanager
def shielded_from_stop_signals(active: bool = True):
    """SIGTERM and SIGINT blocked in this thread for the duration. With
    `async_with_pinned_mem`, DCP starts its background save process (spawned from a thread
    it creates) during the first save; both inherit the blocked mask. torchrun stops a
    worker by signalling its whole process group, which held that process too: it died,
    and the stop's own save failed. Shielded, it finishes the save it is given; a stop
    signal sent meanwhile waits, blocked, for the mask to be restored."""
    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return
    from multiprocessing import resource_tracker

    # multiprocessing starts its resource tracker at the first spawn and then unblocks
    # SIGTERM and SIGINT in the calling thread: started here first, it leaves the mask alone
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class DiskFullError(RuntimeError):
    """A checkpoint save found no room: the run stops, the complete checkpoints intact."""


def folder_bytes(path: str | os.PathLike) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


#: How torch's zip writer reports a write that found no room: no errno, only this.
ZIP_WRITE_FAILURE = "unexpected pos"


def out_of_space(err: BaseException, folder: str, needed: int) -> bool:
    """Whether a failed save ran out of disk: ENOSPC somewhere in its chain; or a write
    failure that names no cause (torch's zip writer says only "unexpected pos", another
    OSError) with less room left than a checkpoint takes. Any other failure (a collective's
    timeout, a bug) is not the disk's, however full it is."""
    todo, writes = [err], False
    while todo:  # the chain, and the per-rank failures DCP gathers into a CheckpointException
        seen = todo.pop()
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        writes |= isinstance(seen, OSError) or ZIP_WRITE_FAILURE in str(seen)
        todo += [e for e in (seen.__cause__, seen.__context__) if e is not None]
        for failure in getattr(seen, "failures", {}).values():  # {rank: (exception, traceback)}
            todo += [e for e in (failure if isinstance(failure, tuple) else (failure,)) if isinstance(e, BaseException)]
    if not writes:
        return False
    try:
        return shutil.disk_usage(folder).free < needed
    except OSError:
        return False


@dataclass
class SaveTimeouts:
    """The process groups' timeouts around a save: `set(seconds)` sets them; a save runs
    under `save` seconds, and after it the timeout in effect before comes back (TorchTitan's
    comm.init_timeout_seconds until step 1's end, comm.train_timeout_seconds after)."""

    set: Callable[[float], None]
    save: float
    init: float
    train: float

    @contextlib.contextmanager
    def during_save(self, step: int):
        self.set(self.save)
        try:
            yield
        finally:
            self.set(self.init if step <= 1 else self.train)


class GammaCheckpointManager(CheckpointManager):
    def __init__(self, *, model_record: dict | None, device, save_timeouts: SaveTimeouts | None = None, **kwargs):
        """TorchTitan's arguments, plus the model.json record to write after each save
        (None on ranks other than 0), the device of the finiteness check and the timeouts
        a save's collectives run under (None: the groups' own)."""
        super().__init__(**kwargs)
        self.save_timeouts = save_timeouts
        self.model_parts = kwargs["model_parts"]
        self.model_record, self.device = model_record, device
        self.stopping = False  # set by the trainer once every rank agreed to stop on SIGTERM
        self.stop_reason = "SIGTERM"  # what the stop line names: the signal this rank got (trainer)
        self.after_stop_save = None  # called once the stop's checkpoint is complete (main.py: the run lock)
        self._in_flight: int | None = None  # the step of an asynchronous save not yet awaited
        self._agreed_step: int | None = None  # the step every rank resumes from (rank 0's reading)
        self._diagnostics = None
        if self.enable and model_record is not None:
            report_incomplete_checkpoints(self.folder)

    # --- what is saved ------------------------------------------------------------------

    def track_diagnostics(self, diagnostics, load_step: int = -1) -> None:
        """Save the diagnostics' warm state from now on; load it with the checkpoint this
        run resumes from (`load_step`, -1: the newest complete one) if that one holds it,
        else the diagnostics start cold."""
        self._diagnostics = diagnostics
        step = self._resume_step(load_step)
        if step > 0 and self._holds(step, DIAGNOSTICS_STATE):
            self.states[DIAGNOSTICS_STATE] = diagnostics
        elif step > 0:
            logger.info(f"{step_folder(step)} holds no diagnostics state: the diagnostics start cold")

    def _resume_step(self, load_step: int) -> int:
        """The step this run resumes from (-1: none): rank 0's reading of the folder, the same
        on every rank (agreement.py), settled at the first call, which every rank makes."""
        if not self.enable:
            return -1
        if self._agreed_step is None:
            local = load_step if load_step != -1 else super()._find_load_step()
            self._agreed_step = broadcast_from_rank_zero(local if os.path.isdir(self.folder) else -1)
        return self._agreed_step

    def _find_load_step(self, folder: str = "") -> int:
        """TorchTitan's choice of the newest checkpoint, replaced by the agreed one."""
        if folder in ("", self.folder) and self._agreed_step is not None:
            return self._agreed_step
        return super()._find_load_step(folder)

    def _holds(self, step: int, key: str) -> bool:
        try:
            keys = FileSystemReader(os.path.join(self.folder, step_folder(step))).read_metadata().state_dict_metadata
        except FileNotFoundError:
            return False
        return any(k.startswith(f"{key}.") for k in keys)

    def load(self, step: int = -1) -> bool:
        """TorchTitan's load of the agreed step; first the states that have a form of their own
        (the trainer's train_state, the shard dataloader) are told which form it holds."""
        resume = self._resume_step(step)
        if resume > 0:
            keys = set(FileSystemReader(os.path.join(self.folder, step_folder(resume))).read_metadata()
                       .state_dict_metadata)
            for state in self.states.values():
                if hasattr(state, "read_form"):
                    state.read_form(keys)
        loaded = super().load(-1)  # TorchTitan asks _find_load_step, which answers the agreed step
        for state in self.states.values():
            if hasattr(state, "read_form"):
                state.read_form(set())  # what it saves from now on: its own form
        if self._diagnostics is not None:
            self.states[DIAGNOSTICS_STATE] = self._diagnostics  # saved from now on
        return loaded

    # --- when and how it is saved ---------------------------------------------------------

    def _should_save(self, curr_step: int, last_step: bool = False) -> bool:
        stop_save = self.stopping and self.enable and not self.load_only
        return stop_save or super()._should_save(curr_step, last_step)

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if not self._should_save(curr_step, last_step):
            return super().save(curr_step, last_step)  # TorchTitan's fault-tolerance bookkeeping
        if not parameters_finite(self.model_parts, self.device):  # a collective: every rank asks
            raise NonFiniteError(f"step {curr_step}: parameters are not finite; not saving a checkpoint "
                                 "(the last one is intact)")
        timeouts = self.save_timeouts.during_save(curr_step) if self.save_timeouts else contextlib.nullcontext()
        try:
            with shielded_from_stop_signals(self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM), timeouts:
                super().save(curr_step, last_step)
            if self.save_future is not None and not last_step:
                self._in_flight = curr_step  # written in the background: its failure surfaces at the next wait
            if self.stopping:
                self._async_wait()  # the process exits next: an async write in flight must land first
        except BaseException as err:  # DCP's CheckpointException is a BaseException; re-raised unless the disk is full
            if not isinstance(err, (KeyboardInterrupt, SystemExit, DiskFullError)):
                self._raise_if_disk_full(err, curr_step)
            raise
        if self.stopping:
            logger.info(f"{self.stop_reason}: checkpointed step {curr_step}")
            if self.after_stop_save is not None:
                self.after_stop_save()
        if self.model_record is not None and os.path.isdir(self.folder):
            from gamma_titan.convert.model_record import write_model_record

            write_model_record(self.folder, self.model_record)
            if last_step and self.last_save_in_hf:  # TorchTitan wrote the weights; transformers needs the rest
                from gamma_titan.convert.hf_folder import write_hf_files

                write_hf_files(self._create_checkpoint_id(curr_step), self.model_record["model"], self.sd_adapter,
                               self.model_record["tokenizer"], self.export_dtype)
                if getattr(self.sd_adapter, "package_reason", None):
                    architecture = self.sd_adapter.hf_config()["architectures"][0]
                    logger.info(f"Hugging Face save: {architecture} ({self.sd_adapter.package_reason})")

    def _async_wait(self) -> None:
        """TorchTitan's wait for the asynchronous save in flight. Its failure belongs to the step
        that save was of, not to the save about to start: a full disk names that step and
        removes its partial folder."""
        step, self._in_flight = self._in_flight, None
        try:
            super()._async_wait()
        except BaseException as err:
            if step is not None and not isinstance(err, (KeyboardInterrupt, SystemExit)):
                self._raise_if_disk_full(err, step)
            raise

    def _raise_if_disk_full(self, err: BaseException, step: int) -> None:
        complete, _ = checkpoint_steps(self.folder)
        needed = folder_bytes(os.path.join(self.folder, step_folder(complete[-1]))) if complete else 0
        if not out_of_space(err, self.folder, needed):
            return
        partial = os.path.join(self.folder, step_folder(step))
        if not os.path.isfile(os.path.join(partial, ".metadata")):
            shutil.rmtree(partial, ignore_errors=True)  # this save's own half-written files
        free = shutil.disk_usage(self.folder).free
        kept = f"{step_folder(complete[-1])} is the newest complete one" if complete else "none was complete"
        raise DiskFullError(
            f"checkpoint {step_folder(step)}: the disk is full ({self.folder}: {free:,} bytes free"
            + (f", a checkpoint takes {needed:,}" if needed else "") + f"); {kept}, and stays loadable. Make room "
            "and run the same command to resume") from None

    def _purge_stale_checkpoints(self) -> None:
        purge_keeping_complete(self)  # TorchTitan's own counts every step-N folder, complete or not
