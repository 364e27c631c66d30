"""A recipe's `[tune]` table: one setting (the learning rate) searched per model and arm
until the best value is bracketed, then the best value trained with more seeds.

    [tune]
    key = "optimizer.lr"
    start = 1e-3        # the first grid: start .. stop, per_decade points per decade
    stop = 1e-2
    per_decade = 2      # 1e-3, 3.16e-3, 1e-2
    lowest = 1e-4       # the search goes no further than these
    highest = 0.316

Values lie on a log grid, 10^(i / per_decade) for integer i, and the search works on the
indices i (no float comparisons). One search is a (model, arm): it trains the scale's first
seed at every grid value; when the lowest loss lies at an edge of what it has tried, it adds
the next value beyond that edge, a round at a time, until the best has a tried neighbour on
both sides (bracketed) or the next value would pass `lowest` / `highest` (the report then
says the optimum may lie outside). A run that diverged (the trainer's non-finite stop)
counts as worse than any finite loss. Once a search has stopped, its best value is trained
with the scale's other seeds.

Everything here is a function of the results so far, so a rerun of the recipe (locally, or
after a SLURM round) plans exactly the runs still missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from gamma_titan.errors import ConfigError

#: What a finished search says of its best value.
BRACKETED = "bracketed"
AT_LOWEST = "best at the lowest value allowed"
AT_HIGHEST = "best at the highest value allowed"
SEARCHING = "searching"
FAILED = "a run failed"
DIVERGED = math.inf  # the loss a diverged run counts as


@dataclass(frozen=True)
class Tune:
    key: str
    start: int  # grid indices: value = 10 ** (index / per_decade)
    stop: int
    per_decade: int
    lowest: int
    highest: int

    def value(self, index: int) -> float:
        return float(f"{10 ** (index / self.per_decade):.6g}")  # 0.00316228, as a run label shows it

    def index(self, value: float) -> int:
        return round(math.log10(value) * self.per_decade)

    @property
    def first_grid(self) -> list[int]:
        return list(range(self.start, self.stop + 1))

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "Tune":
        """The Tune that `to_json` wrote (recipe.json; the report reads it)."""
        per = raw["per_decade"]
        return cls(key=raw["key"], per_decade=per,
                   **{k: round(math.log10(raw[k]) * per) for k in ("start", "stop", "lowest", "highest")})

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "start": self.value(self.start), "stop": self.value(self.stop),
                "per_decade": self.per_decade, "lowest": self.value(self.lowest),
                "highest": self.value(self.highest)}


def parse_tune(raw: Any, where: str, keys_set_elsewhere: set[str]) -> Tune | None:
    """The recipe's [tune] table (None without one), with one-line errors."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} [tune]: a table")
    allowed = {"key", "start", "stop", "per_decade", "lowest", "highest"}
    unknown = set(raw) - allowed
    if unknown:
        raise ConfigError(f"{where} [tune]: unknown key {sorted(unknown)[0]!r}; allowed {', '.join(sorted(allowed))}")
    missing = [k for k in sorted(allowed) if k not in raw]
    if missing:
        raise ConfigError(f"{where} [tune]: needs {missing[0]!r}")
    key = raw["key"]
    if not isinstance(key, str) or "." not in key:
        raise ConfigError(f"{where} [tune] key = {key!r}: a config key such as \"optimizer.lr\"")
    if key in keys_set_elsewhere:
        raise ConfigError(f"{where} [tune] key = {key!r}: the recipe also sets it in [set], [grid] or an arm")
    per_decade = raw["per_decade"]
    if not isinstance(per_decade, int) or isinstance(per_decade, bool) or not 1 <= per_decade <= 10:
        raise ConfigError(f"{where} [tune] per_decade = {per_decade!r}: an integer from 1 to 10")
    indices = {}
    for name in ("start", "stop", "lowest", "highest"):
        value = raw[name]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where} [tune] {name} = {value!r}: a positive number")
        index = round(math.log10(value) * per_decade)
        if not math.isclose(10 ** (index / per_decade), value, rel_tol=1e-3):
            near = ", ".join(f"{10 ** (i / per_decade):.6g}" for i in (index - 1, index, index + 1))
            raise ConfigError(f"{where} [tune] {name} = {value!r}: not on the grid of {per_decade} values per "
                              f"decade (10^(i/{per_decade})); nearest {near}")
        indices[name] = index
    if not indices["lowest"] <= indices["start"] < indices["stop"] <= indices["highest"]:
        raise ConfigError(f"{where} [tune]: needs lowest <= start < stop <= highest")
    return Tune(key=key, per_decade=per_decade, **indices)


@dataclass
class Search:
    """One model × arm: the grid indices tried with the search seed, their losses (None: not
    finished, DIVERGED, or a failure), and what that says."""

    model: str
    arm: str | None
    losses: dict[int, float | None]
    failed: set[int] = field(default_factory=set)  # runs that failed without diverging

    def state(self, tune: Tune) -> tuple[str, int | None, set[int]]:
        """(status, best index or None, the indices the search wants trained): the first grid
        and everything tried, plus the next value past an edge that holds the best."""
        wanted = set(tune.first_grid) | set(self.losses)
        if self.failed & wanted:
            return FAILED, None, wanted
        if any(self.losses.get(i) is None for i in wanted):
            return SEARCHING, None, wanted
        best = min(sorted(wanted), key=lambda i: self.losses[i])  # ties: the lower value
        if best == min(wanted):
            if best - 1 < tune.lowest:
                return AT_LOWEST, best, wanted
            return SEARCHING, None, wanted | {best - 1}
        if best == max(wanted):
            if best + 1 > tune.highest:
                return AT_HIGHEST, best, wanted
            return SEARCHING, None, wanted | {best + 1}
        return BRACKETED, best, wanted


def wanted_runs(tune: Tune, models: list[str], arms: list[str | None], seeds: tuple[int, ...],
                result: Callable[[str, str | None, int, int], float | str | None],
                known: set[tuple[str, str | None, int, int]] = frozenset(),
                ) -> tuple[list[tuple[str, str | None, int, int]], list[tuple[Search, str, int | None]]]:
    """The runs the searches want now — (model, arm, index, seed), every run already known
    included — and each search with its status and best index. `result(model, arm, index,
    seed)` is the run's final loss, DIVERGED, "failed", or None when it has not finished;
    `known` holds the runs planned before (a rerun keeps them, finished or not)."""
    runs: list[tuple[str, str | None, int, int]] = []
    states = []
    for model in models:
        for arm in arms:
            search = Search(model, arm, {})
            tried = set(tune.first_grid) | {i for (m, a, i, s) in known if (m, a, s) == (model, arm, seeds[0])}
            while True:  # results already there may settle several rounds at once
                for i in tried:
                    got = result(model, arm, i, seeds[0])
                    if got == "failed":
                        search.failed.add(i)
                        search.losses[i] = None
                    else:
                        search.losses[i] = got
                status, best, want = search.state(tune)
                if want == tried:
                    break
                tried = want
            search_runs = [(model, arm, i, seeds[0]) for i in sorted(tried)]
            more_seeds = {(model, arm, best, s) for s in seeds[1:]} if best is not None else set()
            more_seeds |= {k for k in known if k[:2] == (model, arm) and k[3] != seeds[0]}
            runs += search_runs + sorted(more_seeds, key=lambda k: (k[2], k[3]))
            states.append((search, status, best))
    return runs, states
