"""The one exception type for bad user input.

A `ConfigError` carries a single line that names the offending key (or file) and what is
allowed. Entry points print it as `error: <message>` and exit non-zero, before any process
group starts and before anything is written under `job.dump_folder`.
"""


class ConfigError(ValueError):
    """Bad input from a TOML file, a CLI override or a path the config names."""
