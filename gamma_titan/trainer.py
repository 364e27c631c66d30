"""TorchTitan's Trainer, plus the live diagnostics of `[gamma.diagnostics]`.

Three additions:
  * after the optimizer step of a due step (step 1 and every `freq` steps),
    `LiveDiagnostics.measure` runs on the probe batch and its numbers go to the same metrics
    line, TensorBoard and metrics.jsonl as the step's loss;
  * model.json goes next to the checkpoints, with each save (convert/model_record.py);
  * when the data runs out (`gamma.data.on_exhausted = "stop"`), the last finished step is
    checkpointed before TorchTitan ends the loop (it would otherwise end without saving).
"""

from __future__ import annotations

import torch
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.train import Trainer

from gamma_titan.diagnostics import LiveDiagnostics, build_probe_batch, diagnostics_due


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
        if job_config.checkpoint.enable and torch.distributed.get_rank() == 0:
            self._record_model_with_checkpoints()

    def _record_model_with_checkpoints(self) -> None:
        """model.json next to the checkpoints: what `gamma-titan convert` needs besides
        tensors. Written after each save rather than at start-up: TorchTitan ignores
        `checkpoint.initial_load_path` once the checkpoint folder exists, so the folder must
        not appear before the first checkpoint does."""
        import os

        from gamma_titan.convert.model_record import model_record, write_model_record
        from gamma_titan.data.tokenizer import resolve_tokenizer_path

        job = self.job_config
        record = model_record(job.model.name, job.model.flavor, self.model_args,
                              resolve_tokenizer_path(job.model.hf_assets_path))
        folder = os.path.join(job.job.dump_folder, job.checkpoint.folder)
        save = self.checkpointer.save

        def save_and_record(curr_step: int, last_step: bool = False) -> None:
            save(curr_step, last_step=last_step)
            if os.path.isdir(folder):  # a checkpoint was written (or is being written)
                write_model_record(folder, record)

        self.checkpointer.save = save_and_record

    def train_step(self, data_iterator):
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
