"""The TOML surface gamma_titan adds to TorchTitan's JobConfig, and its validation.

TorchTitan merges these dataclasses into its own JobConfig (`job.custom_config_module =
"gamma_titan.config"`), so each key works in TOML and as a CLI override:

    [gamma]                       --gamma.init_rate 0.5
    [gamma.init_rate_overrides]   --gamma.init_rate_overrides.output 0.5
    [model_args]                  --model_args.dim 256

`load_job_config` parses a command line the way TorchTitan does, but first checks every
key and value it can without starting anything, so bad input ends in one `ConfigError`
line that names the key.

Modules: `schema` (the tables), `checks` (their values), `titan_keys` (TorchTitan's own
keys), `flags` (our command line's value types), `parse` (`load_job_config`). The names
below are imported on first use, so that `flags` (the CLI's) costs no import of torch.
"""

import importlib

_EXPORTS = {
    "check_gamma": "checks",
    "CONFIG_MODULE": "parse", "load_job_config": "parse",
    "Data": "schema", "Diagnostics": "schema", "Gamma": "schema", "InitRateOverrides": "schema",
    "JobConfig": "schema", "ModelArgsOverrides": "schema", "Reliability": "schema",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
