"""The one exception type for bad user input.

A `ConfigError` carries a single line that names the offending key (or file) and what is
allowed. Entry points print it as `error: <message>` and exit non-zero, before any process
group starts and before anything is written under `job.dump_folder`.
"""


class ConfigError(ValueError):
    """Bad input from a TOML file, a CLI override or a path the config names."""


#: The trainer's exit codes beyond 0 and 1 (gamma_titan/training/main.py); the recipe
#: runner reads EXIT_NONFINITE as a run that diverged.
EXIT_BAD_INPUT = 2
EXIT_NONFINITE = 3
EXIT_DISK_FULL = 4
