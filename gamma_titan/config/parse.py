"""`load_job_config`: a TorchTitan command line (TOML + overrides) parsed into the merged
JobConfig, with every key and value checked first, so that bad input ends in one
ConfigError line naming the key as the TOML spells it (`gamma.attention_gate`, not
tyro's `--gamma.attention-gate`), before anything is started or written.
"""

import contextlib
import functools
import importlib
import io
import logging
import os
import re
import sys
import typing
import warnings
from dataclasses import fields, is_dataclass

from gamma_titan.errors import ConfigError

from .checks import check_gamma, check_model_args_types
from .titan_keys import check_titan_keys

CONFIG_MODULE = "gamma_titan.config"
_TYRO_FLAG = re.compile(r"--([a-z0-9_]+(?:\.[a-z0-9_-]+)+)")  # tyro's "--gamma.attention-gate"


def _check_keys(cls, data: dict, where: str) -> None:
    """Every key of a TOML table must be a field of the dataclass it fills."""
    names = {f.name: f for f in fields(cls)}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            table = f"[{where}]" if where else "top level"
            raise ConfigError(f"unknown key {path!r} in {table}; allowed: {', '.join(sorted(names))}")
        sub = _resolve_type(cls, key)
        if is_dataclass(sub):
            if not isinstance(value, dict):
                raise ConfigError(f"{path} must be a table, got {value!r}")
            _check_keys(sub, value, path)


def _resolve_type(cls, name: str):
    return typing.get_type_hints(cls)[name]


def _read_toml(path: str) -> dict:
    import tomllib

    if not os.path.isfile(path):
        raise ConfigError(f"job.config_file: {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file: {path} is not valid TOML: {e}") from None


def _config_file(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        for key in ("--job.config_file", "--job.config-file"):
            if arg == key and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(key + "="):
                return arg.split("=", 1)[1]
    return None


def _normalise_cli(cls, argv: list[str]) -> list[str]:
    """Check that every `--section.key` override names a real key (tyro's own message
    is a page long), and accept `--flag true|false` for booleans, which tyro spells
    `--flag` / `--no-flag`."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not arg.startswith("--") or arg in ("--help", "-h"):
            out.append(arg)
            continue
        path, _, inline = arg[2:].partition("=")
        parts = path.replace("-", "_").split(".")
        node, kind = cls, None
        for depth, part in enumerate(parts):
            names = {f.name for f in fields(node)}
            last = depth == len(parts) - 1
            name = part[3:] if last and part.startswith("no_") and part[3:] in names else part
            if name not in names:
                where = ".".join(parts[:depth]) or "(top level)"
                raise ConfigError(f"unknown option --{path}; allowed under {where}: {', '.join(sorted(names))}")
            node = _resolve_type(node, name)
            if not is_dataclass(node):
                kind = node
                break
        value = inline or (argv[i] if i < len(argv) and not inline else "")
        key = ".".join(parts)
        choices = _literal_choices(kind)
        if value == "None" and choices and "none" in choices:  # "None" would unset it: the config's choice stays
            raise ConfigError(f"{key} = 'None': allowed {', '.join(map(str, choices))} (None is not none: it would "
                              "keep the config's value)")
        if value == "None" and type(None) in typing.get_args(kind):  # unset an optional key
            out.append(arg)
            continue
        if choices is not None and value not in choices:
            raise ConfigError(f"{key} = {value!r}: allowed {', '.join(map(str, choices))}")
        number = _number_type(kind)
        if number is not None and not _parses_as(number, value):
            raise ConfigError(f"{key} = {value!r}: must be {'an integer' if number is int else 'a number'}")
        if kind is bool and value.lower() in ("true", "false") and not parts[-1].startswith("no_"):
            if not inline:
                i += 1
            prefix = ".".join(parts[:-1])
            flag = parts[-1] if value.lower() == "true" else "no_" + parts[-1]
            out.append(f"--{prefix}.{flag}" if prefix else f"--{flag}")
            continue
        out.append(arg)
    return out


def check_given_once(argv: list[str]) -> None:
    """Refuse a `--section.key` typed twice on a command line: tyro keeps the last of two
    silently. (`--x.no-flag` sets x.flag; no key of the JobConfig begins with "no_".) The
    commands check what the user typed; the code that composes command lines (recipes, the
    job scripts) decides which of its own settings wins before it writes them."""
    given: dict[str, str] = {}
    for i, arg in enumerate(argv):
        if not arg.startswith("--") or "." not in arg.partition("=")[0]:
            continue
        path, eq, inline = arg[2:].partition("=")
        *section, leaf = path.replace("-", "_").split(".")
        negated = leaf.startswith("no_")
        key = ".".join([*section, leaf[3:] if negated else leaf])
        follows = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else "true"
        value = "false" if negated else inline if eq else follows
        if key in given:
            raise ConfigError(f"--{key} given twice ({given[key]}, then {value}): give it once")
        given[key] = value


def _number_type(kind) -> type | None:
    """int or float for a numeric field (also `X | None`), else None."""
    if kind in (int, float):
        return kind
    numbers = [a for a in typing.get_args(kind) if a in (int, float)]
    others = [a for a in typing.get_args(kind) if a not in (int, float, type(None))]
    return numbers[0] if len(numbers) == 1 and not others else None


def _parses_as(number: type, value: str) -> bool:
    try:
        number(value)
    except ValueError:
        return False
    return True


def _literal_choices(kind) -> tuple | None:
    """The allowed values of a `Literal` type (also inside `X | None`), else None."""
    if typing.get_origin(kind) is typing.Literal:
        return typing.get_args(kind)
    literals = [a for a in typing.get_args(kind) if typing.get_origin(a) is typing.Literal]
    return typing.get_args(literals[0]) if len(literals) == 1 else None


def _cli_config_module(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        key, _, inline = arg.partition("=")
        if key in ("--job.custom_config_module", "--job.custom-config-module"):
            return inline or (argv[i + 1] if i + 1 < len(argv) else None)
    return None


@functools.cache
def _config_manager():
    """TorchTitan's ConfigManager, merging the JobConfig with an extension once per pair.
    TorchTitan builds a new merged class on every parse, and tyro then re-reads the source
    of each new class; one merged class per (base, extension) pair makes a parse ~25%
    cheaper, and a recipe checks dozens of configs."""
    from torchtitan.config import ConfigManager

    class CachedMergeConfigManager(ConfigManager):
        _merge_configs = staticmethod(functools.cache(ConfigManager._merge_configs))

    return CachedMergeConfigManager


def load_job_config(argv: list[str]):
    """Parse a TorchTitan command line (TOML + overrides) into the merged JobConfig.

    The config module defaults to this one (`--job.custom_config_module` on the CLI or
    in [job] picks another, e.g. one that extends it). Raises ConfigError for unknown
    keys and for values a key cannot mean ([gamma]'s, and TorchTitan's own: titan_keys.py).
    Nothing is started or written.
    """
    from torchtitan.config.job_config import JobConfig as TitanJobConfig

    argv = list(argv)
    path = _config_file(argv)
    toml = _read_toml(path) if path is not None else {}
    module = _cli_config_module(argv) or toml.get("job", {}).get("custom_config_module")
    if not module:
        module = CONFIG_MODULE
        argv += ["--job.custom_config_module", module]
    try:
        extension = importlib.import_module(module).JobConfig
    except (ImportError, AttributeError):
        raise ConfigError(f"job.custom_config_module = {module!r}: not a module with a JobConfig") from None
    merged = _config_manager()._merge_configs(TitanJobConfig, extension)
    _check_keys(merged, toml, "")
    config = _parse_quietly(_normalise_cli(merged, argv))  # TorchTitan takes TOML values as they are

    check_gamma(config.gamma)
    check_model_args_types(config.model_args)
    check_titan_keys(config)
    return config


def _parse_quietly(argv: list[str]):
    """TorchTitan's ConfigManager, with tyro's multi-line error boxes turned into one
    ConfigError line and its warnings (and TorchTitan's note that hf_assets_path
    "builtin" is not a folder) kept off stderr."""
    captured = io.StringIO()
    try:
        with titan_warnings_held(), warnings.catch_warnings(), contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            return _config_manager()().parse_args(argv)
    except SystemExit as e:
        if not e.code:  # --help
            sys.stderr.write(captured.getvalue())
            raise
        raise ConfigError(_first_box_text(captured.getvalue())) from None
    except (ValueError, AssertionError) as e:  # TorchTitan's own checks (some are asserts)
        raise ConfigError(str(e).splitlines()[0] if str(e) else f"invalid config ({type(e).__name__})") from None


@contextlib.contextmanager
def titan_warnings_held():
    """TorchTitan logs on the root logger. While a config is checked (parsed here; its model
    args resolved by pre-flight and inspect) its warnings are held back: the trainer parses and
    resolves again and logs them in its own log, and printed here, before any logging is set
    up, they would stand above a refusal's one line ("Failed to use grouped mm" on any machine
    without SM90). Errors still pass."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        yield
    finally:
        root.setLevel(level)


def _first_box_text(text: str) -> str:
    """tyro's error box, in its Unicode or plain-text drawing, as one line:
    'Value error: Error parsing gamma.init_rate: could not convert ...'. The first
    section is the error; the help text below its first ruler is left out."""
    title, body = "", []
    for line in text.splitlines():
        line = line.strip().strip("│|").strip()
        if not line:
            continue
        if line.startswith("╭"):
            title = line.strip("╭─╮ ")
        elif set(line) <= set("─-├┤╰╯+ "):  # a ruler ends the first section
            if body:
                break
        elif not title:
            title = line
        else:
            body.append(line)
    message = " ".join(body) or text.strip().replace("\n", " ")
    message = _TYRO_FLAG.sub(lambda m: m.group(1).replace("-", "_"), message)  # the key as the TOML spells it
    return f"{title}: {message}" if title else message
