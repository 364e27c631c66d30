"""Running a recipe with a `[tune]` table (gamma_titan/grid_search.py has the search): round after
round, plan what the searches want given the results in OUT, train it, repeat.

Locally the rounds follow each other in one call until every search has stopped and its
best value has every seed. With SLURM each call submits one round; the next call, once those
jobs are done, plans the next round from their results (`--dry-run` shows the round a call
would submit). OUT/recipe.json holds every run planned so far; a call that would drop one
of them (the recipe changed) is refused, as for any recipe.

A run counts as finished when its metrics reached its last step, as diverged when the
trainer stopped it on a non-finite step (exit EXIT_NONFINITE, recorded in status.json), and
as failed when it stopped otherwise in this call: its search stops, the others go on, and
the next call trains it again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from gamma_titan.errors import EXIT_NONFINITE
from gamma_titan.files import RECIPE_PLAN_FILE, RECIPE_STATUS_FILE
from gamma_titan.recipes.execute import Planned, check_out, finish_local, plan_record, submit_slurm, train_local
from gamma_titan.recipes.plan import PlannedRun, cost, format_plan, plan
from gamma_titan.recipes.spec import Recipe, Run, check_seeds
from gamma_titan.grid_search import DIVERGED, FAILED, SEARCHING, Search, wanted_runs
from gamma_titan.reports.run_metrics import final_values, read_metrics

Key = tuple[str, "str | None", int, int]  # (model label, arm, grid index, seed)


class TunedPlanner:
    def __init__(self, recipe: Recipe, scale: str, out: Path, extra: dict[str, Any], steps: int | None,
                 seeds: list[int] | None, allow_epochs: float | None) -> None:
        self.recipe, self.scale, self.out, self.extra = recipe, scale, out, extra
        self.steps, self.allow_epochs = steps, allow_epochs
        self.tune = recipe.tune_for(scale)
        self.seeds = check_seeds(seeds, "--seeds") if seeds is not None else recipe.scale(scale).seeds
        self.models = {m.label: m for m in recipe.scale(scale).models}
        self.arms = list(recipe.arms) or [None]
        self.checked: dict[str, PlannedRun] = {}  # cell -> its checked config, across rounds
        self.failed: set[str] = set()  # runs that failed in this call (not diverged)
        self.states: list[tuple[Search, str, int | None]] = []
        self.round = 0

    # --- planning ---------------------------------------------------------------------

    def run(self, key: Key) -> Run:
        model, arm, index, seed = key
        return self.recipe.run(self.scale, self.models[model], arm, {self.tune.key: self.tune.value(index)}, seed)

    def _plan(self, keys: list[Key]) -> list[PlannedRun]:
        return plan(self.recipe, self.scale, self.extra, self.steps, list(self.seeds), self.allow_epochs,
                    runs=[self.run(k) for k in keys], checked=self.checked)

    def _known(self) -> set[Key]:
        """The runs OUT's recipe.json planned before (kept, finished or not)."""
        path = self.out / RECIPE_PLAN_FILE
        try:
            record = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError):
            return set()  # check_out names the unreadable file
        if not isinstance(record, dict) or (record.get("recipe"), record.get("scale")) != (self.recipe.name, self.scale):
            return set()
        known = set()
        for r in record.get("runs", []):
            try:
                value = r["values"][self.tune.key]
                if r["model_label"] in self.models and r["arm"] in self.arms and isinstance(r["seed"], int):
                    known.add((r["model_label"], r["arm"], self.tune.index(value), r["seed"]))
            except (KeyError, TypeError, ValueError):
                continue  # a run of another plan: check_out refuses the folder
        return known

    def result(self, name: str, steps: int) -> float | str | None:
        """A run's final validation loss, DIVERGED, "failed", or None (not finished)."""
        if name in self.failed:
            return "failed"
        status_file = self.out / RECIPE_STATUS_FILE
        status = json.loads(status_file.read_text(encoding="utf-8")) if status_file.is_file() else {}
        if status.get(name, {}).get("status") == f"failed (exit {EXIT_NONFINITE})":
            return DIVERGED
        records = read_metrics(self.out / name)
        if not records or records[-1]["step"] < steps:
            return None
        loss = final_values(records)["val_loss"]
        if loss is None:
            return "failed"  # finished without a validation loss: nothing to compare
        return loss if math.isfinite(loss) else DIVERGED

    def plan(self):
        """The runs the searches want now (every run planned before included), checked; and
        the searches' states."""
        first = [(m, a, i, self.seeds[0]) for m in self.models for a in self.arms for i in self.tune.first_grid]
        steps = {r.model_label: r.steps for r in self._plan(first)}  # a model's runs share its steps

        def result(model: str, arm: str | None, index: int, seed: int) -> float | str | None:
            return self.result(self.run((model, arm, index, seed)).name, steps[model])

        keys, self.states = wanted_runs(self.tune, list(self.models), self.arms, self.seeds, result, self._known())
        runs = self._plan(keys)
        record = {**plan_record(self.recipe, self.scale, runs),
                  "grid": {self.tune.key: sorted({r.values[self.tune.key] for r in runs})},
                  "tune": self.tune.to_json(), "seeds": list(self.seeds)}
        check_out(self.out, record)
        self.round += 1
        return Planned(self.recipe, self.scale, runs, self.out, record, tuner=self)

    def todo(self, runs: list[PlannedRun]) -> list[PlannedRun]:
        """The runs with no result yet (not finished, diverged or failed)."""
        return [r for r in runs if self.result(r.name, r.steps) is None]

    # --- what it prints ---------------------------------------------------------------

    def search_lines(self) -> list[str]:
        lines = []
        for search, status, best in self.states:
            tried = ", ".join(f"{self.tune.value(i):g} ({_result_text(search.losses.get(i))})"
                              for i in sorted(search.losses))
            head = f"  {search.model} {search.arm or ''}".rstrip()
            lines.append(f"{head}: {status}" + (f", best {self.tune.key} {self.tune.value(best):g}"
                                                 if best is not None else "") + f"; {tried}")
        return lines

    def outlook(self, runs: list[PlannedRun]) -> str:
        """This round's runs and cost, and the most the searches can still add."""
        scale = self.recipe.scale(self.scale)
        todo = self.todo(runs)
        by_search = {(r.model_label, r.arm): r for r in runs}
        more: list[PlannedRun] = []
        for search, status, best in self.states:
            if status != SEARCHING:
                continue
            tried = set(search.losses)
            run = by_search[(search.model, search.arm)]
            untried = [i for i in range(self.tune.lowest, self.tune.highest + 1) if i not in tried]
            more += [run] * (len(untried) + len(self.seeds) - 1)
        return (f"round {self.round}: {len(todo)} of {len(runs)} runs to train ≈ {cost(scale, todo)}; "
                f"the searches can add at most {len(more)} more ≈ {cost(scale, more)} (every value to "
                f"[{self.tune.value(self.tune.lowest):g}, {self.tune.value(self.tune.highest):g}], then the "
                "other seeds at each best), typically one or two per search")

    # --- running ----------------------------------------------------------------------

    def execute(self, planned, launcher: str, dry_run: bool, jobs: int) -> int:
        print(format_plan(self.recipe, self.scale, planned.runs), flush=True)
        print("searches:\n" + "\n".join(self.search_lines()), flush=True)
        print(self.outlook(planned.runs), flush=True)
        if launcher == "slurm":
            code = submit_slurm(planned, self.todo(planned.runs), dry_run)
            if not dry_run and self.todo(planned.runs):
                print("when these jobs are done, run this command again: it plans the next round from their results")
            return code
        if dry_run:
            return 0
        while True:
            todo = self.todo(planned.runs)
            if not todo:
                break
            status = train_local(planned, todo, jobs)
            self.failed |= {n for n, s in status.items()
                            if s["status"].startswith("failed") and s["status"] != f"failed (exit {EXIT_NONFINITE})"}
            planned = self.plan()
            print(f"searches after round {self.round - 1}:\n" + "\n".join(self.search_lines()), flush=True)
            if self.todo(planned.runs):
                print(self.outlook(planned.runs), flush=True)
        from gamma_titan.data.cache import write_json_atomic

        write_json_atomic(self.out / RECIPE_PLAN_FILE, planned.record)  # the last round's plan, for the report
        failed = sorted(self.failed)
        stopped = [f"{s.model} {s.arm}" for s, status, _ in self.states if status == FAILED]
        if stopped:
            print(f"searches stopped by a failed run: {', '.join(stopped)}; run the same command again to retry")
        return finish_local(planned, failed)


def _result_text(loss: float | None) -> str:
    return "to train" if loss is None else "diverged" if loss == DIVERGED else f"{loss:.4f}"
