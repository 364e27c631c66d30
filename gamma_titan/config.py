"""The TOML surface gamma_titan adds to TorchTitan's JobConfig, and its validation.

TorchTitan merges these dataclasses into its own JobConfig (`job.custom_config_module =
"gamma_titan.config"`), so each key works in TOML and as a CLI override:

    [gamma]                       --gamma.init_rate 0.5
    [gamma.init_rate_overrides]   --gamma.init_rate_overrides.output 0.5
    [model_args]                  --model_args.dim 256

`load_job_config` parses a command line the way TorchTitan does, but first checks every
key and value it can without starting anything, so bad input ends in one `ConfigError`
line that names the key.
"""

import contextlib
import functools
import importlib
import io
import logging
import math
import os
import sys
import typing
import warnings
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Literal

from gamma_titan.errors import ConfigError
from gamma_titan.init import GROUPS, GammaInit
from gamma_titan.models.common import ATTENTION_GATES

CONFIG_MODULE = "gamma_titan.config"
MAX_INIT_RATE = 4.0
FLOAT8_LINEAR = "quantize.linear.float8"  # TorchTitan's model.converters name for float8 linears


@dataclass
class InitRateOverrides:
    """γ for one parameter group, for ablations; unset groups use gamma.init_rate."""

    embedding: float | None = None
    attention: float | None = None
    gate: float | None = None
    ffn: float | None = None
    router: float | None = None
    output: float | None = None


@dataclass
class Diagnostics:
    """The paper's instruments, logged live as gamma/* (see gamma_titan/diagnostics)."""

    enable: bool = False
    """Measure at step 1 and every `freq` steps; false switches all of it off."""
    freq: int = 100
    """Steps between measurements (row-cosine maps: every 10 x freq)."""
    probe_batch: int = 4
    """Sequences in the fixed probe batch (the first of the validation dataset)."""
    cosine_rows: int = 256
    """Rows of each matrix in a row-cosine map (the first ones)."""
    cosine_params: list[str] = field(default_factory=list)
    """Weights to draw row-cosine maps of; empty = wo and the first FFN w1 of the first and last block."""


@dataclass
class Data:
    """How the shard datasets ("builtin", "memmap") are read (see gamma_titan/data/memmap.py)."""

    mixture: dict[str, float] = field(default_factory=dict)
    """Weights over the shard folders in dataset_path, e.g. { web = 0.7, code = 0.3 }; empty = one folder."""
    shuffle: bool = True
    """Training sequences in a fresh seeded order each epoch; false reads them in stream order."""
    seed: int = 0
    """Seed of that order (source i of a mixture uses seed + i)."""
    on_exhausted: Literal["wrap", "stop"] = "wrap"
    """At the end of the data: start a new epoch (logged), or stop training cleanly."""


@dataclass
class Reliability:
    """What a long run does about bad steps and preemption (see gamma_titan/reliability.py)."""

    on_nonfinite: Literal["skip", "stop"] = "skip"
    """A NaN/Inf loss or gradient norm: skip the step (no update, logged) or stop the run, naming the step."""
    max_skipped_steps: int = 10
    """Skipped steps one run may accumulate before it stops anyway."""
    loss_spike_factor: float = 1.5
    """Log a step (with its data position) whose loss exceeds this many times the running mean; 0 = off."""
    loss_spike_window: int = 50
    """Steps in that running mean (no spike is logged before the window is full)."""
    stop_grace_seconds: float = 300.0
    """After SIGTERM: checkpoint the current step and exit 0; exit 143 if that takes longer than this."""


@dataclass
class Gamma:
    init_rate: float = 1.0
    """γ: every weight matrix W ~ N(0, d_in^(-2γ)). 0.5 = standard scale, 1 = the paper's balance point."""
    norm_eps: float = 1e-12
    """ε of every RMSNorm in the model. Must sit far below d^(-2γ), the hidden variance at init."""
    attention_gate: Literal["none", "headwise", "elementwise"] = "elementwise"
    """Sigmoid gate on each head's attention output: none, one per head, or one per channel."""
    init_truncation: float = 0.0
    """Truncate the init normal at ± this many σ; 0 draws a plain normal, as in the paper."""
    init_rate_overrides: InitRateOverrides = field(default_factory=InitRateOverrides)
    diagnostics: Diagnostics = field(default_factory=Diagnostics)
    data: Data = field(default_factory=Data)
    reliability: Reliability = field(default_factory=Reliability)


@dataclass
class ModelArgsOverrides:
    """Any field of the chosen flavor; unset fields keep the flavor's value."""

    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden_dim: int | None = None
    vocab_size: int | None = None
    rope_theta: float | None = None
    max_seq_len: int | None = None
    # gamma_moe
    attention: str | None = None
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    n_dense_layers: int | None = None
    moe_hidden_dim: int | None = None
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    top_k: int | None = None
    score_func: str | None = None
    route_norm: bool | None = None
    route_scale: float | None = None
    load_balance_coeff: float | None = None
    aux_loss_coeff: float | None = None


@dataclass
class JobConfig:
    gamma: Gamma = field(default_factory=Gamma)
    model_args: ModelArgsOverrides = field(default_factory=ModelArgsOverrides)


# --- checks on the gamma_titan sections ------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_init_rate(key: str, value: Any) -> None:
    if not _is_number(value) or not 0 < value <= MAX_INIT_RATE:
        raise ConfigError(f"{key} = {value!r}: must be a number in (0, {MAX_INIT_RATE:g}]")


def check_gamma(gamma: Gamma) -> None:
    _check_init_rate("gamma.init_rate", gamma.init_rate)
    if not _is_number(gamma.norm_eps) or gamma.norm_eps <= 0:
        raise ConfigError(f"gamma.norm_eps = {gamma.norm_eps!r}: must be a number > 0")
    if gamma.attention_gate not in ATTENTION_GATES:
        raise ConfigError(
            f"gamma.attention_gate = {gamma.attention_gate!r}: allowed {', '.join(ATTENTION_GATES)}"
        )
    if not _is_number(gamma.init_truncation) or gamma.init_truncation < 0:
        raise ConfigError(
            f"gamma.init_truncation = {gamma.init_truncation!r}: must be >= 0 (0 = no truncation)"
        )
    for group in GROUPS:
        value = getattr(gamma.init_rate_overrides, group)
        if value is not None:
            _check_init_rate(f"gamma.init_rate_overrides.{group}", value)
    _check_diagnostics(gamma.diagnostics)
    _check_data(gamma.data)
    _check_reliability(gamma.reliability)


def _check_reliability(r: Reliability) -> None:
    if r.on_nonfinite not in ("skip", "stop"):
        raise ConfigError(f"gamma.reliability.on_nonfinite = {r.on_nonfinite!r}: allowed skip, stop")
    for key, low in (("max_skipped_steps", 0), ("loss_spike_window", 2)):
        value = getattr(r, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"gamma.reliability.{key} = {value!r}: must be an integer >= {low}")
    if not _is_number(r.loss_spike_factor) or (r.loss_spike_factor != 0 and r.loss_spike_factor <= 1):
        raise ConfigError(f"gamma.reliability.loss_spike_factor = {r.loss_spike_factor!r}: must be > 1 (0 = off)")
    if not _is_number(r.stop_grace_seconds) or r.stop_grace_seconds <= 0:
        raise ConfigError(f"gamma.reliability.stop_grace_seconds = {r.stop_grace_seconds!r}: must be a number > 0")


def _check_data(d: Data) -> None:
    from gamma_titan.data.packed import ON_EXHAUSTED

    if not isinstance(d.mixture, dict):
        raise ConfigError(f"gamma.data.mixture = {d.mixture!r}: must be a table of folder = weight")
    for name, weight in d.mixture.items():
        if not _is_number(weight) or weight < 0:
            raise ConfigError(f"gamma.data.mixture.{name} = {weight!r}: a weight must be a number >= 0")
    if d.mixture and not sum(d.mixture.values()) > 0:
        raise ConfigError("gamma.data.mixture: the weights sum to 0; they must sum to a positive number")
    if not isinstance(d.shuffle, bool):
        raise ConfigError(f"gamma.data.shuffle = {d.shuffle!r}: must be true or false")
    if not isinstance(d.seed, int) or isinstance(d.seed, bool) or d.seed < 0:
        raise ConfigError(f"gamma.data.seed = {d.seed!r}: must be an integer >= 0")
    if d.on_exhausted not in ON_EXHAUSTED:
        raise ConfigError(f"gamma.data.on_exhausted = {d.on_exhausted!r}: allowed {', '.join(ON_EXHAUSTED)}")


def _check_diagnostics(d: Diagnostics) -> None:
    if not isinstance(d.enable, bool):
        raise ConfigError(f"gamma.diagnostics.enable = {d.enable!r}: must be true or false")
    for key, low in (("freq", 1), ("probe_batch", 1), ("cosine_rows", 2)):
        value = getattr(d, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ConfigError(f"gamma.diagnostics.{key} = {value!r}: must be an integer >= {low}")
    if not isinstance(d.cosine_params, list) or not all(isinstance(n, str) for n in d.cosine_params):
        raise ConfigError(f"gamma.diagnostics.cosine_params = {d.cosine_params!r}: must be a list of weight names")


def apply_to_model_args(args, job_config) -> None:
    """Write [model_args] and [gamma] into a flavor's args, then check the shape.

    Called from the args' `update_from_config`, i.e. by TorchTitan's Trainer, and by the
    pre-flight checks, so both see the same model.
    """
    check_gamma(job_config.gamma)
    allowed = {f.name for f in fields(args)}
    for f in fields(ModelArgsOverrides):
        value = getattr(job_config.model_args, f.name)
        if value is None:
            continue
        if f.name not in allowed:
            raise ConfigError(f"model_args.{f.name} does not apply to model {job_config.model.name}")
        setattr(args, f.name, value)

    gamma = job_config.gamma
    args.norm_eps = float(gamma.norm_eps)
    args.attention_gate = gamma.attention_gate
    overrides = {g: float(v) for g in GROUPS if (v := getattr(gamma.init_rate_overrides, g)) is not None}
    args.init = GammaInit(
        rate=float(gamma.init_rate),
        rate_overrides=overrides,
        truncation=float(gamma.init_truncation),
        seed=job_config.debug.seed,
    )
    seq_lens = [job_config.training.seq_len]
    if job_config.validation.enable:
        seq_lens.append(job_config.validation.seq_len)
    args.max_seq_len = max(args.max_seq_len, *seq_lens)
    args.check()


# --- parsing ---------------------------------------------------------------------------


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
        if kind is bool and value.lower() in ("true", "false") and not parts[-1].startswith("no_"):
            if not inline:
                i += 1
            prefix = ".".join(parts[:-1])
            flag = parts[-1] if value.lower() == "true" else "no_" + parts[-1]
            out.append(f"--{prefix}.{flag}" if prefix else f"--{flag}")
            continue
        out.append(arg)
    return out


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
    keys and bad [gamma] values. Nothing is started or written.
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
    if "gamma" in toml:  # check values before tyro sees (and warns about) them
        raw = dict(toml["gamma"])
        overrides = InitRateOverrides(**raw.pop("init_rate_overrides", {}))
        diagnostics = Diagnostics(**raw.pop("diagnostics", {}))
        data = Data(**raw.pop("data", {}))
        reliability = Reliability(**raw.pop("reliability", {}))
        check_gamma(Gamma(**raw, init_rate_overrides=overrides, diagnostics=diagnostics, data=data,
                          reliability=reliability))
    config = _parse_quietly(_normalise_cli(merged, argv))
    check_gamma(config.gamma)
    return config


def _parse_quietly(argv: list[str]):
    """TorchTitan's ConfigManager, with tyro's multi-line error boxes turned into one
    ConfigError line and its warnings (and TorchTitan's note that hf_assets_path
    "builtin" is not a folder) kept off stderr."""
    root = logging.getLogger()
    level = root.level
    captured = io.StringIO()
    root.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(captured):
            warnings.simplefilter("ignore")
            return _config_manager()().parse_args(argv)
    except SystemExit as e:
        if not e.code:  # --help
            sys.stderr.write(captured.getvalue())
            raise
        raise ConfigError(_first_box_text(captured.getvalue())) from None
    except (ValueError, AssertionError) as e:  # TorchTitan's own checks (some are asserts)
        raise ConfigError(str(e).splitlines()[0] if str(e) else f"invalid config ({type(e).__name__})") from None
    finally:
        root.setLevel(level)


def _first_box_text(text: str) -> str:
    """'╭─ Value error ─╮ │ Error parsing --x: ... │ ├──' -> 'Value error: Error parsing --x: ...'."""
    title, body = "", []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("╭"):
            title = line.strip("╭─╮ ")
        elif line.startswith("│"):
            content = line.strip("│ ")
            if content.startswith("──"):
                break
            body.append(content)
    message = " ".join(body) or text.strip().replace("\n", " ")
    return f"{title}: {message}" if title else message
