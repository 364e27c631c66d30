"""TorchTitan's Trainer, plus the live diagnostics of `[gamma.diagnostics]` and the
safeguards of `[gamma.reliability]` (gamma_titan/reliability.py).

Additions, each hooked where TorchTitan leaves a seam:
  * after the optimizer step of a due step (step 1 and every `freq` steps),
    `LiveDiagnostics.measure` runs on the probe batch and its numbers go to the same metrics
    line, TensorBoard and metrics.jsonl as the step's loss;
  * each step's update goes through `StepGuard` (the optimizer and LR-schedule steps are
    wrapped): a non-finite loss or gradient norm skips the update or stops the run, and
    loss spikes are logged with their global batch;
  * every checkpoint save is checked (parameters finite) and followed by model.json next to
    the checkpoints (convert/model_record.py); keep-last-K only counts complete
    checkpoints, and incomplete ones are reported at start-up;
  * SIGTERM ends the run after the step in progress, with a full checkpoint of it;
  * when the data runs out (`gamma.data.on_exhausted = "stop"`), the last finished step is
    checkpointed before TorchTitan ends the loop (it would otherwise end without saving).
"""

from __future__ import annotations

import os
import signal

import torch
import torchtitan.distributed.utils as dist_utils
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from gamma_titan.diagnostics import LiveDiagnostics, build_probe_batch, diagnostics_due
from gamma_titan.reliability import (
    GracefulStop,
    NonFiniteError,
    StepGuard,
    parameters_finite,
    purge_keeping_complete,
    report_incomplete_checkpoints,
    step_verdict,
)


DIAGNOSTICS_STATE = "diagnostics"  # key of LiveDiagnostics in the checkpoint


class GammaTrainer(Trainer):
    def __init__(self, job_config):
        super().__init__(job_config)
        self.diagnostics: LiveDiagnostics | None = None
        cfg = job_config.gamma.diagnostics
        if cfg.enable:
            with torch.random.fork_rng(devices=[]):  # the probe batch draws no training randomness
                tokens = build_probe_batch(job_config, self.tokenizer).to(self.device)
            tp = self.parallel_dims.get_optional_mesh("tp")
            self.diagnostics = LiveDiagnostics(cfg, self.model_parts[0], tokens,
                                               tp_group=tp.get_group() if tp is not None else None)
            self.metrics_processor.diagnostics_attached = True
            if job_config.checkpoint.enable:
                self._checkpoint_diagnostics()

        reliability = job_config.gamma.reliability
        self.guard = StepGuard(reliability)
        self.graceful_stop = GracefulStop(reliability.stop_grace_seconds)
        self.graceful_stop.install()
        self.stopping = False  # SIGTERM agreed: checkpoint this step, then end the loop
        self._step_losses: list[torch.Tensor] = []
        self._grad_norm: torch.Tensor | None = None
        self._update_applied = True
        self._guard_updates()
        self._guard_checkpoints()
        if reliability.inject_nan_at_steps:
            self._inject_nan_at(set(reliability.inject_nan_at_steps))
        if reliability.inject_kill_in_save_at_step:
            self._inject_kill_in_save(reliability.inject_kill_in_save_at_step)

    # --- the step guard ----------------------------------------------------------------------

    def _guard_updates(self) -> None:
        """Record the gradient norm TorchTitan computes for clipping, and let the optimizer
        and LR-schedule steps happen only when the guard allows."""
        self._clip = dist_utils.clip_grad_norm_

        def clip_and_record(*args, **kwargs):
            self._grad_norm = self._clip(*args, **kwargs)
            return self._grad_norm

        dist_utils.clip_grad_norm_ = clip_and_record  # restored in close()
        optimizer_step, schedule_step = self.optimizers.step, self.lr_schedulers.step

        def guarded_optimizer_step(*args, **kwargs):
            self._update_applied = self._check_step()
            if self._update_applied:
                optimizer_step(*args, **kwargs)

        def guarded_schedule_step(*args, **kwargs):
            if self._update_applied:
                schedule_step(*args, **kwargs)

        self.optimizers.step = guarded_optimizer_step
        self.lr_schedulers.step = guarded_schedule_step

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        self._step_losses.append(loss.detach())
        return loss

    def _check_step(self) -> bool:
        """The step's verdict, agreed by every rank with one collective and one host sync
        (reliability.step_verdict): its global loss and gradient norm through the guard,
        and whether any rank got SIGTERM (then all stop after this step)."""
        loss = torch.stack(self._step_losses).sum()
        self._step_losses.clear()
        tp = self.parallel_dims.get_optional_mesh("tp")
        verdict = step_verdict(loss, self._grad_norm, self.graceful_stop.requested,
                               counts_loss=tp is None or tp.get_local_rank() == 0)
        loss_value, norm_value = verdict.loss, verdict.grad_norm
        if verdict.stop and not self.stopping:
            self.stopping = True
            if not self.job_config.checkpoint.enable:
                logger.warning("SIGTERM with checkpoint.enable = false: stopping without a checkpoint")
        apply = self.guard.check(self.step, norm_value, loss_value)
        events = {}
        if not apply:
            events["nonfinite_skipped"] = {"loss": loss_value, "grad_norm": norm_value, "skipped_so_far": self.guard.skipped}
        mean = self.guard.spikes.observe(loss_value)
        if mean is not None:
            events["loss_spike"] = self._spike_record(loss_value, mean)
            logger.warning(f"step {self.step}: loss spike {loss_value:.4f} vs running mean {mean:.4f} "
                           f"(global batch {self.step - 1})")
        if events:
            self.metrics_processor.add_event(self.step, events)
        return apply

    def _spike_record(self, loss: float, mean: float) -> dict:
        """The spike and where its data came from: the step's global batch, i.e. sequences
        [(step-1)·G, step·G) of the training order (G sequences per step), which
        `gamma_titan.data` reproduces from the data config alone."""
        t = self.job_config.training
        dp = self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard
        per_step = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dp
        return {"loss": loss, "running_mean": mean, "global_batch": self.step - 1,
                "sequences": [(self.step - 1) * per_step, self.step * per_step]}

    def _inject_nan_at(self, steps: set[int]) -> None:
        """Fault injection: the model's output becomes NaN at these steps (a poisoned batch)."""
        def poison(module, inputs, output):
            if self.step in steps and module.training:
                logger.warning(f"step {self.step}: injecting NaN (gamma.reliability.inject_nan_at_steps)")
                return output * float("nan")
            return output

        self.model_parts[-1].register_forward_hook(poison)

    def _inject_kill_in_save(self, step: int) -> None:
        """Fault injection: rank 0 dies in the DCP save of `step` once every rank's data is
        written and just before `.metadata` (the file that makes a checkpoint complete)."""
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        finish = FileSystemWriter.finish

        def finish_or_die(writer, metadata, results):
            if self.step == step and torch.distributed.get_rank() == 0:
                logger.warning(f"step {step}: killing rank 0 inside the checkpoint write "
                               "(gamma.reliability.inject_kill_in_save_at_step)")
                os.kill(os.getpid(), signal.SIGKILL)
            return finish(writer, metadata, results)

        FileSystemWriter.finish = finish_or_die

    # --- checkpoints ---------------------------------------------------------------------------

    def _checkpoint_diagnostics(self) -> None:
        """The diagnostics' warm state goes into every checkpoint, and is loaded back when
        the checkpoint resumed from has it (one written with diagnostics off does not: then
        they start cold)."""
        checkpointer = self.checkpointer
        step = self.job_config.checkpoint.load_step
        step = checkpointer._find_load_step() if step == -1 else step
        if step > 0:
            from torch.distributed.checkpoint import FileSystemReader

            try:
                keys = FileSystemReader(os.path.join(checkpointer.folder, f"step-{step}")).read_metadata()
                keys = keys.state_dict_metadata
            except FileNotFoundError:
                keys = {}
            if any(key.startswith(f"{DIAGNOSTICS_STATE}.") for key in keys):
                checkpointer.states[DIAGNOSTICS_STATE] = self.diagnostics
            else:
                logger.info(f"step-{step} holds no diagnostics state: the diagnostics start cold")
        load = checkpointer.load

        def load_then_track(*args, **kwargs):
            loaded = load(*args, **kwargs)
            checkpointer.states[DIAGNOSTICS_STATE] = self.diagnostics  # saved from now on
            return loaded

        checkpointer.load = load_then_track

    def _guard_checkpoints(self) -> None:
        """Every save: refuse non-finite parameters, force a full save when stopping, then
        record model.json (rank 0). Keep-last-K counts complete checkpoints only."""
        from gamma_titan.convert.model_record import model_record, write_model_record
        from gamma_titan.data.tokenizer import resolve_tokenizer_path

        job = self.job_config
        checkpointer = self.checkpointer
        folder = os.path.join(job.job.dump_folder, job.checkpoint.folder)
        rank0 = torch.distributed.get_rank() == 0
        if job.checkpoint.enable and rank0:
            report_incomplete_checkpoints(folder)
        if getattr(checkpointer, "keep_latest_k", 0) > 0:  # unset when checkpointing is off
            checkpointer._purge_stale_checkpoints = lambda: purge_keeping_complete(checkpointer)
        # model.json is written after each save rather than at start-up: TorchTitan ignores
        # `checkpoint.initial_load_path` once the checkpoint folder exists.
        record = model_record(job.model.name, job.model.flavor, self.model_args,
                              resolve_tokenizer_path(job.model.hf_assets_path)) if rank0 else None
        save, should_save = checkpointer.save, checkpointer._should_save

        def guarded_save(curr_step: int, last_step: bool = False) -> None:
            force = self.stopping and job.checkpoint.enable and not last_step
            if not (force or should_save(curr_step, last_step)):
                return save(curr_step, last_step=last_step)
            if not parameters_finite(self.model_parts, self.device):
                raise NonFiniteError(f"step {curr_step}: parameters are not finite; not saving a checkpoint "
                                     "(the last one is intact)")
            if force:
                checkpointer._should_save = lambda *args, **kwargs: True
            try:
                save(curr_step, last_step=last_step)
                if force:  # the process exits next: an async save still in flight must land first
                    checkpointer._async_wait()
            finally:
                checkpointer._should_save = should_save
            if record is not None and os.path.isdir(folder):
                write_model_record(folder, record)
            if force:
                logger.info(f"SIGTERM: checkpointed step {curr_step}")

        checkpointer.save = guarded_save

    # --- the loop ------------------------------------------------------------------------------

    def train_step(self, data_iterator):
        self._step_losses.clear()
        kill_at = self.job_config.gamma.reliability.inject_kill_at_step
        if self.step == kill_at and torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
            logger.warning(f"step {kill_at}: killing the last rank (gamma.reliability.inject_kill_at_step)")
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            super().train_step(data_iterator)
        except DataloaderExhaustedError:
            finished = self.step - 1  # self.step is the step that found no data
            if finished > 0 and finished % self.job_config.checkpoint.interval:  # else saved already
                self.checkpointer.save(finished, last_step=True)
            raise
        if self.diagnostics is not None and diagnostics_due(self.job_config.gamma.diagnostics, self.step):
            metrics, maps = self.diagnostics.measure(self.step, with_images=self.metrics_processor.has_image_logger)
            self.metrics_processor.log_diagnostics(self.step, metrics, maps)

    def should_continue_training(self) -> bool:
        return not self.stopping and super().should_continue_training()

    def close(self) -> None:
        if hasattr(self, "_clip"):
            dist_utils.clip_grad_norm_ = self._clip
        super().close()
        if hasattr(self, "graceful_stop"):
            self.graceful_stop.uninstall()
