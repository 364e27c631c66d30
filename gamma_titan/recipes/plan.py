"""From a recipe's runs to what each one trains: its command line, world size, token budget
and cost. Every run's config is parsed and pre-flight checked here, so a recipe with one bad
run stops before anything starts or any file is written.

Token budget. `tokens` gives every run the same count (the paper: 36B dense, 100B MoE);
`tokens_per_param` scales it with the model's total parameter count, embeddings included
(small models need many tokens per parameter before γ = 1 pays off: it starts slower, its
weights condense first). Steps = budget / (global batch × seq_len), rounded up to a
multiple of `STEP_MULTIPLE[scale]`, so evaluations land on the last step.

Epochs. When the training data is a shard dataset, the plan knows its size and refuses a
run that would pass over it more than the scale's `allow_epochs` times (default once):
a model that sees its data again is partly measured on memorisation.

ε-dominance. σ²(h) is the smallest variance any RMSNorm input has at init, measured on the
run's model as `inspect` measures it (models/common/norm_inputs.py), over its leading blocks,
one of each kind: the embedding's d^(−2γ) for pre-norm blocks, far less at a post-norm,
whose input is a sublayer's output. A run whose ε exceeds EPS_DOMINANCE · σ²(h) has norms
that see ε instead of the scale. The plan prints the ratio and the norm per run, and warns
when a recipe varies ε but ε dominates in none of its runs (such an ablation cannot show
the paper's effect), or keeps ε fixed and ε dominates in some (it masks small init).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gamma_titan.diagnostics.probe import EPS_DOMINANCE, eps_dominates
from gamma_titan.errors import ConfigError
from gamma_titan.recipes.spec import SEED_KEYS, Recipe, Run, Scale, check_seeds
from gamma_titan.training.launch import stop_grace_seconds

STEP_MULTIPLE = {"tiny": 100, "gpu": 500, "paper": 1000}
NORM_EPS = "gamma.norm_eps"
GRACE_KEY = "gamma.reliability.stop_grace_seconds"
#: At the tiny and gpu scales, validation, diagnostics and the sink scores are measured at
#: step 1 and this many times more, evenly, the last at the final step (the paper scale
#: keeps its configs' frequencies).
MEASUREMENTS = {"tiny": 4, "gpu": 10}
EMBEDDINGS = ("tok_embeddings.weight", "output.weight")
#: A tiny-scale run's seconds on the CI machine (2 cores, one run at a time), fitted to the
#: runs of `lr_ladder --scale tiny` (README, Recipes): start-up + steps × a per-step cost +
#: training FLOPs at a sustained rate. Only the plan's estimate reads them.
CPU_RUN_SECONDS = 15.0
CPU_STEP_SECONDS = 0.06
CPU_FLOPS = 2.0e11


@dataclass
class PlannedRun:
    name: str
    config: str
    overrides: dict[str, Any]  # everything on top of the config, steps included
    values: dict[str, Any]  # what sets this run apart in the recipe (grid point, arm)
    arm: str | None
    cell: str  # runs of one cell differ only in their seed
    seed: int | None
    model_label: str
    nodes: int
    gpus_per_node: int
    params: int
    params_non_embedding: int
    width: int  # d, the residual stream's width
    active_params: int | None  # MoE: matmul weights one token passes through
    seq_len: int
    global_batch: int
    steps: int
    tokens: int
    corpus_tokens: int | None  # one epoch of the training data, when it is a shard dataset
    flops_per_token: int
    norm_eps: float
    hidden_var: float  # σ²(h): the smallest variance of a norm's input at init, measured
    hidden_var_site: str  # the norm that sees it ("layers.*.attention_norm")
    gpu_hours: float
    cpu_hours: float  # on the CI machine (CPU_*): the tiny scale's estimate
    stop_grace_seconds: float  # between SIGTERM and exit: the step in progress and a full save (launch.py)
    frequencies: dict[str, int | None]  # validation.freq, gamma.diagnostics.freq as configured (None: off)
    budget_steps: int | None = None  # the steps the token budget needs, before rounding (None: --steps)
    step_multiple: int | None = None  # what they were rounded up to a multiple of
    plan_set: list[str] = dataclasses.field(default_factory=list)  # the keys the plan chose (nobody else set them)

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tokens_per_param(self) -> float:
        return self.tokens / self.params

    @property
    def epochs(self) -> float | None:
        """Passes over the training data (its first source to wrap, for a mixture)."""
        return self.tokens / self.corpus_tokens if self.corpus_tokens else None

    @property
    def eps_ratio(self) -> float:
        return self.norm_eps / self.hidden_var

    @property
    def eps_dominated(self) -> bool:
        return eps_dominates(self.norm_eps, self.hidden_var)

    def argv(self, run_dir: Path) -> list[str]:
        """The `gamma_titan.train` arguments (TorchTitan's command line) of this run."""
        return [*_argv(Path(self.config), self.overrides), "--job.dump_folder", str(run_dir)]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "world_size": self.world_size, "tokens_per_param": self.tokens_per_param,
                "epochs": self.epochs, "eps_ratio": self.eps_ratio, "eps_dominated": self.eps_dominated}


def _cli(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return repr(value) if isinstance(value, float) else str(value)  # repr: exact, and 1e-12 stays short


def _count_params(spec, args) -> tuple[int, int]:
    import torch

    with torch.device("meta"):
        model = spec.model_cls(args)
    total = embeddings = 0
    for name, p in model.named_parameters():
        total += p.numel()
        embeddings += p.numel() if name in EMBEDDINGS else 0
    return total, total - embeddings


#: (model class, args, probe length) -> (norm, σ²(h)): a pure function of them, asked again
#: by the cells that differ in no model setting and by recipes that share a model.
_SMALLEST_NORM_INPUT: dict[tuple, tuple[str, float]] = {}


def smallest_norm_input(spec, args, seq_len: int) -> tuple[str, float]:
    """The norm whose input has the smallest variance at init ("layers.*.attention_norm"),
    and that variance."""
    from gamma_titan.models.common.norm_inputs import PROBE_LEN, norm_inputs_at_init, norm_kind

    key = (spec.model_cls, repr(args), min(seq_len, PROBE_LEN))
    if key not in _SMALLEST_NORM_INPUT:
        site, var = norm_inputs_at_init(spec.model_cls, args, seq_len).smallest()
        _SMALLEST_NORM_INPUT[key] = norm_kind(site), var
    return _SMALLEST_NORM_INPUT[key]


def _argv(config: Path, overrides: dict[str, Any]) -> list[str]:
    return ["--job.config_file", str(config), *[a for k, v in overrides.items() for a in (f"--{k}", _cli(v))]]


def plan_run(recipe: Recipe, scale_name: str, run: Run, extra: dict[str, Any] | None = None) -> PlannedRun:
    """Check one run's config at its world size and count its parameters; `finish`
    then sets its steps."""
    from gamma_titan.config import load_job_config
    from gamma_titan.data.names import is_shard_dataset
    from gamma_titan.data.shard_sources import open_samples
    from gamma_titan.data.tokenizer import resolve_tokenizer_path
    from gamma_titan.training.preflight import global_batch_size, preflight

    model = run.model
    overrides = {**run.overrides, **(extra or {})}
    if model.global_batch is not None:
        overrides["training.global_batch_size"] = model.global_batch
    try:
        config = load_job_config(_argv(model.config, overrides))
        spec, args = preflight(config, world_size=model.world_size, local_world_size=model.gpus_per_node)
    except ConfigError as e:
        raise ConfigError(f"recipe {recipe.name}, run {run.name}: {e}") from None
    t = config.training
    global_batch = global_batch_size(t, model.world_size)
    params, non_embedding = _count_params(spec, args)
    corpus = None
    if is_shard_dataset(t.dataset):
        samples = open_samples(config, "training", t.seq_len, resolve_tokenizer_path(config.model.hf_assets_path))
        corpus = samples.epoch_samples * t.seq_len
    active = args.active_params()
    site, hidden_var = smallest_norm_input(spec, args, t.seq_len)
    return PlannedRun(name=run.name, config=str(model.config), overrides=overrides, values=run.values, arm=run.arm,
                      cell=run.cell, seed=run.seed, model_label=model.label, nodes=model.nodes, gpus_per_node=model.gpus_per_node, params=params,
                      params_non_embedding=non_embedding, width=args.model_width(), active_params=active,
                      seq_len=t.seq_len,
                      global_batch=global_batch, steps=0, tokens=0, corpus_tokens=corpus,
                      flops_per_token=args.flops_per_token(t.seq_len), norm_eps=args.norm_eps,
                      hidden_var=hidden_var, hidden_var_site=site, gpu_hours=0.0, cpu_hours=0.0,
                      stop_grace_seconds=config.gamma.reliability.stop_grace_seconds,
                      frequencies={"validation.freq": config.validation.freq if config.validation.enable else None,
                                   "gamma.diagnostics.freq": config.gamma.diagnostics.freq
                                   if config.gamma.diagnostics.enable else None})


#: Keys the plan sets for a run where nobody else does: the measuring frequencies of the CPU and
#: one-GPU scales, the checkpoint interval (one save, at the end) and the stop's grace period.
MEASURING_KEYS = ("validation.freq", "gamma.diagnostics.freq")
PLANNED_DEFAULTS = (*MEASURING_KEYS, "checkpoint.interval", GRACE_KEY)
#: Keys the plan sets for every run, which a recipe's [set] or the command line cannot: each
#: with what to use instead.
PLAN_OWNS = {"training.steps": "the token budget sets it; use --steps N for a shorter run",
             "job.dump_folder": "each run trains in OUT/<run name>; choose OUT with --out"}


def config_keys(path: str | Path) -> set[str]:
    """The dotted keys a config file sets itself (`validation.freq`), tables as keys too."""
    import tomllib

    def walk(table: dict, prefix: str) -> set[str]:
        out = set()
        for key, value in table.items():
            out.add(prefix + key)
            if isinstance(value, dict):
                out |= walk(value, f"{prefix}{key}.")
        return out

    with open(path, "rb") as f:
        return walk(tomllib.load(f), "")


def finish(run: PlannedRun, scale: Scale, steps: int, user_keys: set[str]) -> None:
    """Set the run's steps and what follows from them. A key in `user_keys` (the recipe's
    [set], arms and grid, the command line, the config file's own keys) keeps its value: the
    plan only fills in what nobody set, and refuses a value the scale cannot use."""
    run.steps = steps
    run.tokens = steps * run.global_batch * run.seq_len
    run.gpu_hours = run.flops_per_token * run.tokens / (scale.gpu_peak_tflops * 1e12 * scale.assumed_mfu) / 3600
    run.cpu_hours = (CPU_RUN_SECONDS + steps * CPU_STEP_SECONDS + run.flops_per_token * run.tokens / CPU_FLOPS) / 3600
    run.overrides["training.steps"] = steps
    configured = run.stop_grace_seconds
    step_seconds = run.gpu_hours * 3600 / run.world_size / steps
    needed = stop_grace_seconds(configured, run.params, run.nodes, step_seconds)
    run.plan_set = ["training.steps"]
    if GRACE_KEY not in user_keys and needed > configured:
        run.stop_grace_seconds = needed
        run.overrides[GRACE_KEY] = needed
        run.plan_set.append(GRACE_KEY)
    if scale.name not in MEASUREMENTS:
        return
    every = max(1, steps // MEASUREMENTS[scale.name])
    for key in MEASURING_KEYS:
        if key not in user_keys:
            run.overrides[key] = every
            run.plan_set.append(key)
            continue
        value = run.frequencies.get(key)
        if value and steps % value:
            raise ConfigError(f"run {run.name}: {key} = {value} does not divide its {steps} steps: the report compares "
                              f"every run at its last step, which must be measured; set a divisor of {steps} (the "
                              f"plan's own is {every}), or leave {key} unset for the plan to choose")
    if "checkpoint.interval" not in user_keys:
        run.overrides["checkpoint.interval"] = steps
        run.plan_set.append("checkpoint.interval")


def plan(recipe: Recipe, scale_name: str, extra: dict[str, Any] | None = None,
         steps_override: int | None = None, seeds: list[int] | None = None,
         allow_epochs: float | None = None, runs: list[Run] | None = None,
         checked: dict[str, PlannedRun] | None = None) -> list[PlannedRun]:
    """Every run of the recipe at this scale (or `runs`, a tuned recipe's runs so far),
    checked, with its steps. The runs of one model share one step count (the largest any
    of them needs), so arms and grid points that add parameters (the gate) still see the
    same data. `steps_override` replaces the budget (a smoke run), `seeds` the scale's
    seeds, `allow_epochs` its epoch limit; `checked` (cell -> planned run) carries the
    checked configs from one call to the next."""
    scale = recipe.scale(scale_name)
    if seeds is not None:
        seeds = check_seeds(seeds, "--seeds")
    if allow_epochs is not None and (not isinstance(allow_epochs, (int, float)) or allow_epochs <= 0):
        raise ConfigError(f"--allow-epochs {allow_epochs}: must be a positive number")
    limit = scale.allow_epochs if allow_epochs is None else allow_epochs
    if steps_override is not None:
        every = MEASUREMENTS.get(scale_name, 1)
        if not isinstance(steps_override, int) or steps_override < 1 or steps_override % every:
            raise ConfigError(f"--steps {steps_override}: must be a positive integer"
                              + (f", a multiple of {every} at the {scale_name} scale" if every > 1 else ""))
    varied = set(recipe.grid) | {key for arm in recipe.arms.values() for key in arm}
    tune = recipe.tune_for(scale_name)
    varied |= {tune.key} if tune else set()
    if seeds is not None or len(scale.seeds) > 1 or tune:
        varied |= set(SEED_KEYS)
    given = [(f"--{key}", key) for key in extra or {}] + [(f"[set] {key}", key) for key in recipe.set] + \
            [(f"[scale.{scale_name}.set] {key}", key) for key in scale.set]
    for where, key in given:
        if key in PLAN_OWNS:
            raise ConfigError(f"recipe {recipe.name}: {where}: {PLAN_OWNS[key]}")
        if key in SEED_KEYS and key in varied:
            raise ConfigError(f"recipe {recipe.name}: {where}: each run's seed sets it (seeds "
                              f"{', '.join(map(str, seeds or scale.seeds))}); choose the seeds with --seeds")
        if key in varied:
            raise ConfigError(f"recipe {recipe.name}: {where}: the recipe varies it per run (its [grid], [arms] or "
                              "[tune]); edit those to change it")
    runs = recipe.runs(scale_name, seeds) if runs is None else runs
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"recipe {recipe.name}: two runs share a name; give the models distinct flavors")
    planned, first_of_cell = [], ({} if checked is None else checked)
    for r in runs:  # a cell's config is checked once: its seeds differ only in the seed keys
        if r.cell not in first_of_cell:
            first_of_cell[r.cell] = plan_run(recipe, scale_name, r, extra)
        first = first_of_cell[r.cell]
        overrides = {**first.overrides, **{k: r.overrides[k] for k in SEED_KEYS if k in r.overrides}}
        planned.append(dataclasses.replace(first, name=r.name, seed=r.seed, overrides=overrides))
    multiple = scale.step_multiple or STEP_MULTIPLE[scale_name]
    if multiple % MEASUREMENTS.get(scale_name, 1):
        raise ConfigError(f"[scale.{scale_name}] step_multiple = {multiple}: must be a multiple of "
                          f"{MEASUREMENTS[scale_name]} (the evaluations land on the last step)")
    steps: dict[str, int] = {}
    for r in planned:
        budget = scale.tokens if scale.tokens is not None else scale.tokens_per_param * r.params
        r.budget_steps = None if steps_override else math.ceil(budget / (r.global_batch * r.seq_len))
        r.step_multiple = None if steps_override else multiple
        need = multiple * math.ceil(budget / (r.global_batch * r.seq_len) / multiple)
        steps[r.model_label] = steps_override or max(steps.get(r.model_label, 0), need)
    set_by_recipe = set(recipe.set) | set(scale.set) | varied | set(extra or {})
    own = {}
    for r in planned:
        if r.config not in own:
            own[r.config] = config_keys(r.config)
        finish(r, scale, steps[r.model_label], set_by_recipe | own[r.config])
    for r in planned:
        if r.epochs is not None and r.epochs > limit * (1 + 1e-9):
            raise ConfigError(
                f"recipe {recipe.name}, run {r.name}: {r.epochs:.3g} epochs of training.dataset "
                f"({r.tokens / 1e6:.4g}M of {r.corpus_tokens / 1e6:.4g}M tokens), more than the {limit:g} "
                f"[scale.{scale_name}] allow_epochs permits; give it more data (--training.dataset_path), "
                "a smaller budget, or a higher allow_epochs (--allow-epochs)")
    return planned


def cost(scale: Scale, runs: list[PlannedRun]) -> str:
    """The runs' compute: CPU-hours on the CI machine at the tiny scale, else GPU-hours."""
    if scale.name == "tiny":
        return f"{sum(r.cpu_hours for r in runs):.3g} CPU-hours"
    return f"{sum(r.gpu_hours for r in runs):.4g} GPU-hours"


def cost_line(scale: Scale, runs: list[PlannedRun]) -> str:
    if scale.name == "tiny":
        return (f"total ≈ {cost(scale, runs)} (one run at a time on 2 cores, the CI machine; "
                f"≈ {sum(r.gpu_hours for r in runs):.3g} GPU-hours)")
    return (f"total ≈ {cost(scale, runs)} (at {scale.assumed_mfu:.0%} MFU of {scale.gpu_peak_tflops:g} "
            "TFLOP/s per GPU)")


def eps_warnings(recipe: Recipe, runs: list[PlannedRun]) -> list[str]:
    """A warning when the recipe ablates ε (its grid varies ε, everything else fixed) and ε
    dominates σ²(h) in none of its runs (arms that change ε together with γ compare whole
    settings, not ε); and one when ε is the same in every run and dominates in some: their
    norms see ε, which masks the effect of small init the recipe measures."""
    worst = max(runs, key=lambda r: r.eps_ratio)
    where = f"run {worst.name}, at {worst.hidden_var_site}"
    dominated = [r for r in runs if r.eps_dominated]
    if NORM_EPS in recipe.grid and not dominated:
        return [f"WARNING: this recipe varies ε, but ε ≤ {EPS_DOMINANCE:g}·σ²(h) in every run (largest ε/σ²(h): "
                f"{worst.eps_ratio:.3g}, {where}); the norms see the scale either way, so the ablation "
                "cannot show an effect. Use a wider model (σ²(h) = d^(−2γ) at a pre-norm) or a larger γ."]
    if len({r.norm_eps for r in runs}) == 1 and dominated:
        return [f"WARNING: ε = {worst.norm_eps:g} dominates a norm's input at init in {len(dominated)} of "
                f"{len(runs)} runs (ε/σ²(h) up to {worst.eps_ratio:.3g}, {where}: σ²(h) = "
                f"{worst.hidden_var:.3g}): those norms see ε instead of the scale, which masks the effect of "
                "small init (paper §2.1). Lower gamma.norm_eps (e.g. 1e-12)."]
    return []


def _rounding(r: PlannedRun) -> str:
    """How the token budget's steps became the run's."""
    if r.budget_steps is None or r.budget_steps == r.steps:
        return ""
    why = f"rounded up to a multiple of {r.step_multiple}" if r.steps == r.step_multiple * math.ceil(
        r.budget_steps / r.step_multiple) else f"the most any run of {r.model_label} needs, rounded to {r.step_multiple}"
    return f" (the budget needs {r.budget_steps}: {why})"


def format_plan(recipe: Recipe, scale: str, runs: list[PlannedRun]) -> str:
    seeds = sorted({r.seed for r in runs if r.seed is not None})
    lines = [f"recipe {recipe.name} ({recipe.figure}), scale {scale}: {len(runs)} runs"
             + (f" ({len({r.cell for r in runs})} settings x seeds {', '.join(map(str, seeds))})" if seeds else "")]
    for r in runs:
        corpus = f", {r.epochs:.3g} epochs of training.dataset" if r.epochs is not None else ""
        lines += [
            f"  {r.name}: {Path(r.config).name}  world {r.world_size} ({r.nodes} node x {r.gpus_per_node})",
            f"    params {r.params / 1e6:.3g}M ({r.params_non_embedding / 1e6:.3g}M non-embedding"
            + (f", {r.active_params / 1e6:.3g}M active" if r.active_params else "") + ")"
            + f"  tokens {r.tokens / 1e6:.4g}M = {r.tokens_per_param:.1f}/param{corpus}",
            f"    steps {r.steps} x {r.global_batch} seq x {r.seq_len}{_rounding(r)}  ≈ "
            + (f"{r.cpu_hours * 60:.3g} CPU-minutes" if scale == "tiny" else f"{r.gpu_hours:.3g} GPU-hours"),
            f"    ε / σ²(h) at init = {r.norm_eps:g} / {r.hidden_var:.3g} = {r.eps_ratio:.3g}"
            + (" (ε-DOMINATED" if r.eps_dominated else f" (ε negligible: <= {EPS_DOMINANCE:g}")
            + f"; σ²(h) at {r.hidden_var_site}, the smallest norm input)",
            "    overrides " + " ".join(f"--{k} {_cli(v)}" for k, v in r.overrides.items()),
            "    set by the plan (nobody else set them): "
            + ", ".join(f"{k} = {_cli(r.overrides[k])}" for k in r.plan_set),
        ]
    lines.append(cost_line(recipe.scale(scale), runs))
    lines += eps_warnings(recipe, runs)
    return "\n".join(lines)
