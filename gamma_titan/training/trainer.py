"""TorchTitan's Trainer, plus the live diagnostics of `[gamma.diagnostics]` and the
safeguards of `[gamma.reliability]` (gamma_titan/training/reliability.py), added by overriding
what TorchTitan offers to override:

  * `train_step`: TorchTitan's step (micro-batches, the loss over the global token count,
    gradient clipping), then the step's verdict, agreed by every rank in one collective
    (the global loss and gradient norm, and whether any rank got SIGTERM): a non-finite
    loss or gradient norm skips the update (no optimizer or LR-schedule step) or stops
    the run, and loss spikes are logged with their global batch; then, at a due step
    (step 1 and every `freq` steps), `LiveDiagnostics.measure` on the probe batch, whose
    numbers go to the same metrics line as the step's loss;
  * `should_continue_training`: SIGTERM ends the run after the step in progress, which
    the checkpointer (`GammaCheckpointManager`, gamma_titan/training/checkpoint.py) then saves;
  * when the data runs out (`gamma.data.on_exhausted = "stop"`), the last finished step is
    checkpointed before TorchTitan ends the loop (it would otherwise end without saving).
"""

from __future__ import annotations

import logging
import os
import re
import signal
from datetime import timedelta

import torch
import torchtitan.distributed.utils as dist_utils
from torch.distributed._composable.replicate import replicate
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.dataloader import DataloaderExhaustedError
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger
from torchtitan.train import Trainer

from gamma_titan.init import canonical_name
from gamma_titan.models.common.parallelize import FLOAT8_LINEAR
from gamma_titan.training.checkpoint import GammaCheckpointManager, SaveTimeouts
from gamma_titan.diagnostics import LiveDiagnostics, build_probe_batch, diagnostics_due
from gamma_titan.models.common.masks import trainer_masks
from gamma_titan.models.common.moe import RoutingLedger, set_aux_grad_scale, set_micro_batch_share
from gamma_titan.training.graceful_stop import GracefulStop
from gamma_titan.training.step_guard import StepGuard, step_verdict


def float8_layers(model_parts) -> str:
    """Which linear layers the float8 converter swapped and which it kept in high precision,
    by name pattern (layer indices as *): what the GPU acceptance check reads."""
    from torchao.float8.float8_linear import Float8Linear

    converted, kept = {}, set()
    for part in model_parts:
        for name, module in part.named_modules():
            if isinstance(module, torch.nn.Linear):
                pattern = re.sub(r"layers\.\d+\.", "layers.*.", canonical_name(name))
                if isinstance(module, Float8Linear):
                    converted[pattern] = converted.get(pattern, 0) + 1
                else:
                    kept.add(pattern)
    return (f"float8: {sum(converted.values())} linear layers converted ({', '.join(sorted(converted))}); "
            f"high precision: [{', '.join(sorted(kept))}]")


def largest_rank_loss(loss: torch.Tensor, global_tokens: torch.Tensor, local_tokens: torch.Tensor,
                      dims) -> float:
    """The largest mean loss of one data-parallel rank's batch (`max_loss`). `loss` is this
    rank's share of the global mean (its loss sum over the global token count); the
    context-parallel ranks of a batch each hold a part of its sequences' sum, added here
    first. (TorchTitan 0.2.2 took the max over data x context ranks of each part alone,
    1/CP of the value.) `local_tokens`: the batch's, counted before CP splits it."""
    share = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
    if dims.cp_enabled:
        share = share.detach().clone()
        torch.distributed.all_reduce(share, group=dims.get_mesh("cp").get_group())
    mean = share * global_tokens / local_tokens
    return dist_utils.dist_max(mean, dims.get_mesh("batch")) if dims.dp_enabled else mean.item()


class GammaTrainer(Trainer):
    def __init__(self, job_config, graceful_stop: GracefulStop | None = None):
        """`graceful_stop`: one installed before the trainer was built (main.py), so that a stop
        signal during the start-up still ends in a checkpoint, after step 1."""
        self.legacy_train_state = 0  # read_form: the saving run's data-parallel degree, for TorchTitan's form
        super().__init__(job_config)
        self.checkpointer = self._gamma_checkpointer(self.checkpointer)
        self.routing = [RoutingLedger(part) for part in self.model_parts]
        for part in self.model_parts:  # the MoE auxiliary loss is weighted by its share of the batch
            set_micro_batch_share(part, 1.0 / (self._data_parallel_degree() * self.gradient_accumulation_steps
                                               * self._pipeline_micro_batches()))
        self.diagnostics: LiveDiagnostics | None = None
        cfg = job_config.gamma.diagnostics
        if cfg.enable:
            with torch.random.fork_rng(devices=[]):  # the probe batch draws no training randomness
                tokens = build_probe_batch(job_config, self.tokenizer).to(self.device)
            tp = self.parallel_dims.get_optional_mesh("tp")
            self.diagnostics = LiveDiagnostics(cfg, self.model_parts[0], tokens,
                                               tp_group=tp.get_group() if tp is not None else None,
                                               masks=trainer_masks(self.model_parts[0], tokens, self.tokenizer))
            self.metrics_processor.diagnostics_attached = True
            if job_config.checkpoint.enable:
                self.checkpointer.track_diagnostics(self.diagnostics, job_config.checkpoint.load_step)
        if FLOAT8_LINEAR in job_config.model.converters:
            logger.info(float8_layers(self.model_parts))
        reliability = job_config.gamma.reliability
        self.guard = StepGuard(reliability)
        self.graceful_stop = graceful_stop or GracefulStop(reliability.stop_grace_seconds)
        self.graceful_stop.install()
        self.stopping = False  # SIGTERM agreed: checkpoint this step, then end the loop

    def _gamma_checkpointer(self, titans: CheckpointManager) -> GammaCheckpointManager:
        """TorchTitan's Trainer builds its CheckpointManager inline; ours, built with the
        same arguments, takes its place before anything is loaded or saved."""
        from gamma_titan.convert.model_record import model_record
        from gamma_titan.data.tokenizer import resolve_tokenizer_path

        job = self.job_config
        titans.close()
        record = None
        if torch.distributed.get_rank() == 0:
            record = model_record(job.model.name, job.model.flavor, self.model_args,
                                  resolve_tokenizer_path(job.model.hf_assets_path))
        return GammaCheckpointManager(
            model_record=record, device=self.device, save_timeouts=self._save_timeouts(),
            dataloader=self.dataloader, model_parts=self.model_parts,
            optimizers=self.optimizers, lr_schedulers=self.lr_schedulers, states={"train_state": self},
            checkpoint_config=job.checkpoint, sd_adapter=getattr(titans, "sd_adapter", None),
            base_folder=job.job.dump_folder,
        )

    def _save_timeouts(self) -> SaveTimeouts:
        """The timeouts a save runs under (launch.save_timeout_seconds), set on every group
        TorchTitan sets its own on (its set_pg_timeouts, without the barrier: every rank is in
        the save together, and leaves it together)."""
        from gamma_titan.training.launch import save_timeout_seconds

        job, dims = self.job_config, self.parallel_dims
        params = sum(p.numel() for part in self.model_parts for p in part.parameters())  # a DTensor's: its whole
        local = int(os.environ.get("LOCAL_WORLD_SIZE", dims.world_size))
        groups = [mesh.get_group() for mesh in dims.get_all_one_dimensional_meshes().values()] + [None]

        def set_timeouts(seconds: float) -> None:
            for group in groups:  # TorchTitan's own means of setting a group's timeout (set_pg_timeouts)
                torch.distributed.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)

        save = save_timeout_seconds(params, max(1, dims.world_size // local), job.gamma.reliability.stop_grace_seconds,
                                    job.comm.init_timeout_seconds)
        return SaveTimeouts(set=set_timeouts, save=save, init=job.comm.init_timeout_seconds,
                            train=job.comm.train_timeout_seconds)

    # --- one step ------------------------------------------------------------------------------

    def train_step(self, data_iterator):
        try:
            self._train_step(data_iterator)
        except DataloaderExhaustedError:
            finished = self.step - 1  # self.step is the step that found no data
            if finished > 0 and finished % self.job_config.checkpoint.interval:  # else saved already
                self.checkpointer.save(finished, last_step=True)
            raise
        if self.diagnostics is not None and diagnostics_due(self.job_config.gamma.diagnostics, self.step):
            metrics, maps = self.diagnostics.measure(self.step, with_images=self.metrics_processor.has_image_logger)
            self.metrics_processor.log_diagnostics(self.step, metrics, maps)

    def _train_step(self, data_iterator) -> None:
        """TorchTitan's step, with the update applied only when the step's verdict allows."""
        self.optimizers.zero_grad()
        lr = self.lr_schedulers.schedulers[0].get_last_lr()[0]
        dims = self.parallel_dims
        microbatches = [next(data_iterator) for _ in range(self.gradient_accumulation_steps)]
        # TorchTitan's batch_generator counted this rank's tokens; the other ranks read as many.
        self.ntokens_seen += sum(labels.numel() for _, labels in microbatches) * (self._data_parallel_degree() - 1)
        local_tokens = sum((labels != IGNORE_INDEX).sum() for _, labels in microbatches).to(self.device)
        if dims.dp_enabled:
            global_tokens = dist_utils.dist_sum(local_tokens, dims.get_mesh("batch"))
        else:
            global_tokens = local_tokens.float()
        if dims.pp_enabled:  # see MoELayer.aux_grad_scale
            for part in self.model_parts:
                set_aux_grad_scale(part, global_tokens)
        losses = []
        for i, (input_dict, labels) in enumerate(microbatches):
            self._sync_ddp_gradients(last=i == len(microbatches) - 1)
            self._all_reduce_replicas(last=i == len(microbatches) - 1)
            input_dict = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()}
            for ledger in self.routing:
                ledger.start()
            losses.append(self.forward_backward_step(input_dict=input_dict, labels=labels.to(self.device),
                                                     global_valid_tokens=global_tokens).detach())
            for ledger in self.routing:
                ledger.settle(self._pipeline_micro_batches())
        if dims.pp_enabled:
            # TorchTitan's pipeline schedule back-propagates each microbatch's loss *sum*
            # (scale_grads=False): divide by the global token count, so the gradient is the
            # mean's, as without pipeline parallelism (and clipping sees the same norm).
            # One fused kernel, and no host read of the count where it is a device tensor
            # (no data parallelism).
            grads = [g.to_local() if isinstance(g, DTensor) else g
                     for g in (p.grad for m in self.model_parts for p in m.parameters()) if g is not None]
            if grads:
                torch._foreach_div_(grads, global_tokens)
        grad_norm = dist_utils.clip_grad_norm_(
            [p for m in self.model_parts for p in m.parameters()], self.job_config.training.max_norm,
            foreach=True, pp_mesh=dims.get_optional_mesh("pp"), ep_enabled=dims.ep_enabled)
        self.checkpointer.maybe_wait_for_staging()
        loss = torch.stack(losses).sum()  # this rank's share of the global mean loss
        verdict = self._verdict(loss, grad_norm)
        if self._apply(verdict):
            self.optimizers.step()
            self.lr_schedulers.step()
        if self.metrics_processor.should_log(self.step):
            self._log(verdict, loss, global_tokens, local_tokens, lr)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        """TorchTitan's; on a pipeline stage before the last, its placeholder loss is made on
        the device (TorchTitan's `torch.tensor([-1.0], device=...)` copies from pageable
        host memory: a wait for the queue to drain, every step, on a GPU)."""
        if not self.parallel_dims.pp_enabled or self.pp_has_last_stage:
            return super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels)
        with self.train_context():
            if self.pp_has_first_stage:
                self.pp_schedule.step(inputs, **extra_inputs, **extra_kwargs, target=None, losses=None,
                                      return_outputs=False)
            else:
                self.pp_schedule.step(**extra_kwargs, target=None, losses=None, return_outputs=False)
        return torch.full((1,), -1.0, device=self.device)  # no loss on this stage (TorchTitan's -1)

    def _sync_ddp_gradients(self, last: bool) -> None:
        """Under DDP (replicas without shards) gradients are summed over the replicas once a
        step, in the last micro-batch's backward: the earlier ones accumulate locally. (DDP
        reducing every micro-batch would add the already-summed gradient in again, since
        the reduction sums: models/common/parallelize.sum_ddp_gradients.)"""
        for part in self.model_parts:
            if replicate.state(part) is not None:
                part.set_requires_gradient_sync(last)

    def _all_reduce_replicas(self, last: bool) -> None:
        """Under HSDP (FSDP inside a node, replicas across nodes) the replicas' gradients cross
        the network once a step, in the last micro-batch's backward: FSDP2 all-reduces every
        backward by default, so each earlier micro-batch keeps its reduce-scattered gradient
        instead (one sharded buffer, added in before the last all-reduce). Counted on 4 gloo
        ranks, replicate 2 x shard 2, 4 micro-batches: 15 all-reduces a step before, 6 after
        (3 FSDP groups, and the step's own 3)."""
        if not (self.parallel_dims.dp_replicate_enabled and self.parallel_dims.fsdp_enabled):
            return
        for part in self.model_parts:
            for module in part.modules():  # every FSDP group: the experts' own under EP too
                if isinstance(module, FSDPModule):
                    module.set_requires_all_reduce(last, recurse=False)

    def _verdict(self, loss: torch.Tensor, grad_norm: torch.Tensor):
        """What every rank must agree on, in one collective and one host sync
        (step_guard.step_verdict); a SIGTERM on any rank stops every rank after this step."""
        tp = self.parallel_dims.get_optional_mesh("tp")
        # One rank per loss: the first of its TP peers, on the last pipeline stage (the
        # other stages hold TorchTitan's placeholder -1).
        counts = (tp is None or tp.get_local_rank() == 0) and (not self.parallel_dims.pp_enabled
                                                              or self.pp_has_last_stage)
        verdict = step_verdict(loss, grad_norm, self.graceful_stop.requested, counts_loss=counts)
        if verdict.stop and not self.stopping:
            self.stopping = self.checkpointer.stopping = True
            got = self.graceful_stop.signal  # None where another rank got the signal
            reason = signal.Signals(got).name if got is not None else "a stop signal on another rank"
            self.checkpointer.stop_reason = reason
            logging.getLogger().addFilter(_not_completed)  # main.py says where the run stopped instead
            if not self.job_config.checkpoint.enable:
                logger.warning(f"{reason} with checkpoint.enable = false: stopping without a checkpoint")
        return verdict

    def _apply(self, verdict) -> bool:
        """The guard's decision on the update (or NonFiniteError), and the step's events."""
        apply = self.guard.check(self.step, verdict.grad_norm, verdict.loss)
        events = {}
        if not apply:
            events["nonfinite_skipped"] = {"loss": verdict.loss, "grad_norm": verdict.grad_norm,
                                           "skipped_so_far": self.guard.skipped}
        mean = self.guard.spikes.observe(verdict.loss)
        if mean is not None:
            events["loss_spike"] = self._spike_record(verdict.loss, mean)
            logger.warning(f"step {self.step}: loss spike {verdict.loss:.4f} vs running mean {mean:.4f} "
                           f"(global batch {self.step - 1})")
        if events:
            self.metrics_processor.add_event(self.step, events)
        return apply

    def _spike_record(self, loss: float, mean: float) -> dict:
        """The spike and where its data came from: the step's global batch, i.e. sequences
        [P - G, P) of the training order (G sequences per step, P the loader's position after
        the step: (step-1)·G to step·G unless a resume changed G), which `gamma_titan.data`
        reproduces from the data config alone."""
        per_step = self._global_batch_size()
        end = self.dataloader.position() if hasattr(self.dataloader, "position") else self.step * per_step
        return {"loss": loss, "running_mean": mean, "global_batch": self.step - 1, "sequences": [end - per_step, end]}

    def _global_batch_size(self) -> int:
        """Sequences per optimizer step (TorchTitan's Trainer derived the accumulation steps
        from it)."""
        return self.gradient_accumulation_steps * self.job_config.training.local_batch_size \
            * self._data_parallel_degree()

    def _pipeline_micro_batches(self) -> int:
        """The micro-batches a pipeline schedule splits each local batch into (1 without PP)."""
        if not self.parallel_dims.pp_enabled:
            return 1
        return self.job_config.training.local_batch_size // self.job_config.parallelism.pipeline_parallel_microbatch_size

    def _data_parallel_degree(self) -> int:
        """The ranks a global batch is split over (its loss is averaged over them)."""
        return self.parallel_dims.dp_replicate * self.parallel_dims.dp_shard

    def _log(self, verdict, loss: torch.Tensor, global_tokens: torch.Tensor, local_tokens: torch.Tensor,
             lr: float) -> None:
        """TorchTitan's metrics line: the global mean loss (the verdict's), the largest
        per-rank mean loss, tokens seen, the gradient norm and the learning rate."""
        max_loss = largest_rank_loss(loss, global_tokens, local_tokens, self.parallel_dims) \
            if self.parallel_dims.dp_cp_enabled else verdict.loss
        self.metrics_processor.log(self.step, verdict.loss, max_loss, verdict.grad_norm,
                                   extra_metrics={"n_tokens_seen": self.ntokens_seen, "lr": lr})

    # --- the checkpoint's train_state --------------------------------------------------------

    def state_dict(self) -> dict:
        """The step, the tokens the whole run has seen (every rank holds the same number, so
        any data-parallel degree resumes it), and the layout the step's batch had: what a
        resume at another degree or global batch is checked against (preflight.resume_notes)."""
        if self.legacy_train_state:
            return super().state_dict()
        return {"step": self.step, "tokens_seen": self.ntokens_seen, "global_batch_size": self._global_batch_size(),
                "data_parallel_degree": self._data_parallel_degree()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.step = state_dict["step"]
        self.metrics_processor.resumed_at(self.step)
        if "tokens_seen" in state_dict:
            self.ntokens_seen = state_dict["tokens_seen"]
        else:  # TorchTitan's: this rank's tokens, as many as each of the saving run's ranks read
            self.ntokens_seen = state_dict["ntokens_seen"] * self.legacy_train_state

    def read_form(self, keys: set[str]) -> None:
        """Present the form of the checkpoint about to be loaded (its DCP keys): TorchTitan's
        train_state when it holds no global token count, whose per-rank count is scaled by
        the saving run's data-parallel degree (its dataloader entries, one per rank)."""
        legacy = "train_state.ntokens_seen" in keys and "train_state.tokens_seen" not in keys
        ranks = {k.split(".")[1] for k in keys if k.startswith("dataloader.dp_rank_")}
        self.legacy_train_state = max(1, len(ranks)) if legacy else 0

    # --- the loop ------------------------------------------------------------------------------

    def should_continue_training(self) -> bool:
        return not self.stopping and super().should_continue_training()

    def close(self) -> None:
        super().close()
        logging.getLogger().removeFilter(_not_completed)
        if hasattr(self, "graceful_stop"):
            self.graceful_stop.uninstall()


def _not_completed(record: logging.LogRecord) -> bool:
    """TorchTitan's Trainer says "Training completed" whenever its loop ends; after a stop it
    did not complete."""
    return record.getMessage() != "Training completed"
