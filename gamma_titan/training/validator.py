"""The validation loop: TorchTitan's Validator with our data and the sums done over the
ranks that hold each part of the loss.

TorchTitan's `Validator.__init__` builds its dataloader inline (TorchTitan's text loader),
with no builder to hand in. `GammaValidator` is the seam: it sets the attributes that
constructor sets (a test compares them with TorchTitan's source), with the dataloader from
`gamma_titan/data/loader.py`: the run's validation set (data/validation_set.py), this
rank's share of it, the same sequences at any layout.

Its `validate` replaces TorchTitan 0.2.2's, which counts the valid tokens after the
sequence has been split over the context-parallel ranks and then sums the loss over data
x context ranks: CP 2 reported twice the loss. Here, per source: the loss sums of every
batch (a sequence's chunks on its CP ranks; a pipeline's last stage) are added over the
data, context and pipeline ranks (tensor-parallel ranks hold copies), the valid tokens are
counted before the split and added over the data ranks, and the loss is their quotient.
A mixture's sources each get `validation_metrics/loss/<source>` (`val_loss/<source>` in
metrics.jsonl); their token-weighted mean is the total. The model's buffers are put back
afterwards (diagnostics/buffers.py): MoE load counters count validation forwards too.

Under a pipeline whose order torch runs as a list of actions (the looped and V-shaped
schedules), `eval()` still walks the training order's backward actions; the V-shaped
ZBVZeroBubble then fails ("can't steal_bwd_input if this stage doesn't have backward",
torch 2.13). Validation runs that order's forward actions only (`forward_only`).
"""

from __future__ import annotations

import contextlib

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import BaseValidator, Validator
from torchtitan.distributed.context_parallel import prepare_context_parallel_input
from torchtitan.tools import utils
from torch.distributed.pipelining.schedules import FORWARD, OVERLAP_F_B, _ComputationType, _PipelineScheduleRuntime
from torchtitan.tools.logging import logger

from gamma_titan.data.loader import build_validation_dataloader
from gamma_titan.diagnostics.buffers import buffers_restored
from gamma_titan.training.metrics import SOURCE_LOSS_PREFIX


class GammaValidator(Validator):
    def __init__(self, job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                 validation_context, maybe_enable_amp, metrics_processor, pp_schedule=None,
                 pp_has_first_stage: bool | None = None, pp_has_last_stage: bool | None = None):
        BaseValidator.__init__(self, job_config)  # not Validator's: it would build TorchTitan's loader
        self.tokenizer = tokenizer
        self.parallel_dims = parallel_dims
        self.loss_fn = loss_fn
        self.validation_dataloader = build_validation_dataloader(
            dp_world_size, dp_rank, tokenizer, job_config, infinite=job_config.validation.steps != -1)
        self.validation_context = validation_context
        self.maybe_enable_amp = maybe_enable_amp
        self.metrics_processor = metrics_processor
        self.pp_schedule = pp_schedule
        self.pp_has_first_stage = pp_has_first_stage
        self.pp_has_last_stage = pp_has_last_stage
        if self._validation_set is None and job_config.validation.steps == -1:
            logger.warning("validation.steps = -1: every rank reads to the end of its share of the split; "
                           "uneven shares would hang (TorchTitan's warning)")

    @property
    def _validation_set(self):
        """The run's validation set (None: TorchTitan's text loader reads the data)."""
        return getattr(self.validation_dataloader.dataset, "set", None)

    @property
    def source_names(self) -> list[str]:
        held = self._validation_set
        return held.source_names if held is not None else [self.job_config.validation.dataset]

    def post_dataloading_process(self, input_dict, labels, model_parts):
        """TorchTitan's, asking the model for attention masks only where its attention takes
        them (`args.takes_attention_masks()`: flex, varlen), as TorchTitan's Trainer decides. TorchTitan 0.2.2's validator asks
        every model, and deepseek_v3 and llama3 build a flex block mask whatever their
        attention: torch.compile'd `create_block_mask` at every validation step, for an SDPA
        model that ignores it (with torch's CUDA build on a host without a GPU driver, the
        compile fails: "Found no NVIDIA driver")."""
        takes_masks = getattr(getattr(model_parts[0], "model_args", None), "takes_attention_masks", None)
        if takes_masks is None or takes_masks():  # a model not of ours: TorchTitan's way
            return super().post_dataloading_process(input_dict, labels, model_parts)
        inputs = input_dict["input"]
        extra_inputs = {k: v for k, v in input_dict.items() if k != "input"}
        extra_kwargs = {}
        if self.parallel_dims.cp_enabled:
            inputs, labels, extra_kwargs = prepare_context_parallel_input(
                inputs, labels, extra_kwargs, self.parallel_dims.get_mesh("cp"), inputs.device,
                self.job_config.parallelism.context_parallel_load_balancer)
        return inputs, labels, extra_inputs, extra_kwargs

    @torch.no_grad()
    def validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        # MoE load counters (the expert bias's next step) see the validation forwards too:
        # taken back, so that validating leaves training as it was
        with buffers_restored(*model_parts):
            self._validate(model_parts, step)

    def _validate(self, model_parts: list[torch.nn.Module], step: int) -> None:
        for model in model_parts:
            model.eval()
        device = utils.device_type
        sums = torch.zeros(len(self.source_names), dtype=torch.float64, device=device)
        tokens = torch.zeros_like(sums)
        steps = self.job_config.validation.steps
        for batch, (input_dict, labels) in enumerate(self.validation_dataloader):
            if "source" not in input_dict and steps != -1 and batch >= steps:  # TorchTitan's own loader
                break
            source = int(input_dict.pop("source", 0))
            self.metrics_processor.ntokens_since_last_log += labels.numel()
            input_dict = {k: v.to(device) for k, v in input_dict.items()}
            labels = labels.to(device)
            tokens[source] += (labels != IGNORE_INDEX).sum()  # whole sequences: before CP splits them
            inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels,
                                                                                      model_parts)
            sums[source] += self._loss_sum(inputs, labels, extra_inputs, extra_kwargs, model_parts)
        dims = self.parallel_dims
        if dims.dp_cp_enabled:  # the set is split over the data ranks, a sequence over its CP ranks
            torch.distributed.all_reduce(sums, group=dims.get_mesh("loss").get_group())
        if dims.pp_enabled:  # the last stage holds the sums, the others zeros
            torch.distributed.all_reduce(sums, group=dims.get_mesh("pp").get_group())
        if dims.dp_enabled:
            torch.distributed.all_reduce(tokens, group=dims.get_mesh("batch").get_group())
        total = (sums.sum() / tokens.sum()).item()
        per_source = {}
        if len(self.source_names) > 1:
            per_source = {f"{SOURCE_LOSS_PREFIX}{name}": (sums[i] / tokens[i]).item()
                          for i, name in enumerate(self.source_names) if tokens[i] > 0}  # none drawn: no loss
        self.metrics_processor.log_validation(loss=total, step=step, extra_metrics=per_source)
        for model in model_parts:
            model.train()

    def _loss_sum(self, inputs, labels, extra_inputs, extra_kwargs, model_parts) -> torch.Tensor:
        """The summed loss of this rank's part of the batch (TorchTitan's loss_fn sums), as a
        plain tensor; 0 on a pipeline stage other than the last."""
        if self.parallel_dims.pp_enabled:
            targets, losses = (labels, []) if self.pp_has_last_stage else (None, None)
            with self.validation_context(), forward_only(self.pp_schedule):
                if self.pp_has_first_stage:
                    self.pp_schedule.eval(inputs, **extra_inputs, **extra_kwargs, target=targets, losses=losses)
                else:
                    self.pp_schedule.eval(**extra_kwargs, target=targets, losses=losses)
            if not self.pp_has_last_stage:
                return torch.zeros((), dtype=torch.float64, device=utils.device_type)
            loss = torch.sum(torch.stack(losses))
        else:
            with self.validation_context(), self.maybe_enable_amp:
                loss = self.loss_fn(model_parts[0](inputs, **extra_inputs, **extra_kwargs), labels)
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # a tensor-parallel loss
        return loss.detach().to(torch.float64).reshape(())


#: The actions of a pipeline order that a forward pass needs (FSDP's unshard/reshard included;
#: from torch 2.15 each send has a wait action of its own, checked at the schedule's end).
FORWARD_ACTIONS = tuple(getattr(_ComputationType, name) for name in
                        ("FORWARD", "SEND_F", "RECV_F", "WAIT_SEND_F", "UNSHARD", "RESHARD")
                        if hasattr(_ComputationType, name))


def forward_actions(order: list) -> list:
    """The forward subsequence of one rank's pipeline order: backward computations, their
    sends and receives and the gradient reductions dropped; DualPipeV's overlapped
    forward-backward reduced to its forward."""
    kept = []
    for action in order:
        if action.computation_type == OVERLAP_F_B:
            kept += [a for a in action.sub_actions if a.computation_type == FORWARD]
        elif action.computation_type in FORWARD_ACTIONS:
            kept.append(action)
    return kept


@contextlib.contextmanager
def forward_only(schedule):
    """Run `schedule` (an action-list schedule) on the forward actions of its order; other
    schedules are forward-only in eval() already."""
    if not isinstance(schedule, _PipelineScheduleRuntime):
        yield
        return
    training = schedule.pipeline_order_with_comms
    schedule.pipeline_order_with_comms = {rank: forward_actions(order) for rank, order in training.items()}
    try:
        yield
    finally:
        schedule.pipeline_order_with_comms = training


def build_validator(job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                    validation_context, maybe_enable_amp, metrics_processor=None, pp_schedule=None,
                    pp_has_first_stage: bool | None = None, pp_has_last_stage: bool | None = None) -> GammaValidator:
    """TrainSpec.build_validator_fn, with TorchTitan's `build_validator`'s signature."""
    return GammaValidator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                          validation_context, maybe_enable_amp, metrics_processor, pp_schedule,
                          pp_has_first_stage, pp_has_last_stage)
