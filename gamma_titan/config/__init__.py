"""The TOML surface gamma_titan adds to TorchTitan's JobConfig, and its validation.

TorchTitan merges these dataclasses into its own JobConfig (`job.custom_config_module =
"gamma_titan.config"`), so each key works in TOML and as a CLI override:

    [gamma]                       --gamma.init_rate 0.5
    [gamma.init_rate_overrides]   --gamma.init_rate_overrides.output 0.5
    [model_args]                  --model_args.dim 256

`load_job_config` parses a command line the way TorchTitan does, but first checks every
key and value it can without starting anything, so bad input ends in one `ConfigError`
line that names the key.

Modules: `schema` (the tables), `checks` (their values), `parse` (`load_job_config`).
"""

from .checks import check_gamma
from .parse import CONFIG_MODULE, load_job_config
from .schema import Data, Diagnostics, Gamma, InitRateOverrides, JobConfig, ModelArgsOverrides, Reliability

__all__ = ["CONFIG_MODULE", "Data", "Diagnostics", "Gamma", "InitRateOverrides", "JobConfig",
           "ModelArgsOverrides", "Reliability", "check_gamma", "load_job_config"]
