"""`gamma-titan recipe run NAME --scale tiny|gpu|paper [--launcher local|slurm] [--dry-run] [--out DIR]`.

Everything is checked first (the recipe, every run's config at its world size, the
output folder), then: --dry-run prints the plan (and with slurm writes the scripts);
local trains the runs here and writes the report; slurm writes and submits one job per
unfinished run. OUT/recipe.json records the plan: a second call with another plan into
the same folder is refused, so no run's results get mixed with another's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError
from gamma_titan.recipes.execute import Planned, check_out, execute, plan_record
from gamma_titan.recipes.plan import plan
from gamma_titan.recipes.spec import load_recipe
from gamma_titan.recipes.tuned import TunedPlanner


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """`--section.key value` / `--section.key=value` pairs for every run (a bare flag is true)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"{arg}: overrides for every run look like --section.key value")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = arg[2:], args[i + 1]
            i += 2
        else:
            key, value = arg[2:], True
            i += 1
        out[key] = value
    return out


def plan_recipe(name: str, scale: str, out: str | None = None, overrides: list[str] | None = None,
                steps: int | None = None, seeds: list[int] | None = None,
                allow_epochs: float | None = None, site=None) -> Planned:
    """Every check before anything runs: the recipe, each run's config at its world size, OUT.
    A tuned recipe is planned as far as the results in OUT take its searches. `site`: the
    SLURM settings (gamma_titan/slurm/site.Site) for --launcher slurm."""
    recipe = load_recipe(name)
    out_dir = Path(out) if out else Path("runs") / f"{recipe.name}-{scale}"
    if recipe.tune_for(scale) is not None:
        planned = TunedPlanner(recipe, scale, out_dir, parse_overrides(overrides or []), steps, seeds,
                               allow_epochs).plan()
    else:
        runs = plan(recipe, scale, parse_overrides(overrides or []), steps, seeds, allow_epochs)
        record = plan_record(recipe, scale, runs)
        check_out(out_dir, record)
        planned = Planned(recipe, scale, runs, out_dir, record)
    planned.site = site
    return planned


def run_recipe(name: str, scale: str, launcher: str = "local", dry_run: bool = False, out: str | None = None,
               jobs: int = 1, overrides: list[str] | None = None, steps: int | None = None,
               seeds: list[int] | None = None, allow_epochs: float | None = None, site=None) -> int:
    if launcher not in ("local", "slurm"):
        raise ConfigError(f"--launcher {launcher}: allowed local, slurm")
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: must be >= 1")
    if site is not None and launcher != "slurm":
        raise ConfigError("the SLURM settings (--site, --partition, --account, ...) go with --launcher slurm")
    if launcher == "slurm" and site is None:
        from gamma_titan.slurm.site import load_site

        site = load_site(None)  # $GAMMA_TITAN_SLURM_SITE, if set
    return execute(plan_recipe(name, scale, out, overrides, steps, seeds, allow_epochs, site), launcher, dry_run,
                   jobs)


__all__ = ["execute", "parse_overrides", "plan_recipe", "run_recipe"]
