"""`gamma-titan report recipe RUN_ROOT`: the tables and plots of a recipe's runs.

RUN_ROOT is a recipe's output folder: recipe.json (the plan, gamma_titan/recipes/run.py)
and one dump folder per run. Everything shown is read from each run's metrics.jsonl:

- final validation loss: the last `val_loss`;
- final train loss: the mean of the last five logged training losses;
- sink score: the last measurement per layer, and its mean over layers;
- MoE expert load: the last `moe/load_max_over_mean` and the smallest `load_min_over_mean`.

Runs that differ only in their seed form a cell: the tables give its mean ± standard
deviation over seeds, and each Δ its pooled standard error, marked * where |Δ| exceeds
the noise (reports/claims.py). The report ends with the claims table: one row per claim of
the paper that the recipe tests, with its verdict.

Writes RUN_ROOT/report/report.md with PNGs next to it, and returns the markdown's path.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import read_json
from gamma_titan.files import RECIPE_PLAN_FILE, RECIPE_RECORD_HINT, RECIPE_STATUS_FILE
from gamma_titan.reports.claims import CellStats, claims_table, difference, evaluate
from gamma_titan.reports.run_metrics import final_values, read_metrics, series, sink_by_layer
from gamma_titan.reports.scaling import effective_size_gain, fit_power_law

MIN_TOKENS_PER_PARAM = 20
SHORT = {"gamma.init_rate": "γ", "gamma.norm_eps": "ε", "gamma.attention_gate": "gate", "optimizer.lr": "lr",
         "model": "model", "arm": "arm"}


def _value(run: dict[str, Any], key: str) -> Any:
    if key == "model":
        return run["model_label"]
    if key == "arm":
        return run["arm"]
    return run["values"].get(key, run["overrides"].get(key))


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.1e}"
    return str(x)


def _label(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _si(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def load_runs(root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    plan_path = root / RECIPE_PLAN_FILE
    if not plan_path.is_file():
        raise ConfigError(f"RUN_ROOT {root}: no {RECIPE_PLAN_FILE}; point at the --out folder of `gamma-titan recipe run`")
    plan = read_json(plan_path, RECIPE_RECORD_HINT, keys=("runs",))
    status_path = root / RECIPE_STATUS_FILE
    status = read_json(status_path, RECIPE_RECORD_HINT) if status_path.is_file() else {}
    runs = []
    for run in plan["runs"]:
        records = read_metrics(root / run["name"])
        final = final_values(records)
        done = bool(records) and final["step"] >= run["steps"]
        state = status.get(run["name"], {})
        run.setdefault("cell", run["name"])  # plans written before seeds: one run per cell
        run.setdefault("seed", None)
        run.setdefault("width", None)  # plans written before the width was recorded
        runs.append({**run, "records": records, "final": final, "finished": done,
                     "status": "finished" if done else (state.get("status") or ("partial" if records else "not run")),
                     "seconds": state.get("seconds")})
    return plan, runs


def _runs_table(plan: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    keys = [k for k in plan["grid"]] + (["arm"] if plan["arms"] else []) + (
        ["model"] if len({r["model_label"] for r in runs}) > 1 else [])
    seeds = any(r.get("seed") is not None for r in runs)
    moe = any(r["final"].get("load_max") is not None for r in runs)
    head = ["run", *[SHORT.get(k, k) for k in keys], *(["seed"] if seeds else []), "params (non-emb.)", "tokens",
            "tokens/param", "epochs", "steps", "train loss", "val loss", "mean sink", "‖h_L−e‖/‖e‖",
            "ε-dominated at step 1", *(["expert load max / min (÷ mean)"] if moe else []), "time (s)", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in runs:
        f = r["final"]
        epochs = f"{r['tokens'] / r['corpus_tokens']:.2g}" if r.get("corpus_tokens") else "–"
        load = f"{_fmt(f.get('load_max'), 2)} / {_fmt(f.get('load_min'), 2)}"
        cells = [r["name"], *[_label(_value(r, k)) for k in keys], *([_label(r.get("seed"))] if seeds else []),
                 f"{_si(r['params'])} ({_si(r['params_non_embedding'])})", _si(r["tokens"]),
                 f"{r['tokens_per_param']:.1f}", epochs, f"{f['step']}/{r['steps']}", _fmt(f["train_loss"]),
                 _fmt(f["val_loss"]), _fmt(f["sink_mean"], 3), _fmt(f["residual_flow"], 3),
                 _fmt(f["eps_dominated_first"], 2), *([load] if moe else []),
                 _fmt(round(r["seconds"])) if r.get("seconds") else "–", r["status"]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def cell_stats(runs: list[dict[str, Any]], metric: str) -> dict[str, CellStats]:
    """cell -> the metric's statistics over that cell's finished seeds."""
    values: dict[str, list[float]] = {}
    for r in runs:
        if r["finished"] and r["final"].get(metric) is not None:
            values.setdefault(r["cell"], []).append(r["final"][metric])
    return {cell: CellStats.of(v) for cell, v in values.items()}


def _row_keys(plan: dict[str, Any], runs: list[dict[str, Any]]) -> list[str]:
    """The pivot's row keys: [report] rows, then whatever else varies and is not a column
    (moe: model rows, γ columns, and the arm splits each row)."""
    rows_key, cols_key = plan["report"].get("rows"), plan["report"].get("columns")
    varying = [*plan["grid"], *(["arm"] if plan["arms"] else []),
               *(["model"] if len({r["model_label"] for r in runs}) > 1 else [])]
    return [rows_key, *[k for k in varying if k not in (rows_key, cols_key)]]


def _row(run: dict[str, Any], keys: list[str]) -> tuple:
    return tuple(_value(run, k) for k in keys)


def _pivot(plan: dict[str, Any], runs: list[dict[str, Any]], metric: str, title: str, digits: int) -> list[str]:
    rows_key, cols_key = plan["report"].get("rows"), plan["report"].get("columns")
    if not rows_key:
        return []
    keys = _row_keys(plan, runs)
    rows = list(dict.fromkeys(_row(r, keys) for r in runs))
    cols = list(dict.fromkeys(_value(r, cols_key) for r in runs)) if cols_key else [None]
    stats = cell_stats(runs, metric)
    cell = {(_row(r, keys), _value(r, cols_key) if cols_key else None): stats.get(r["cell"]) for r in runs}
    if all(v is None for v in cell.values()):
        return []
    col_names = [f"{SHORT.get(cols_key, cols_key)} = {_label(c)}" for c in cols] if cols_key else [title]
    delta = cols_key is not None and len(cols) == 2
    seeds = max(s.n for s in stats.values())
    head = [", ".join(SHORT.get(k, k) for k in keys), *col_names] + (["Δ (second − first)"] if delta else [])
    what = f" (mean ± std over {seeds} seeds; Δ ± 2 SE, * beyond the noise)" if seeds > 1 else ""
    lines = [f"**{title}**{what}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        values = [cell.get((row, c)) for c in cols]
        cells = [", ".join(_label(v) for v in row), *[v.text(digits) if v else "–" for v in values]]
        if delta:
            if None in values:
                cells.append("–")
            else:
                diff = difference(values[0], values[1])
                cells.append(diff.text(digits) + (" *" if diff.exceeds_noise else ""))
        lines.append("| " + " | ".join(cells) + " |")
    if not cols_key:
        best = min((v.mean, row) for (row, _), v in cell.items() if v is not None)
        lines += ["", f"Lowest: {', '.join(SHORT.get(k, k) for k in keys)} = "
                      f"{', '.join(_label(v) for v in best[1])} ({_fmt(best[0], digits)})."]
    return lines + [""]


def scaling_fits(runs: list[dict[str, Any]], column: str) -> tuple[dict[Any, Any], list[str]]:
    """Per column value (arm): a power law in non-embedding parameters, when it has ≥ 3 sizes."""
    groups: dict[Any, list[tuple[int, float]]] = {}
    stats, seen = cell_stats(runs, "val_loss"), set()
    for r in runs:  # one point per cell: its mean over seeds
        if r["cell"] in stats and r["cell"] not in seen:
            seen.add(r["cell"])
            groups.setdefault(_value(r, column), []).append((r["params_non_embedding"], stats[r["cell"]].mean))
    fits, lines = {}, ["## Scaling fit: L(N) = E + A·N^(−α), N = non-embedding parameters", ""]
    lines += [f"| {SHORT.get(column, column)} | sizes | E | A | α |", "|---|---|---|---|---|"]
    for name, points in groups.items():
        if len(points) < 3:
            lines.append(f"| {name} | {len(points)} | – | – | – |")
            continue
        n, loss = zip(*sorted(points))
        fits[name] = fit_power_law(n, loss)
        f = fits[name]
        lines.append(f"| {name} | {len(points)} | {f.E:.4f} | {f.A:.4g} | {f.alpha:.4f} |")
    names = list(fits)
    if len(names) == 2:
        base, small = names[0], names[1]
        sizes = sorted(p for p, _ in groups[small])
        lines += ["", f"Effective model-size gain of {small} over {base}: the parameters {base} needs to reach "
                  f"{small}'s loss, over {small}'s own (the paper: ≈ 1.79).", "",
                  "| N | gain |", "|---|---|"]
        for n in sizes:
            gain = effective_size_gain(fits[base], fits[small], n)
            lines.append(f"| {_si(n)} | {'unreachable (below E)' if math.isinf(gain) else f'{gain:.3f}'} |")
    return fits, lines + [""]


# --- figures -------------------------------------------------------------------------------


def _plot_curves(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        tokens_per_step = r["global_batch"] * r["seq_len"]
        train = series(r["records"], "loss")
        val = series(r["records"], "val_loss")
        line = ax.plot([s * tokens_per_step for s, _ in val], [v for _, v in val], marker="o", label=r["name"])[0]
        ax.plot([s * tokens_per_step for s, _ in train], [v for _, v in train], color=line.get_color(), alpha=0.25)
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss (markers: validation, faint: training)")
    ax.set_ylim(top=min(ax.get_ylim()[1], 1.6 * min((r["final"]["val_loss"] or 99) for r in runs) + 1))
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_final(plan: dict[str, Any], runs: list[dict[str, Any]], fits: dict[Any, Any], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows_key, cols_key = plan["report"].get("rows"), plan["report"].get("columns")
    if not rows_key:
        return False
    by_model = rows_key == "model"
    if not by_model and not all(isinstance(_value(r, rows_key), (int, float)) for r in runs):
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict[Any, list[tuple[float, float, float]]] = {}
    stats, seen = cell_stats(runs, "val_loss"), set()
    line_keys = ([cols_key] if cols_key else []) + _row_keys(plan, runs)[1:]  # one line per other setting
    for r in runs:  # one point per cell: the mean over seeds, the std as an error bar
        if r["cell"] not in stats or r["cell"] in seen:
            continue
        seen.add(r["cell"])
        x = r["params_non_embedding"] if by_model else _value(r, rows_key)
        name = _value(r, cols_key) if line_keys == [cols_key] else (_row(r, line_keys) if line_keys else None)
        groups.setdefault(name, []).append((x, stats[r["cell"]].mean, stats[r["cell"]].std or 0.0))
    for name, points in groups.items():
        xs, ys, errs = zip(*sorted(points))
        if isinstance(name, tuple):
            label = ", ".join(f"{SHORT.get(k, k)} = {_label(v)}" for k, v in zip(line_keys, name))
        else:
            label = f"{SHORT.get(cols_key, cols_key)} = {_label(name)}" if cols_key else None
        line = ax.errorbar(xs, ys, yerr=errs if any(errs) else None, marker="o", capsize=3,
                           linestyle="" if name in fits else "-", label=label).lines[0]
        if name in fits:
            grid = np.geomspace(min(xs), max(xs), 100)
            ax.plot(grid, fits[name](grid), color=line.get_color(),
                    label=f"fit: {fits[name].E:.3f} + {fits[name].A:.3g}·N^-{fits[name].alpha:.3f}")
    if by_model:
        ax.set_xscale("log")
        ax.set_xlabel("non-embedding parameters")
    else:
        ax.set_xlabel(SHORT.get(rows_key, rows_key))
        if rows_key == "optimizer.lr":
            ax.set_xscale("log")
    ax.set_ylabel("final validation loss")
    if any(label and not label.startswith("_") for label in ax.get_legend_handles_labels()[1]):
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _plot_sink(runs: list[dict[str, Any]], path: Path) -> bool:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with_sink = [r for r in runs if r["final"]["sink"]]
    if not with_sink:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in with_sink:
        sink = sink_by_layer(r["records"])
        layers = sorted(sink)
        ax.plot(layers, [sink[layer][-1][1] for layer in layers], marker="o", label=r["name"])
    ax.set_xlabel("layer")
    ax.set_ylabel("sink score (attention on token 0), last measurement")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_report(root: str | Path, out: str | Path | None = None) -> Path:
    root = Path(root)
    plan, runs = load_runs(root)
    out = Path(out) if out else root / "report"
    out.mkdir(parents=True, exist_ok=True)
    finished = sum(r["finished"] for r in runs)
    seconds = sum(r["seconds"] or 0 for r in runs)
    lines = [f"# {plan['title']} ({plan['figure']}): recipe {plan['recipe']}, scale {plan['scale']}", "",
             f"The paper: {plan['expect']}.", "",
             f"{finished} of {len(runs)} runs finished" + (f"; {seconds / 60:.1f} min of training" if seconds else "")
             + ". Losses are nats per token.", ""]
    short = [r["name"] for r in runs if r["tokens_per_param"] < MIN_TOKENS_PER_PARAM]
    if short:
        lines += [f"**Warning:** {', '.join(short)} saw fewer than {MIN_TOKENS_PER_PARAM} tokens per parameter. "
                  "Small init starts slower (its weights condense first), so a short budget answers a different "
                  "question than the paper's.", ""]
    lines += ["## Runs", "", *_runs_table(plan, runs), ""]
    lines += ["## Tables", ""]
    lines += _pivot(plan, runs, "val_loss", "final validation loss", 4)
    lines += _pivot(plan, runs, "train_loss", "final training loss (mean of the last 5 logged steps)", 4)
    lines += _pivot(plan, runs, "sink_mean", "mean sink score over layers (last measurement)", 3)
    fits: dict[Any, Any] = {}
    if plan["report"].get("fit"):
        fits, fit_lines = scaling_fits(runs, plan["report"].get("columns", "arm"))
        lines += fit_lines
    lines += ["## Figures", ""]
    _plot_curves(runs, out / "loss_curves.png")
    lines += ["![loss curves](loss_curves.png)", ""]
    if _plot_final(plan, runs, fits, out / "final_loss.png"):
        lines += ["![final loss](final_loss.png)", ""]
    if _plot_sink(runs, out / "sink_per_layer.png"):
        lines += ["![sink score per layer](sink_per_layer.png)", ""]
    if plan.get("tune"):  # a tuned recipe judges its comparison at the best values (reports/ladder.py)
        from gamma_titan.reports import ladder

        tuned = ladder.analyse(plan, runs)
        at = lines.index("## Figures")
        lines[at:at] = ladder.section(tuned, len(plan["seeds"]))
        if ladder.plot(tuned, out / "ladder.png"):
            lines += ["![loss against parameters at the best values](ladder.png)", ""]
        lines += claims_table(ladder.claims(tuned))
    if plan.get("claims"):
        keys = [*plan["grid"], *(["arm"] if plan["arms"] else []), "model"]
        lines += claims_table(evaluate(plan["claims"], runs, _value, keys))
    path = out / "report.md"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path
