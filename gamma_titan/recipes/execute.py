"""A planned recipe and what runs it: the plan record in OUT/recipe.json (a second plan into
the same folder is refused, so no run's results get mixed with another's), then --dry-run,
local training with the report, or one SLURM job per unfinished run. recipes/run.py plans;
a tuned recipe's planner (recipes/tuned.py) runs its rounds with the pieces here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import read_json
from gamma_titan.files import RECIPE_PLAN_FILE, RECIPE_RECORD_HINT, RECIPE_STATUS_FILE
from gamma_titan.recipes.plan import PlannedRun, format_plan


def plan_record(recipe, scale: str, runs: list[PlannedRun]) -> dict[str, Any]:
    return {"recipe": recipe.name, "recipe_file": str(recipe.path), "title": recipe.title, "figure": recipe.figure,
            "expect": recipe.expect, "scale": scale, "report": recipe.report, "grid": recipe.grid,
            "arms": list(recipe.arms), "claims": recipe.claims, "runs": [r.to_json() for r in runs]}


def _same_runs(a: Any, b: dict[str, Any], grows: bool = False) -> bool:
    """Whether plan `a` (read from OUT) has the runs of plan `b`; with `grows` (a tuned recipe
    adds runs round by round), whether b keeps every run of a."""
    def key(rec: dict[str, Any]) -> list:
        runs = rec.get("runs")
        if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
            return []
        return [json.dumps([r.get("name"), r.get("config"), r.get("overrides")], sort_keys=True) for r in runs]

    if not (isinstance(a, dict) and a.get("recipe") == b.get("recipe") and a.get("scale") == b.get("scale")):
        return False
    return set(key(a)) <= set(key(b)) if grows else key(a) == key(b)


def check_out(out: Path, record: dict[str, Any]) -> None:
    """OUT must be new, empty, or hold this same plan (a rerun; for a tuned recipe, a plan
    this one extends)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder")
    existing = out / RECIPE_PLAN_FILE
    if existing.is_file():
        old = read_json(existing, "choose another --out")
        if not _same_runs(old, json.loads(json.dumps(record)), grows="tune" in record):
            what = f"recipe {old.get('recipe')} at scale {old.get('scale')}" if isinstance(old, dict) else "another plan"
            raise ConfigError(f"--out {out}: holds {what} with other runs (the recipe or its overrides "
                              "changed); choose another --out")
    elif out.is_dir() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: not empty and holds no {RECIPE_PLAN_FILE}; choose another --out")


@dataclass
class Planned:
    """A recipe planned at a scale and checked against its output folder: what `execute` runs
    (a tuned recipe: this round, with the planner that plans the next)."""

    recipe: Any
    scale: str
    runs: list[PlannedRun]
    out: Path
    record: dict[str, Any]
    tuner: Any = None  # recipes/tuned.TunedPlanner
    site: Any = None  # gamma_titan/slurm/site.Site: the SLURM settings (--launcher slurm)


def execute(planned: Planned, launcher: str = "local", dry_run: bool = False, jobs: int = 1) -> int:
    """Print the plan, then (without --dry-run) train the runs here or submit them to SLURM."""
    if launcher == "local" and any(r.nodes > 1 for r in planned.runs):
        many = next(r for r in planned.runs if r.nodes > 1)
        raise ConfigError(f"--launcher local: run {many.name} needs {many.nodes} nodes; use --launcher slurm")
    if planned.tuner is not None:
        return planned.tuner.execute(planned, launcher, dry_run, jobs)
    print(format_plan(planned.recipe, planned.scale, planned.runs), flush=True)
    if launcher == "slurm":
        return submit_slurm(planned, planned.runs, dry_run)
    if dry_run:
        return 0
    status = train_local(planned, planned.runs, jobs)
    return finish_local(planned, [n for n, s in status.items() if s["status"].startswith("failed")])


def submit_slurm(planned: Planned, runs: list[PlannedRun], dry_run: bool) -> int:
    """Write the sbatch scripts of the unfinished `runs` (and recipe.json); submit them unless
    `dry_run`."""
    from gamma_titan.data.cache import write_json_atomic
    from gamma_titan.recipes import slurm
    from gamma_titan.recipes.local import is_finished

    from gamma_titan.slurm.scheduler import command
    from gamma_titan.slurm.site import Site

    recipe, out_dir = planned.recipe, planned.out
    if not dry_run:
        command("sbatch", "--launcher slurm; use --dry-run to only write the scripts")
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / RECIPE_PLAN_FILE, planned.record)
    todo = [r for r in runs if not is_finished(out_dir / r.name, r.steps)]
    jobs = slurm.write_scripts(todo, recipe.scale(planned.scale), out_dir, recipe.name, planned.site or Site())
    for job in jobs.values():
        print(f"wrote {job.script}")
    if dry_run:
        return 0
    submitted = slurm.submit(jobs)
    jobs_file = out_dir / "slurm" / "jobs.json"
    previous = read_json(jobs_file, RECIPE_RECORD_HINT) if jobs_file.is_file() else {}
    write_json_atomic(jobs_file, {**previous, **submitted})
    print(f"when the jobs are done: gamma-titan report recipe {out_dir}")
    return 1 if any(v.startswith("failed") for v in submitted.values()) else 0


def train_local(planned: Planned, runs: list[PlannedRun], jobs: int) -> dict[str, dict]:
    """Write recipe.json, train the unfinished `runs` here, and record their status."""
    from gamma_titan.data.cache import write_json_atomic
    from gamma_titan.recipes.local import run_local

    out_dir = planned.out
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out_dir / RECIPE_PLAN_FILE, planned.record)
    status = run_local(runs, out_dir, jobs)
    path = out_dir / RECIPE_STATUS_FILE
    previous = read_json(path, RECIPE_RECORD_HINT) if path.is_file() else {}
    write_json_atomic(path, {**previous, **{n: s for n, s in status.items() if s["status"] != "skipped"}})
    return status


def finish_local(planned: Planned, failed: list[str]) -> int:
    """Write the report, print its answer, and say which runs failed."""
    from gamma_titan.reports.recipe import write_report

    report = write_report(planned.out)
    text = report.read_text(encoding="utf-8")
    for section in ("## Tables", "## Tuned ladder", "## Claims"):  # the recipe's answer, here and in the file
        if section in text:
            print(section + text.split(section, 1)[1].split("\n## ", 1)[0].rstrip())
    print(f"report: {report}")
    if failed:
        print(f"{len(failed)} of {len(planned.runs)} runs failed: {', '.join(failed)}")
    return 1 if failed else 0
