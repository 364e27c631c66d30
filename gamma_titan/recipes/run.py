"""`gamma-titan recipe run NAME --scale tiny|gpu|paper [--launcher local|slurm] [--dry-run] [--out DIR]`.

Everything is checked first (the recipe, every run's config at its world size, the
output folder), then: --dry-run prints the plan (and with slurm writes the scripts);
local trains the runs here and writes the report; slurm writes and submits one job per
unfinished run. OUT/recipe.json records the plan: a second call with another plan into
the same folder is refused, so no run's results get mixed with another's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError
from gamma_titan.files import RECIPE_PLAN_FILE, RECIPE_STATUS_FILE
from gamma_titan.recipes.plan import PlannedRun, format_plan, plan
from gamma_titan.recipes.spec import load_recipe


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


def plan_record(recipe, scale: str, runs: list[PlannedRun]) -> dict[str, Any]:
    return {"recipe": recipe.name, "recipe_file": str(recipe.path), "title": recipe.title, "figure": recipe.figure,
            "expect": recipe.expect, "scale": scale, "report": recipe.report, "grid": recipe.grid,
            "arms": list(recipe.arms), "claims": recipe.claims, "runs": [r.to_json() for r in runs]}


def _same_runs(a: Any, b: dict[str, Any]) -> bool:
    def key(rec: dict[str, Any]) -> list:
        runs = rec.get("runs")
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            return []
        return [(r.get("name"), r.get("config"), r.get("overrides")) for r in runs]

    return (isinstance(a, dict) and a.get("recipe") == b.get("recipe") and a.get("scale") == b.get("scale")
            and key(a) == key(b))


def check_out(out: Path, record: dict[str, Any]) -> None:
    """OUT must be new, empty, or hold this same plan (a rerun)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    existing = out / RECIPE_PLAN_FILE
    if existing.is_file():
        try:
            old = json.loads(existing.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ConfigError(f"--out {out}: {RECIPE_PLAN_FILE} is unreadable; choose another --out") from None
        if not _same_runs(old, json.loads(json.dumps(record))):
            what = f"recipe {old.get('recipe')} at scale {old.get('scale')}" if isinstance(old, dict) else "another plan"
            raise ConfigError(f"--out {out}: holds {what} with other runs (the recipe or its overrides "
                              "changed); choose another --out")
    elif out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty and holds no {RECIPE_PLAN_FILE}; choose another --out")


@dataclass
class Planned:
    """A recipe planned at a scale and checked against its output folder: what `execute` runs."""

    recipe: Any
    scale: str
    runs: list[PlannedRun]
    out: Path
    record: dict[str, Any]


def plan_recipe(name: str, scale: str, out: str | None = None, overrides: list[str] | None = None,
                steps: int | None = None, seeds: list[int] | None = None,
                allow_epochs: float | None = None) -> Planned:
    """Every check before anything runs: the recipe, each run's config at its world size, OUT."""
    recipe = load_recipe(name)
    runs = plan(recipe, scale, parse_overrides(overrides or []), steps, seeds, allow_epochs)
    out_dir = Path(out) if out else Path("runs") / f"{recipe.name}-{scale}"
    record = plan_record(recipe, scale, runs)
    check_out(out_dir, record)
    return Planned(recipe, scale, runs, out_dir, record)


def run_recipe(name: str, scale: str, launcher: str = "local", dry_run: bool = False, out: str | None = None,
               jobs: int = 1, overrides: list[str] | None = None, steps: int | None = None,
               seeds: list[int] | None = None, allow_epochs: float | None = None) -> int:
    if launcher not in ("local", "slurm"):
        raise ConfigError(f"--launcher {launcher}: allowed local, slurm")
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs}: must be >= 1")
    return execute(plan_recipe(name, scale, out, overrides, steps, seeds, allow_epochs), launcher, dry_run, jobs)


def execute(planned: Planned, launcher: str = "local", dry_run: bool = False, jobs: int = 1) -> int:
    """Print the plan, then (without --dry-run) train the runs here or submit them to SLURM."""
    from gamma_titan.data.cache import write_json_atomic

    recipe, scale, runs, out_dir, record = planned.recipe, planned.scale, planned.runs, planned.out, planned.record
    if launcher == "local" and any(r.nodes > 1 for r in runs):
        many = next(r for r in runs if r.nodes > 1)
        raise ConfigError(f"--launcher local: run {many.name} needs {many.nodes} nodes; use --launcher slurm")
    print(format_plan(recipe, scale, runs), flush=True)
    if launcher == "slurm":
        from gamma_titan.recipes import slurm
        from gamma_titan.recipes.local import is_finished

        sbatch = None if dry_run else slurm.check_sbatch()
        out_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_dir / RECIPE_PLAN_FILE, record)
        todo = [r for r in runs if not is_finished(out_dir / r.name, r.steps)]
        scripts = slurm.write_scripts(todo, recipe.scale(scale), out_dir, recipe.name)
        for path in scripts.values():
            print(f"wrote {path}")
        if dry_run:
            return 0
        submitted = slurm.submit(scripts, sbatch)
        jobs_file = out_dir / "slurm" / "jobs.json"
        previous = json.loads(jobs_file.read_text()) if jobs_file.is_file() else {}
        write_json_atomic(jobs_file, {**previous, **submitted})
        print(f"when the jobs are done: gamma-titan report recipe {out_dir}")
        return 1 if any(v.startswith("failed") for v in submitted.values()) else 0
    if dry_run:
        return 0
    from gamma_titan.recipes.local import run_local
    from gamma_titan.reports.recipe import write_report

    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / RECIPE_PLAN_FILE, record)
    status = run_local(runs, out_dir, jobs)
    previous = json.loads((out_dir / RECIPE_STATUS_FILE).read_text()) if (out_dir / RECIPE_STATUS_FILE).is_file() else {}
    write_json_atomic(out_dir / RECIPE_STATUS_FILE, {**previous, **{n: s for n, s in status.items() if s["status"] != "skipped"}})
    report = write_report(out_dir)
    text = report.read_text(encoding="utf-8")
    for section in ("## Tables", "## Claims"):  # the recipe's answer, here as well as in the file
        if section in text:
            print(section + text.split(section, 1)[1].split("\n## ", 1)[0].rstrip())
    print(f"report: {report}")
    failed = [n for n, s in status.items() if s["status"].startswith("failed")]
    if failed:
        print(f"{len(failed)} of {len(runs)} runs failed: {', '.join(failed)}")
    return 1 if failed else 0
