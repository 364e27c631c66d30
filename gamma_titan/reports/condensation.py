"""`gamma-titan report condensation RUN_DIR [RUN_DIR ...]`: the condensation picture of
runs, offline, from their DCP checkpoints and metrics.jsonl (paper §2.6, Fig. 4–8).

For every checkpoint `RUN_DIR/<checkpoint.folder>/step-N` it loads the weight matrices
(only those: no optimizer state), one checkpoint at a time, and computes each matrix's
stable rank (power iteration, warm-started from the previous checkpoint) and, for a few
matrices at the first, middle and last checkpoint, the row-cosine map. It writes into
`--out` (default `RUN_DIR/report`):

    stable_rank.png        stable rank against step, one panel per matrix type
                           (attention.wq, feed_forward.w1, moe.experts.w1, ...): mean
                           over layers as a line, min..max over layers as a band, per run
    cosine_<matrix>.png    row-cosine maps (e.g. cosine_layers_0_attention_wo.png)
                           at the chosen steps (--steps; default the first, middle
                           and last checkpoint), red +1, blue −1
    sink_score.png         gamma/sink_score per layer from metrics.jsonl (live logs)
    condensation.md        the numbers: stable rank per type and step, where each
                           trajectory bottoms out, and the sink scores

Runs are labelled by their folder name. Existing files of the same names in --out are
replaced (they are derived data); nothing else is touched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gamma_titan.convert.dcp_io import load_model_state
from gamma_titan.diagnostics.spectral import StableRanks, row_cosine
from gamma_titan.errors import ConfigError
from gamma_titan.reports.run_metrics import read_metrics, sink_by_layer

_STEP_DIR = re.compile(r"step-(\d+)$")
_LAYER = re.compile(r"layers\.(\d+)\.")
COSINE_ROWS = 128


@dataclass
class RunData:
    name: str
    steps: list[int] = field(default_factory=list)
    #: matrix name -> stable rank per checkpoint step (expert stacks: mean over experts)
    stable_rank: dict[str, list[float]] = field(default_factory=dict)
    #: matrix name -> {step: row-cosine map}
    cosine: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    #: layer -> [(step, sink score)] from metrics.jsonl
    sink: dict[int, list[tuple[int, float]]] = field(default_factory=dict)


def matrix_type(name: str) -> str:
    """'layers.3.attention.wq.weight' -> 'attention.wq'; 'output.weight' -> 'output'."""
    return _LAYER.sub("", name).removesuffix(".weight")


def find_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every DCP checkpoint under run_dir, by step."""
    found = {}
    for meta in run_dir.rglob(".metadata"):
        match = _STEP_DIR.search(meta.parent.name)
        if match:
            found[int(match.group(1))] = meta.parent
    return sorted(found.items())


def load_matrices(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's weights with two or more dimensions, read from one DCP checkpoint."""
    return load_model_state(checkpoint, min_ndim=2, key=str(checkpoint))


def read_sink_scores(run_dir: Path) -> dict[int, list[tuple[int, float]]]:
    return sink_by_layer(read_metrics(run_dir))


def analyse_run(run_dir: Path, cosine_matrices: list[str] | None, cosine_steps: list[int] | None = None,
                progress: bool = True) -> RunData:
    from tqdm import tqdm

    checkpoints = find_checkpoints(run_dir)
    if not checkpoints:
        raise ConfigError(f"{run_dir}: no checkpoints (step-N folders with a .metadata file); "
                          "train with [checkpoint] enable = true")
    run = RunData(name=run_dir.resolve().name, steps=[s for s, _ in checkpoints])
    run.sink = read_sink_scores(run_dir)
    if cosine_steps:
        missing = sorted(set(cosine_steps) - set(run.steps))
        if missing:
            raise ConfigError(f"--steps {' '.join(map(str, missing))}: {run_dir} has checkpoints at steps "
                              f"{', '.join(map(str, run.steps))}")
        picks = sorted(set(cosine_steps))
    else:
        picks = sorted({checkpoints[0][0], checkpoints[len(checkpoints) // 2][0], checkpoints[-1][0]})
    ranks = StableRanks()
    for step, folder in tqdm(checkpoints, desc=f"{run.name}: checkpoints", disable=not progress):
        matrices = load_matrices(folder)
        if cosine_matrices is None:
            cosine_matrices = first_block_cosine_params(folder, matrices)
        for name in cosine_matrices:
            if name not in matrices:
                raise ConfigError(f"--matrices: {name!r} is not in {folder}; e.g. {', '.join(list(matrices)[:3])}")
        for name, weight in matrices.items():
            run.stable_rank.setdefault(name, []).append(ranks(name, weight).mean().item())
        if step in picks:
            for name in cosine_matrices:
                run.cosine.setdefault(name, {})[step] = row_cosine(matrices[name][:COSINE_ROWS].float())
    return run


def first_block_cosine_params(checkpoint: Path, matrices: dict) -> list[str]:
    """The live diagnostics' default row-cosine weights (the model's own choice, from its
    model.json), of the first block."""
    from gamma_titan.convert.model_record import read_model_record

    _, args, _ = read_model_record(checkpoint)
    return [n for n in args.default_cosine_params() if n.startswith("layers.0.") and n in matrices]


# --- figures and summary ---------------------------------------------------------------


def _types(runs: list[RunData]) -> dict[str, list[str]]:
    types: dict[str, list[str]] = {}
    for run in runs:
        for name in run.stable_rank:
            names = types.setdefault(matrix_type(name), [])
            if name not in names:
                names.append(name)
    return types


def plot_stable_rank(runs: list[RunData], path: Path) -> None:
    import matplotlib.pyplot as plt

    types = _types(runs)
    cols = min(4, len(types))
    rows = -(-len(types) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (kind, names) in zip(axes.flat, types.items()):
        for run in runs:
            series = torch.tensor([run.stable_rank[n] for n in names if n in run.stable_rank])
            if not len(series):
                continue
            line, = ax.plot(run.steps, series.mean(0), label=run.name)
            ax.fill_between(run.steps, series.min(0).values, series.max(0).values, alpha=0.2, color=line.get_color())
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("stable rank")
    for ax in list(axes.flat)[len(types):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_cosine(runs: list[RunData], name: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    panels = [(run.name, step, c) for run in runs for step, c in sorted(run.cosine.get(name, {}).items())]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2), squeeze=False)
    for ax, (run_name, step, c) in zip(axes.flat, panels):
        ax.imshow(c.numpy(), cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_title(f"{run_name}\nstep {step}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"row cosine similarity: {name}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_sink(runs: list[RunData], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(4.5 * len(runs), 3.2), squeeze=False)
    for ax, run in zip(axes.flat, runs):
        for layer, points in sorted(run.sink.items()):
            ax.plot([s for s, _ in points], [v for _, v in points], label=f"layer {layer}")
        ax.set_title(run.name, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("sink score")
        if run.sink:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def trajectory_shape(values: list[float], tolerance: float = 0.05) -> str:
    """'down, then up' when the minimum lies inside and both ends sit above it by more
    than `tolerance` (relative); else 'down', 'up' or 'flat'."""
    low = min(values)
    first, last = values[0], values[-1]
    falls, rises = first > low * (1 + tolerance), last > low * (1 + tolerance)
    if falls and rises:
        return "down, then up"
    if falls:
        return "down"
    if last > first * (1 + tolerance):
        return "up"
    return "flat"


def summary(runs: list[RunData], figures: list[str]) -> str:
    lines = ["# Condensation report", "", "Stable rank sr(W) = ‖W‖_F² / ‖W‖_2², mean over the layers of each "
             "matrix type (expert stacks: mean over experts), at each checkpoint.", ""]
    for run in runs:
        lines += [f"## {run.name}", ""]
        types = _types([run])
        header = "| matrix type | " + " | ".join(f"step {s}" for s in run.steps) + " | lowest at | shape |"
        lines += [header, "|" + "---|" * (len(run.steps) + 3)]
        for kind, names in types.items():
            mean = torch.tensor([run.stable_rank[n] for n in names]).mean(0).tolist()
            lowest = run.steps[min(range(len(mean)), key=mean.__getitem__)]
            cells = " | ".join(f"{v:.2f}" for v in mean)
            lines.append(f"| {kind} | {cells} | step {lowest} | {trajectory_shape(mean)} |")
        lines.append("")
        if run.sink:
            steps = sorted({s for pts in run.sink.values() for s, _ in pts})
            by_step = {s: [v for pts in run.sink.values() for t, v in pts if t == s] for s in steps}
            lines += ["Sink score (live, mean over layers): " + ", ".join(
                f"step {s}: {sum(v) / len(v):.4f}" for s, v in by_step.items()), ""]
        else:
            lines += ["No sink scores in metrics.jsonl (train with [gamma.diagnostics] enable = true).", ""]
    lines += ["## Figures", ""] + [f"![{f}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


def write_report(run_dirs: list[Path], out: Path, cosine_matrices: list[str] | None = None,
                 cosine_steps: list[int] | None = None, progress: bool = True) -> list[Path]:
    """Analyse the runs and write the report; returns the files written."""
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise ConfigError(f"{run_dir}: no such run folder")
    runs = [analyse_run(d, cosine_matrices, cosine_steps, progress) for d in run_dirs]
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    figures = ["stable_rank.png"]
    plot_stable_rank(runs, out / "stable_rank.png")
    for name in sorted({n for run in runs for n in run.cosine}):
        figures.append(f"cosine_{name.removesuffix('.weight').replace('.', '_')}.png")
        plot_cosine(runs, name, out / figures[-1])
    if any(run.sink for run in runs):
        figures.append("sink_score.png")
        plot_sink(runs, out / "sink_score.png")
    (out / "condensation.md").write_text(summary(runs, figures))
    return [out / f for f in figures] + [out / "condensation.md"]
