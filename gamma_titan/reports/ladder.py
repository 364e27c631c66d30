"""The tuned ladder: a recipe with [tune] compared at each arm's best value, width by width
(reports/recipe.py adds this section to its report).

Per model and arm: the search's losses (the first seed) and its best value, found as the
search found it (gamma_titan/grid_search.py: lowest loss, ties to the lower value), bracketed or at a
limit; the best value's loss over every seed (mean ± std). Per model: Δ = second arm − first
arm (the recipe's arm order: standard, then small) with its pooled standard error.

Over the ladder, from the best-value means:
- per arm, L(N) = E + A·N^(−α) (N: non-embedding parameters, each arm its own: the gate's
  parameters count) and the effective-size gain N_first(L_second(N)) / N at each width;
- the slope of Δ against ln(width), given per doubling of the width;
- 95% intervals for both from BOOTSTRAP resamples: each cell's seeds drawn with replacement,
  everything refitted. With two seeds per cell this is a lower bound on the uncertainty;
  the search's choice of best (on the first seed) is not redone in a resample.

The verdicts use the claims table's words (reports/claims.py): a Δ per width as any claim;
the slope disagrees with "the gain holds" when its whole interval lies above 0 (Δ rises
toward 0 as the width grows) and agrees when it lies below; the effective-size gain at the
largest width agrees when its interval lies above 1. A best value at a search's limit makes
the rows that use it inconclusive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gamma_titan.errors import EXIT_NONFINITE
from gamma_titan.grid_search import BRACKETED, DIVERGED, Search, Tune
from gamma_titan.reports.claims import CellStats, ClaimRow, Difference, difference, verdict
from gamma_titan.reports.scaling import PowerLaw, effective_size_gain, fit_power_law

BOOTSTRAP = 1000
INTERVAL = (2.5, 97.5)  # percent: a 95% interval
PAPER_GAIN = 1.79


@dataclass
class Arm:
    """One model × arm of the ladder."""

    model: str
    arm: str
    width: int
    params: int  # non-embedding
    status: str  # gamma_titan/grid_search.py: bracketed, at a limit, searching, failed
    best: float | None  # the best value of the tuned key
    tried: dict[float, float]  # value -> the first seed's loss (inf: diverged)
    seeds: list[float] = field(default_factory=list)  # the best value's loss per finished seed

    @property
    def stats(self) -> CellStats | None:
        return CellStats.of(self.seeds) if self.seeds else None


@dataclass
class Ladder:
    key: str
    arms: list[str]  # [first (the baseline), second]
    rows: list[tuple[Arm, Arm]]  # per model with both arms' best losses, in width order
    pending: list[tuple[Arm, Arm]]  # models whose searches or seeds are not finished
    fits: dict[str, PowerLaw]
    gains: list[float]  # per row: N_first(L_second(N)) / N at the second arm's N
    gain_intervals: list[tuple[float, float]]
    slope: float | None  # Δ per doubling of the width
    slope_interval: tuple[float, float] | None

    @property
    def deltas(self) -> list[Difference]:
        return [difference(a.stats, b.stats) for a, b in self.rows]


def _search_arm(plan: dict[str, Any], runs: list[dict[str, Any]], tune: Tune, model: str, arm: str) -> Arm:
    key, seeds = tune.key, plan["seeds"]
    mine = [r for r in runs if r["model_label"] == model and r["arm"] == arm]
    search = Search(model, arm, {})
    for r in mine:
        if r["seed"] != seeds[0]:
            continue
        index = tune.index(r["values"][key])
        loss = r["final"]["val_loss"] if r["finished"] else None
        if r["status"] == f"failed (exit {EXIT_NONFINITE})" or (loss is not None and not math.isfinite(loss)):
            loss = DIVERGED
        search.losses[index] = loss
    status, best, _ = search.state(tune)
    tried = {tune.value(i): v for i, v in sorted(search.losses.items()) if v is not None}
    arm_ = Arm(model, arm, mine[0]["width"], mine[0]["params_non_embedding"], status,
               tune.value(best) if best is not None else None, tried)
    if best is not None:
        arm_.seeds = [r["final"]["val_loss"] for r in mine if r["finished"] and tune.index(r["values"][key]) == best
                      and r["final"]["val_loss"] is not None and math.isfinite(r["final"]["val_loss"])]
    return arm_


def _fits(rows: list[tuple[Arm, Arm]], means: list[tuple[float, float]]) -> dict[int, PowerLaw]:
    """Per arm (0, 1): the power law through the rows' best means, with three or more rows."""
    fits = {}
    for side in (0, 1):
        points = [(pair[side].params, m[side]) for pair, m in zip(rows, means)]
        if len(points) >= 3:
            fits[side] = fit_power_law(*zip(*points))
    return fits


def _gains(rows, fits) -> list[float]:
    if len(fits) < 2:
        return []
    return [effective_size_gain(fits[0], fits[1], b.params) for _, b in rows]


def _slope(rows, means) -> float | None:
    if len(rows) < 2:
        return None
    x = np.log([a.width for a, _ in rows])
    d = np.array([m[1] - m[0] for m in means])
    return float(np.polyfit(x, d, 1)[0] * math.log(2))


def _interval(values: list[float]) -> tuple[float, float]:
    """Percentile interval; works with inf (a resample whose gain is unreachable)."""
    v = sorted(values)
    lo = v[int(len(v) * INTERVAL[0] / 100)]
    hi = v[min(len(v) - 1, int(math.ceil(len(v) * INTERVAL[1] / 100)) - 1)]
    return lo, hi


def analyse(plan: dict[str, Any], runs: list[dict[str, Any]], resamples: int = BOOTSTRAP,
            seed: int = 0) -> Ladder:
    tune = Tune.from_json(plan["tune"])
    arms = list(plan["arms"])
    models = list(dict.fromkeys(r["model_label"] for r in runs))
    pairs = [tuple(_search_arm(plan, runs, tune, m, a) for a in arms[:2]) for m in models]
    pairs.sort(key=lambda p: p[0].width)
    rows = [p for p in pairs if p[0].stats and p[1].stats]
    means = [(a.stats.mean, b.stats.mean) for a, b in rows]
    fits = _fits(rows, means)
    gains, slope = _gains(rows, fits), _slope(rows, means)
    gain_samples: list[list[float]] = [[] for _ in rows]
    slope_samples: list[float] = []
    rng = np.random.default_rng(seed)
    if rows and (gains or slope is not None):
        for _ in range(resamples):
            sample = [tuple(float(np.mean(rng.choice(arm.seeds, size=len(arm.seeds)))) for arm in pair)
                      for pair in rows]
            if gains:
                try:
                    for i, g in enumerate(_gains(rows, _fits(rows, sample))):
                        gain_samples[i].append(g)
                except (ValueError, FloatingPointError, np.linalg.LinAlgError):
                    pass
            if slope is not None:
                slope_samples.append(_slope(rows, sample))
    named = {arms[side]: f for side, f in fits.items()}
    return Ladder(tune.key, arms[:2], rows, [p for p in pairs if p not in rows], named, gains,
                  [_interval(s) for s in gain_samples] if gains and gain_samples[0] else [],
                  slope, _interval(slope_samples) if slope_samples else None)


# --- the report ------------------------------------------------------------------------


def _g(x: float | None) -> str:
    return "–" if x is None else f"{x:g}"


def _gain_text(g: float) -> str:
    return "∞ (below the baseline's floor E)" if math.isinf(g) else f"{g:.3f}"


def claims(ladder: Ladder) -> list[ClaimRow]:
    """The ladder's verdicts, in the claims table's words."""
    first, second = ladder.arms
    rows = []
    limited = {f"{a.model} {a.arm}": a.status for pair in ladder.rows for a in pair if a.status != BRACKETED}
    claim = f"{second} beats {first}, each at its best {ladder.key}"
    for a, _ in ladder.pending:
        rows.append(ClaimRow(claim, "Fig. 2a (tuned rates)", f"width {a.width}", "–", "inconclusive", "not finished"))
    for (a, b), diff in zip(ladder.rows, ladder.deltas):
        where = f"width {a.width}"
        result, why = verdict(diff, "<0")
        edge = [f"{x.arm}: {x.status}" for x in (a, b) if x.status != BRACKETED]
        if edge:
            result, why = "inconclusive", "; ".join(edge)
        rows.append(ClaimRow(claim, "Fig. 2a (tuned rates)", where, diff.text(),
                             result, why or f"best {ladder.key}: {_g(a.best)} / {_g(b.best)}"))
    note = f"best values at a limit: {', '.join(limited)}" if limited else ""
    if ladder.slope is not None and ladder.slope_interval is not None:
        lo, hi = ladder.slope_interval
        result = "disagrees" if lo > 0 else "agrees" if hi < 0 else "inconclusive"
        why = {"disagrees": "Δ rises toward 0 as the width grows: the gain shrinks",
               "agrees": "Δ falls as the width grows: the gain grows",
               "inconclusive": "the interval holds 0"}[result]
        rows.append(ClaimRow("the gain holds as the model grows", "≈ 1.79× effective size at every size",
                             f"slope of Δ per doubling of width, widths {ladder.rows[0][0].width}–"
                             f"{ladder.rows[-1][0].width}", f"{ladder.slope:+.4f} [{lo:+.4f}, {hi:+.4f}]",
                             "inconclusive" if limited and result != "inconclusive" else result,
                             "; ".join(filter(None, [why, note]))))
    if ladder.gains and ladder.gain_intervals:
        g, (lo, hi) = ladder.gains[-1], ladder.gain_intervals[-1]
        result = "agrees" if lo > 1 else "disagrees" if hi <= 1 else "inconclusive"
        a, b = ladder.rows[-1]
        rows.append(ClaimRow(f"{second}'s effective model size exceeds {first}'s", f"≈ {PAPER_GAIN}×",
                             f"width {a.width} (the largest)", f"{_gain_text(g)} [{_gain_text(lo)}, {_gain_text(hi)}]",
                             "inconclusive" if limited and result != "inconclusive" else result,
                             note or f"the paper's {PAPER_GAIN}× lies {'inside' if lo <= PAPER_GAIN <= hi else 'outside'} the interval"))
    return rows


def section(ladder: Ladder, seeds: int) -> list[str]:
    """The report's markdown: best values per width, fits, gains, slope."""
    first, second = ladder.arms
    k = ladder.key.rsplit(".", 1)[-1]
    lines = [f"## Tuned ladder: each arm at its best {ladder.key}", "",
             f"The best {k} is the lowest validation loss of the search (first seed); its loss is the mean ± std "
             f"over the {seeds} seeds trained there. Δ = {second} − {first}, ± 2 SE (* beyond the noise).", "",
             f"| model | width | N (non-emb.) {first} / {second} | {first}: best {k} | loss | {second}: best {k} | "
             f"loss | Δ | searches |", "|---|---|---|---|---|---|---|---|---|"]
    for (a, b) in sorted(ladder.rows + ladder.pending, key=lambda p: p[0].width):
        diff = difference(a.stats, b.stats) if a.stats and b.stats else None
        lines.append(
            f"| {a.model} | {a.width} | {a.params:,} / {b.params:,} | {_g(a.best)} | "
            f"{a.stats.text(4) if a.stats else '–'} | {_g(b.best)} | {b.stats.text(4) if b.stats else '–'} | "
            f"{diff.text(4) + (' *' if diff.exceeds_noise else '') if diff else '–'} | {a.status} / {b.status} |")
    lines += ["", f"Every {k} tried (first seed; validation loss):", ""]
    for pair in sorted(ladder.rows + ladder.pending, key=lambda p: p[0].width):
        for a in pair:
            tried = ", ".join(f"{v:g}: {'diverged' if math.isinf(x) else f'{x:.4f}'}" for v, x in a.tried.items())
            lines.append(f"- {a.model} {a.arm}: {tried}")
    lines.append("")
    if ladder.fits:
        lines += [f"**Fit of the best-{k} loss** L(N) = E + A·N^(−α), N = non-embedding parameters:", "",
                  "| arm | E | A | α |", "|---|---|---|---|"]
        lines += [f"| {name} | {f.E:.4f} | {f.A:.4g} | {f.alpha:.4f} |" for name, f in ladder.fits.items()]
        lines.append("")
    if ladder.gains:
        lines += [f"**Effective model-size gain** of {second}: the parameters {first} needs to reach its loss, "
                  f"over its own (the paper: ≈ {PAPER_GAIN}); 95% bootstrap interval over seeds "
                  f"({BOOTSTRAP} resamples).", "", "| width | gain | interval |", "|---|---|---|"]
        for (a, _), g, iv in zip(ladder.rows, ladder.gains, ladder.gain_intervals or [None] * len(ladder.gains)):
            lines.append(f"| {a.width} | {_gain_text(g)} | "
                         + (f"[{_gain_text(iv[0])}, {_gain_text(iv[1])}]" if iv else "–") + " |")
        lines.append("")
    if ladder.slope is not None:
        iv = ladder.slope_interval
        lines += [f"**Δ against width:** {ladder.slope:+.4f} per doubling of the width"
                  + (f" (95% bootstrap interval [{iv[0]:+.4f}, {iv[1]:+.4f}])" if iv else "") + ".", ""]
    return lines


def plot(ladder: Ladder, path: Path) -> bool:
    """Loss against non-embedding parameters: every value tried (faint), the best ones with
    their seed spread, the fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not ladder.rows:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, name in enumerate(ladder.arms):
        arms = [pair[side] for pair in ladder.rows]
        color = f"C{side}"
        for a in arms:
            finite = [x for x in a.tried.values() if math.isfinite(x)]
            ax.scatter([a.params] * len(finite), finite, color=color, alpha=0.25, s=14)
        best = [a for a in arms if a.stats]
        ax.errorbar([a.params for a in best], [a.stats.mean for a in best],
                    yerr=[a.stats.std or 0.0 for a in best], color=color, marker="o", linestyle="", capsize=3,
                    label=f"{name} at its best {ladder.key.rsplit('.', 1)[-1]}")
        for a in best:
            ax.annotate(f"{a.best:g}", (a.params, a.stats.mean), textcoords="offset points", xytext=(5, 4),
                        fontsize=7, color=color)
        if name in ladder.fits:
            grid = np.geomspace(min(a.params for a in best), max(a.params for a in best), 100)
            f = ladder.fits[name]
            ax.plot(grid, f(grid), color=color, label=f"{name}: {f.E:.3f} + {f.A:.3g}·N^-{f.alpha:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("final validation loss")
    ax.set_title("faint: every value tried (first seed); labels: the best value", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
