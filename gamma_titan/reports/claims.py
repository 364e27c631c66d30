"""The claims table: what the paper says that a recipe's runs test, and whether they agree.

A recipe lists its claims as `[[claims]]` tables:

    [[claims]]
    claim = "ε 1e-5 → 1e-12 lowers the loss at γ = 1"
    paper = "Fig. 1d: −0.038 (1.5B)"
    metric = "val_loss"            # val_loss (default) | val_loss/<source> | train_loss | sink_mean
    vary = "gamma.norm_eps"        # Δ = metric at values[1] − metric at values[0]
    values = [1e-5, 1e-12]
    at = { "gamma.init_rate" = 1.0 }
    expect = "<0"                  # the sign the paper reports: "<0" or ">0"
    minus_at = { "gamma.init_rate" = 0.5 }   # optional: Δ(at) − Δ(minus_at), an interaction
    best_over = "optimizer.lr"     # optional: each side at its best value of this key

Keys are the recipe's grid keys, arm keys, "arm" or "model". A varying key that the claim
fixes nowhere gives one row per value (a claim per width, per MoE size).

Statistics over seeds. A cell is the runs that differ only in their seed: n values with
mean m and sample standard deviation s. Δ = m₂ − m₁ has the pooled standard error
SE = √(s₁²/n₁ + s₂²/n₂); an interaction Δa − Δb has √(SEa² + SEb²). The verdict:
  agrees        |Δ| > NOISE_SE · SE with the paper's sign,
  disagrees     |Δ| > NOISE_SE · SE with the other sign,
  inconclusive  inside the noise, one seed only (no SE), or a best value at the edge of
                its grid (the optimum may lie outside it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import product
from statistics import mean, stdev
from typing import Any, Callable

from gamma_titan.errors import ConfigError
from gamma_titan.files import SOURCE_VAL_LOSS

#: A difference counts when it exceeds this many standard errors (≈ 95% two-sided).
NOISE_SE = 2.0
METRICS = ("val_loss", "train_loss", "sink_mean")
EXPECT = ("<0", ">0")
_KEYS = {"claim", "paper", "metric", "vary", "values", "at", "expect", "minus_at", "best_over"}


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class CellStats:
    n: int
    mean: float
    std: float | None  # None for one value

    @classmethod
    def of(cls, values: list[float]) -> "CellStats":
        return cls(len(values), mean(values), stdev(values) if len(values) > 1 else None)

    @property
    def se(self) -> float | None:
        return None if self.std is None else self.std / math.sqrt(self.n)

    def text(self, digits: int = 4) -> str:
        return f"{self.mean:.{digits}f}" + ("" if self.std is None else f" ± {self.std:.{digits}f}")


@dataclass(frozen=True)
class Difference:
    delta: float
    se: float | None  # None when a side has one seed

    def __sub__(self, other: "Difference") -> "Difference":
        se = None if self.se is None or other.se is None else math.hypot(self.se, other.se)
        return Difference(self.delta - other.delta, se)

    @property
    def exceeds_noise(self) -> bool | None:
        return None if self.se is None else abs(self.delta) > NOISE_SE * self.se

    def text(self, digits: int = 4) -> str:
        if self.se is None:
            return f"{self.delta:+.{digits}f}"
        ratio = abs(self.delta) / self.se if self.se > 0 else math.inf
        return f"{self.delta:+.{digits}f} ± {NOISE_SE * self.se:.{digits}f} ({ratio:.1f} SE)"


def difference(first: CellStats, second: CellStats) -> Difference:
    """second − first, with the pooled standard error."""
    if first.se is None or second.se is None:
        return Difference(second.mean - first.mean, None)
    return Difference(second.mean - first.mean, math.hypot(first.se, second.se))


def verdict(diff: Difference, expect: str) -> tuple[str, str]:
    """(agrees | disagrees | inconclusive, why)."""
    sign_agrees = diff.delta < 0 if expect == "<0" else diff.delta > 0
    if diff.se is None:
        return "inconclusive", f"one seed: no noise estimate (the sign {'agrees' if sign_agrees else 'disagrees'})"
    if not diff.exceeds_noise:
        return "inconclusive", f"|Δ| within {NOISE_SE:g} SE"
    return ("agrees", "") if sign_agrees else ("disagrees", "")


# --------------------------------------------------------------------------- the recipe file


def check_claims(claims: Any, keys: set[str], where: str) -> None:
    """One-line errors for a malformed [[claims]] list; `keys` are the keys a claim may name."""
    if not isinstance(claims, list) or not all(isinstance(c, dict) for c in claims):
        raise ConfigError(f"{where}: [[claims]] must be an array of tables")
    for i, c in enumerate(claims):
        at = f"{where} claims[{i}]"
        unknown = set(c) - _KEYS
        if unknown:
            raise ConfigError(f"{at}: unknown key {sorted(unknown)[0]!r}; allowed {', '.join(sorted(_KEYS))}")
        for key in ("claim", "vary", "values", "expect"):
            if key not in c:
                raise ConfigError(f"{at}: needs {key!r}")
        metric = c.get("metric", "val_loss")
        if metric not in METRICS and not (isinstance(metric, str) and metric.startswith(SOURCE_VAL_LOSS)
                                          and len(metric) > len(SOURCE_VAL_LOSS)):
            raise ConfigError(f"{at}.metric = {metric!r}: allowed {', '.join(METRICS)} or "
                              f"{SOURCE_VAL_LOSS}<source> (a mixture source's validation loss)")
        if c["expect"] not in EXPECT:
            raise ConfigError(f"{at}.expect = {c['expect']!r}: allowed {', '.join(EXPECT)}")
        if not isinstance(c["values"], list) or len(c["values"]) != 2:
            raise ConfigError(f"{at}.values: a list of two values (Δ = second − first)")
        named = [c["vary"], *c.get("at", {}), *c.get("minus_at", {})] + ([c["best_over"]] if "best_over" in c else [])
        for key in named:
            if key not in keys:
                raise ConfigError(f"{at}: {key!r} is not a key the recipe varies ({', '.join(sorted(keys))})")
        for table in ("at", "minus_at"):
            if not isinstance(c.get(table, {}), dict):
                raise ConfigError(f"{at}.{table}: a table of key = value")
        if "minus_at" in c and set(c["minus_at"]) != set(c.get("at", {})):
            raise ConfigError(f"{at}.minus_at: must fix the same keys as at")


# --------------------------------------------------------------------------- evaluation


@dataclass
class ClaimRow:
    claim: str
    paper: str
    where: str  # the values of the unfixed keys this row is for ("" if none)
    ours: str
    verdict: str
    why: str


def evaluate(claims: list[dict[str, Any]], runs: list[dict[str, Any]], value: Callable[[dict, str], Any],
             keys: list[str]) -> list[ClaimRow]:
    """Each claim against the finished runs; `value(run, key)` reads a run's setting, `keys`
    are the recipe's independent keys (grid keys, "arm", "model"). A run's metrics are
    `run["final"][metric]`, its cell `run["cell"]`."""
    rows = []
    varying = [k for k in keys if len({_hashable(value(r, k)) for r in runs}) > 1]
    for c in claims:
        metric = c.get("metric", "val_loss")
        fixed = {c["vary"], *c.get("at", {}), *([c["best_over"]] if "best_over" in c else [])}
        free = [k for k in varying if k not in fixed]
        free_values = [sorted({value(r, k) for r in runs}, key=_order) for k in free]
        for point in product(*free_values):
            extra = dict(zip(free, point))
            where = ", ".join(f"{k} = {_label(v)}" for k, v in extra.items())
            try:
                diff, note = _claim_difference(c, {**c.get("at", {}), **extra}, runs, value, metric)
                if "minus_at" in c:
                    other, other_note = _claim_difference(c, {**c["minus_at"], **extra}, runs, value, metric)
                    diff = diff - other
                    note = note if note.startswith("best ") else (other_note if other_note.startswith("best ")
                                                                 else "; ".join(filter(None, [note, other_note])))
            except LookupError as e:
                rows.append(ClaimRow(c["claim"], c.get("paper", ""), where, "–", "inconclusive", str(e)))
                continue
            result, why = verdict(diff, c["expect"])
            at_edge = note.startswith("best ")
            if at_edge and result != "inconclusive":
                result, why = "inconclusive", note
            else:
                why = "; ".join(filter(None, [why, note]))
            rows.append(ClaimRow(c["claim"], c.get("paper", ""), where, diff.text(), result, why))
    return rows


def _claim_difference(c: dict[str, Any], at: dict[str, Any], runs, value, metric: str) -> tuple[Difference, str]:
    """The claim's Δ at these settings, and a note: with best_over, each side's best value,
    and which of them lie at the edge of the grid (a note that makes the verdict inconclusive
    starts with "best ")."""
    sides, edges, best = [], [], []
    for v in c["values"]:
        stats, edge, best_value = _side(c, {**at, c["vary"]: v}, runs, value, metric)
        sides.append(stats)
        edges += [edge] if edge else []
        if best_value is not None:
            best.append(f"{_label(v)} {_label(best_value)}")
    if edges:
        return difference(*sides), "; ".join(edges)
    return difference(*sides), (f"at its best {c['best_over']}: " + ", ".join(best)) if best else ""


def _side(c, settings: dict[str, Any], runs, value, metric: str) -> tuple[CellStats, str, Any]:
    """The cell the settings pick (with best_over: its best value's cell), a note when that
    best value lies at the edge of its grid, and the best value (None without best_over)."""
    cells: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("finished") and r["final"].get(metric) is not None and \
                all(_same(value(r, k), v) for k, v in settings.items()):
            cells.setdefault(r["cell"], []).append(r)
    described = ", ".join(f"{k} = {_label(v)}" for k, v in settings.items())
    if not cells:
        raise LookupError(f"no finished run with {described}")
    stats = {cell: CellStats.of([r["final"][metric] for r in rs]) for cell, rs in cells.items()}
    best_over = c.get("best_over")
    if best_over is None:
        if len(stats) > 1:
            raise LookupError(f"{len(stats)} cells match {described}; fix more keys in the claim")
        return next(iter(stats.values())), "", None
    best = min(stats, key=lambda cell: stats[cell].mean)
    best_value = value(cells[best][0], best_over)
    options = sorted({value(r, best_over) for rs in cells.values() for r in rs}, key=_order)
    edge = ""
    if len(options) > 1 and best_value in (options[0], options[-1]):
        edge = f"best {best_over} = {_label(best_value)} at {described} lies at the grid's edge"
    return stats[best], edge, best_value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return a == b


def _hashable(x: Any) -> Any:
    return tuple(x) if isinstance(x, list) else x


def _order(x: Any) -> tuple:
    return (0, x, "") if isinstance(x, (int, float)) else (1, 0, str(x))


def _label(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def claims_table(rows: list[ClaimRow]) -> list[str]:
    """The markdown table a recipe report ends with."""
    lines = [f"## Claims (Δ ± {NOISE_SE:g} SE over seeds; a verdict needs |Δ| > {NOISE_SE:g} SE)", "",
             "| claim | the paper | where | ours: Δ | verdict | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.claim} | {r.paper} | {r.where or '–'} | {r.ours} | **{r.verdict}** | {r.why or ''} |")
    return lines + [""]
