"""A recipe file (`recipes/NAME.toml`): one experiment of the paper as a set of runs.

    [recipe]       title, figure, expect (what the paper found, quoted in the report)
    [set]          overrides every run gets              "gamma.norm_eps" = 1e-12
    [grid]         one run per combination of values     "gamma.init_rate" = [0.5, 1.0]
    [arms.NAME]    named override sets, crossed with the grid (scaling: standard vs small)
    [report]       rows / columns of the pivot table; fit = true for the scaling law
    [[claims]]     what the paper says that the runs test, each with a verdict (reports/claims.py)
    [tune]         a setting (the learning rate) searched per model and arm until its best value
                   is bracketed, the best then trained with every seed (gamma_titan/grid_search.py); a
                   scale's `tune = { start, stop }` moves its first grid
    [scale.tiny]   models (config + flavor) and a budget of tokens_per_param (CPU, minutes)
    [scale.gpu]    the same on one GPU (about an hour per recipe)
    [scale.paper]  models with nodes, gpus_per_node, global_batch; a budget of tokens

A scale may also set `seeds` (every run is repeated once per seed: the init seed and the
data order both change; default 3 seeds at the tiny scale, one elsewhere) and
`allow_epochs` (how many passes over the training data a run may make; default 1) and
`step_multiple` (steps are rounded up to a multiple of it; default 100 / 500 / 1000 by scale).

Runs = models × arms × grid × seeds. Override keys are TorchTitan/gamma-titan config keys
(`section.key`), exactly as on the `gamma-titan train` command line.
"""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError
from gamma_titan.grid_search import Tune, parse_tune

PROJECT_ROOT = Path(__file__).resolve().parents[2]
RECIPES_DIR = PROJECT_ROOT / "recipes"
SCALES = ("tiny", "gpu", "paper")
#: The scales whose runs train on CPUs (a SLURM job asks for no GPU).
CPU_SCALES = ("tiny",)
#: Seeds per scale when the recipe names none: the tiny scale's differences are small
#: enough that one seed cannot tell them from noise.
DEFAULT_SEEDS = {"tiny": (0, 1, 2), "gpu": (0,), "paper": (0,)}
#: What a seed sets: the init's random stream and the training data's order.
SEED_KEYS = ("debug.seed", "gamma.data.seed")
#: Short names for run labels: ("gamma.init_rate", 1.0) -> "g1".
LABELS = {"gamma.init_rate": "g", "gamma.norm_eps": "eps", "gamma.attention_gate": "gate", "optimizer.lr": "lr"}


@dataclass
class Model:
    config: Path
    flavor: str | None = None
    nodes: int = 1
    gpus_per_node: int = 1
    global_batch: int | None = None  # sequences per optimizer step; None: the config's

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def label(self) -> str:
        return self.flavor or self.config.stem


@dataclass
class Scale:
    name: str
    models: list[Model]
    tokens: float | None = None  # per run, or:
    tokens_per_param: float | None = None  # × the model's parameters (see plan.budget_params)
    set: dict[str, Any] = field(default_factory=dict)  # overrides for this scale only
    gpu_peak_tflops: float = 989.0  # H100 SXM dense bf16, for the GPU-hours estimate
    assumed_mfu: float = 0.4
    time_limit_hours: float | None = None  # SLURM --time; None: 1.5 × the estimate
    seeds: tuple[int, ...] = (0,)
    allow_epochs: float = 1.0  # passes over the training data a run may make
    step_multiple: int | None = None  # steps are rounded up to a multiple of this (None: plan.STEP_MULTIPLE)


@dataclass
class Run:
    """One training run of a recipe at one scale."""

    name: str
    model: Model
    arm: str | None
    values: dict[str, Any]  # the grid point and arm overrides that set this run apart
    overrides: dict[str, Any]  # everything the run gets on top of its config
    cell: str  # the name without the seed: the runs of one cell differ only in their seed
    seed: int | None = None  # None: the config's own seeds (a scale with one seed)


@dataclass
class Recipe:
    name: str
    path: Path
    title: str
    figure: str
    expect: str
    set: dict[str, Any]
    grid: dict[str, list[Any]]
    arms: dict[str, dict[str, Any]]
    report: dict[str, Any]
    scales: dict[str, Scale]
    claims: list[dict[str, Any]] = field(default_factory=list)  # checked by reports/claims.py
    tunes: dict[str, Tune] = field(default_factory=dict)  # per scale: a setting searched per model and arm

    def tune_for(self, scale: str) -> Tune | None:
        """The [tune] search at this scale (its [scale.NAME.tune] start/stop), or None."""
        return self.tunes.get(scale)

    def runs(self, scale: str, seeds: tuple[int, ...] | None = None) -> list[Run]:
        """Every run at this scale: models × arms × grid × seeds (`seeds` replaces the scale's)."""
        s = self.scale(scale)
        seeds = tuple(s.seeds if seeds is None else seeds)
        arms = list(self.arms) or [None]
        keys = list(self.grid)
        runs = []
        for model in s.models:
            for arm in arms:
                for point in itertools.product(*(self.grid[k] for k in keys)):
                    if len(seeds) == 1 and seeds == DEFAULT_SEEDS[scale]:
                        runs.append(self.run(scale, model, arm, dict(zip(keys, point)), None))
                    else:
                        runs += [self.run(scale, model, arm, dict(zip(keys, point)), seed) for seed in seeds]
        return runs

    def run(self, scale: str, model: Model, arm: str | None, point: dict[str, Any], seed: int | None) -> Run:
        """One run: the model with the arm's overrides and the grid point (and the [tune]
        value), under `seed` (None: the config's own seeds)."""
        s = self.scale(scale)
        values = {**(self.arms[arm] if arm else {}), **point}
        parts = [model.label] if len(s.models) > 1 else []
        parts += [arm] if arm else []
        parts += [f"{LABELS.get(k, k.rsplit('.', 1)[-1])}{_fmt(v)}" for k, v in point.items()]
        cell = "_".join(parts) or model.label
        overrides = {**self.set, **s.set, **values}
        if model.flavor:
            overrides["model.flavor"] = model.flavor
        if seed is None:
            return Run(cell, model, arm, values, overrides, cell)
        return Run(f"{cell}_s{seed}", model, arm, values, {**overrides, **{k: seed for k in SEED_KEYS}}, cell, seed)

    def scale(self, name: str) -> Scale:
        if name not in self.scales:
            raise ConfigError(f"--scale {name}: recipe {self.name} has scales {', '.join(self.scales)}")
        return self.scales[name]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def available() -> list[str]:
    return sorted(p.stem for p in RECIPES_DIR.glob("*.toml"))


def find_recipe(name: str) -> Path:
    """A recipe name (`gamma_sweep`, from recipes/) or a path to a recipe file."""
    path = Path(name)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ConfigError(f"recipe {name}: no such file")
        return path
    path = RECIPES_DIR / f"{name}.toml"
    if not path.is_file():
        raise ConfigError(f"recipe {name!r}: allowed {', '.join(available())} (or a path to a .toml)")
    return path


def _table(raw: dict, key: str, where: str) -> dict:
    value = raw.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: [{key}] must be a table")
    return value


def _resolve_config(value: Any, recipe: Path, where: str) -> Path:
    if not isinstance(value, str):
        raise ConfigError(f"{where}.config: must be a path string")
    for base in (Path.cwd(), recipe.parent.parent, PROJECT_ROOT):
        path = (base / value).resolve()
        if path.is_file():
            return path
    raise ConfigError(f"{where}.config = {value!r}: no such file (paths are relative to the project root)")


def _model(entry: Any, recipe: Path, where: str) -> Model:
    if isinstance(entry, str):
        entry = {"config": entry}
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: a model is a config path or a table {{config, flavor, nodes, ...}}")
    allowed = {"config", "flavor", "nodes", "gpus_per_node", "global_batch"}
    unknown = set(entry) - allowed
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown key; allowed {', '.join(sorted(allowed))}")
    model = Model(config=_resolve_config(entry.get("config"), recipe, where), flavor=entry.get("flavor"),
                  nodes=entry.get("nodes", 1), gpus_per_node=entry.get("gpus_per_node", 1),
                  global_batch=entry.get("global_batch"))
    for key in ("nodes", "gpus_per_node"):
        if not isinstance(getattr(model, key), int) or getattr(model, key) < 1:
            raise ConfigError(f"{where}.{key} = {getattr(model, key)!r}: must be a positive integer")
    if model.global_batch is not None and (not isinstance(model.global_batch, int) or model.global_batch < 1):
        raise ConfigError(f"{where}.global_batch = {model.global_batch!r}: must be a positive integer")
    return model


def _scale(name: str, raw: dict, recipe: Path) -> Scale:
    where = f"{recipe.name} [scale.{name}]"
    allowed = {"models", "tokens", "tokens_per_param", "set", "gpu_peak_tflops", "assumed_mfu", "time_limit_hours",
               "seeds", "allow_epochs", "tune", "step_multiple"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where}: unknown key {sorted(unknown)[0]!r}; allowed {', '.join(sorted(allowed))}")
    models = raw.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{where}.models: a non-empty list of configs")
    scale = Scale(name=name, models=[_model(m, recipe, f"{where}.models[{i}]") for i, m in enumerate(models)],
                  tokens=raw.get("tokens"), tokens_per_param=raw.get("tokens_per_param"), set=raw.get("set", {}),
                  gpu_peak_tflops=raw.get("gpu_peak_tflops", 989.0), assumed_mfu=raw.get("assumed_mfu", 0.4),
                  time_limit_hours=raw.get("time_limit_hours"),
                  seeds=check_seeds(raw.get("seeds", list(DEFAULT_SEEDS[name])), f"{where}.seeds"),
                  allow_epochs=raw.get("allow_epochs", 1.0), step_multiple=raw.get("step_multiple"))
    if scale.step_multiple is not None and (not isinstance(scale.step_multiple, int)
                                            or isinstance(scale.step_multiple, bool) or scale.step_multiple < 1):
        raise ConfigError(f"{where}.step_multiple = {scale.step_multiple!r}: must be a positive integer")
    if not isinstance(scale.allow_epochs, (int, float)) or isinstance(scale.allow_epochs, bool) \
            or scale.allow_epochs <= 0:
        raise ConfigError(f"{where}.allow_epochs = {scale.allow_epochs!r}: must be a positive number")
    if not isinstance(scale.set, dict):
        raise ConfigError(f"{where}.set: a table of overrides")
    for key in ("gpu_peak_tflops", "assumed_mfu", "time_limit_hours"):
        value = getattr(scale, key)
        if value is not None and (not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"{where}.{key} = {value!r}: must be a positive number")
    if (scale.tokens is None) == (scale.tokens_per_param is None):
        raise ConfigError(f"{where}: give exactly one of tokens (per run) or tokens_per_param")
    budget = scale.tokens if scale.tokens is not None else scale.tokens_per_param
    if not isinstance(budget, (int, float)) or budget <= 0:
        raise ConfigError(f"{where}: the token budget must be a positive number, got {budget!r}")
    return scale


def check_seeds(seeds: Any, where: str) -> tuple[int, ...]:
    """A non-empty list of distinct integers >= 0."""
    if (not isinstance(seeds, (list, tuple)) or not seeds or len(set(seeds)) != len(seeds)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds)):
        shown = f"{where} {','.join(map(str, seeds))}" if where.startswith("--") and isinstance(seeds, (list, tuple)) \
            else f"{where} = {seeds!r}"
        raise ConfigError(f"{shown}: must be a non-empty list of distinct integers >= 0")
    return tuple(seeds)


def load_recipe(name: str) -> Recipe:
    path = find_recipe(name)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    allowed = {"recipe", "set", "grid", "arms", "report", "scale", "claims", "tune"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{path.name}: unknown table [{sorted(unknown)[0]}]; allowed {', '.join(sorted(allowed))}")
    head = _table(raw, "recipe", path.name)
    grid = _table(raw, "grid", path.name)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ConfigError(f"{path.name} [grid] {key!r}: a non-empty list of values")
    arms = _table(raw, "arms", path.name)
    for arm, values in arms.items():
        if not isinstance(values, dict):
            raise ConfigError(f"{path.name} [arms.{arm}]: a table of overrides")
    scales = _table(raw, "scale", path.name)
    unknown = [s for s in scales if s not in SCALES]
    if unknown or not scales:
        raise ConfigError(f"{path.name}: " + (f"unknown [scale.{unknown[0]}]" if unknown else "no [scale.NAME]")
                          + f"; the scales are {', '.join(SCALES)}")
    report = _table(raw, "report", path.name)
    for key in ("rows", "columns"):
        if key in report and report[key] not in {*grid, "arm", "model"}:
            raise ConfigError(f"{path.name} [report] {key} = {report[key]!r}: a [grid] key, 'arm' or 'model'")
    from gamma_titan.reports.claims import check_claims

    claims = raw.get("claims", [])
    check_claims(claims, {*grid, "arm", "model", *{k for arm in arms.values() for k in arm}}, path.name)
    fixed = {*_table(raw, "set", path.name), *grid, *{k for arm in arms.values() for k in arm}}
    tunes = {}
    for name, table in scales.items():
        where = f"{path.name} [scale.{name}.tune]"
        own = table.get("tune", {}) if isinstance(table, dict) else {}
        if not isinstance(own, dict) or set(own) - {"start", "stop"}:
            raise ConfigError(f"{where}: a table of start and stop (the scale's first grid)")
        if own and "tune" not in raw:
            raise ConfigError(f"{where}: the recipe has no [tune] table")
        if "tune" in raw:
            tunes[name] = parse_tune({**_table(raw, "tune", path.name), **own}, path.name, fixed)
    if tunes and (grid or claims):
        raise ConfigError(f"{path.name}: a recipe with [tune] has no [grid] or [[claims]] (its report judges the "
                          "tuned comparison itself)")
    return Recipe(name=path.stem, path=path, title=head.get("title", path.stem), figure=head.get("figure", ""),
                  expect=head.get("expect", ""), set=_table(raw, "set", path.name), grid=grid, arms=arms,
                  report=report, scales={n: _scale(n, s, path) for n, s in scales.items()}, claims=claims, tunes=tunes)
