"""TorchTitan's Validator, reading shard datasets with the project's loader.

TorchTitan's `Validator.__init__` builds its dataloader inline (TorchTitan's text loader),
with no builder to hand in. `GammaValidator` is the seam: it sets the attributes that
constructor sets (a test compares them with TorchTitan's source), with the dataloader from
`gamma_titan/data/loader.py`, and inherits the validation loop itself (pipeline
parallelism included) unchanged.
"""

from __future__ import annotations

from torchtitan.components.validate import BaseValidator, Validator
from torchtitan.tools.logging import logger

from gamma_titan.data.loader import build_validation_dataloader


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
        if job_config.validation.steps == -1:
            logger.warning("validation.steps = -1: every rank reads to the end of its share of the split; "
                           "uneven shares would hang (TorchTitan's warning)")


def build_validator(job_config, dp_world_size: int, dp_rank: int, tokenizer, parallel_dims, loss_fn,
                    validation_context, maybe_enable_amp, metrics_processor=None, pp_schedule=None,
                    pp_has_first_stage: bool | None = None, pp_has_last_stage: bool | None = None) -> GammaValidator:
    """TrainSpec.build_validator_fn, with TorchTitan's `build_validator`'s signature."""
    return GammaValidator(job_config, dp_world_size, dp_rank, tokenizer, parallel_dims, loss_fn,
                          validation_context, maybe_enable_amp, metrics_processor, pp_schedule,
                          pp_has_first_stage, pp_has_last_stage)
