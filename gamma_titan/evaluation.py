"""`gamma-titan eval`: downstream evaluation of a converted model with lm-evaluation-harness.

    gamma-titan eval HF_DIR --tasks arc_challenge hellaswag ... [--paper-suite]
                            [--local-task NAME=FILE.jsonl ...] [--limit N] [--out FILE]
    gamma-titan eval compare A.json B.json [--labels A B] [--out FILE.md]

HF_DIR is a folder written by `gamma-titan convert to-hf` (or any causal LM transformers
loads). `--paper-suite` names the paper's tasks (they download their data, so it needs a
network). Offline, `--local-task NAME=FILE.jsonl` builds a multiple-choice task from a
local jsonl whose records are {"question": str, "choices": [str, ...], "answer": int};
`--include-path DIR` adds task YAMLs of your own. Results go to `--out` (default
HF_DIR/eval/results.json) as JSON: per task its metrics, plus lm-eval's full "results".
`compare` renders two result files as a markdown table with the gain column of the
paper's Table 1 (second minus first, in points).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

from gamma_titan.errors import ConfigError
from gamma_titan.file_reads import read_json, read_json_lines

# The paper's downstream suite (Table 1), as lm-evaluation-harness names the tasks.
PAPER_SUITE = ("arc_challenge", "triviaqa", "mmlu", "hellaswag", "bbh", "social_iqa", "gsm8k",
               "minerva_math500")
# Which metric stands for a task in the comparison table, in order of preference.
PRIMARY_METRICS = ("acc_norm", "acc", "exact_match", "em", "f1")
NOT_METRICS = ("alias", "sample_len", "sample_count")
#: What to do about a damaged results file.
RESULTS_HINT = "a results file `gamma-titan eval` writes: run the evaluation again"


def local_task(name: str, jsonl: Path) -> dict[str, Any]:
    """An lm-eval multiple-choice task config over a local jsonl (no network, no YAML file)."""
    if not jsonl.is_file():
        raise ConfigError(f"--local-task {name}: {jsonl} does not exist")
    lines = read_json_lines(jsonl, f"--local-task {name}: fix the file")
    first = lines[0] if lines else {}
    missing = {"question", "choices", "answer"} - set(first if isinstance(first, dict) else {})
    if missing:
        raise ConfigError(f"--local-task {name}: records of {jsonl} lack {', '.join(sorted(missing))}; "
                          'each needs "question", "choices" (a list) and "answer" (an index)')
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(jsonl.resolve())}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    }


def _parse_local_tasks(specs: list[str]) -> list[dict[str, Any]]:
    tasks = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--local-task {spec!r}: write it as NAME=FILE.jsonl")
        tasks.append(local_task(name, Path(path).expanduser()))
    return tasks


def metrics_of(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's "results" (metric keys are "acc,none" etc.)."""
    out = {}
    for task, values in results.items():
        out[task] = {key.split(",")[0]: value for key, value in values.items()
                     if isinstance(value, (int, float)) and not key.split(",")[0].endswith("_stderr")
                     and key.split(",")[0] not in NOT_METRICS}
    return out


def run(hf_dir: str | Path, tasks: list[str], *, local_tasks: list[str] = (), paper_suite: bool = False,
        include_path: str | None = None, limit: float | None = None, num_fewshot: int | None = None,
        batch_size: int = 8, out: str | Path | None = None, overwrite: bool = False,
        device: str = "cpu") -> Path:
    hf_dir = Path(hf_dir)
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"HF_DIR: {hf_dir} has no config.json; convert a checkpoint with "
                          "`gamma-titan convert to-hf` first")
    task_list: list[Any] = [*tasks, *(PAPER_SUITE if paper_suite else ()), *_parse_local_tasks(list(local_tasks))]
    if not task_list:
        raise ConfigError("--tasks: name at least one task, or use --paper-suite or --local-task")
    out = Path(out) if out else hf_dir / "eval" / "results.json"
    if out.exists() and not overwrite:
        raise ConfigError(f"--out: {out} exists; choose another file or pass --overwrite")

    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    from gamma_titan.data.cache import write_json_atomic

    # Index lm-eval's own task library (~15 s) only when a named task is not in include_path.
    named = {t for t in task_list if isinstance(t, str)}
    manager = TaskManager(include_path=include_path, include_defaults=False)
    if not named <= set(manager.all_tasks):
        manager = TaskManager(include_path=include_path, include_defaults=True)
        unknown = sorted(named - set(manager.all_tasks))
        if unknown:
            raise ConfigError(f"--tasks: unknown task {', '.join(unknown)}; see `lm-eval ls tasks`, "
                              "or add a YAML with --include-path")
    with stderr_without(GIT_OUTSIDE_A_CHECKOUT):
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(hf_dir), "trust_remote_code": True, "dtype": "float32"},
            tasks=task_list, num_fewshot=num_fewshot, batch_size=batch_size, limit=limit,
            device=device, task_manager=manager,
        )
    record = {
        "model": str(hf_dir.resolve()),
        "lm_eval_version": lm_eval.__version__,
        "limit": limit,
        "num_fewshot": num_fewshot,
        "metrics": metrics_of(results["results"]),
        "results": results["results"],
        "n_samples": results.get("n-samples"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, record, default=handle_non_serializable)
    return out


#: What git prints when lm-eval asks it for the commit (`git describe`) outside a checkout:
#: lm-eval records no hash then, and the line says nothing about the evaluation.
GIT_OUTSIDE_A_CHECKOUT = b"fatal: not a git repository"


@contextlib.contextmanager
def stderr_without(prefix: bytes) -> Iterator[None]:
    """File descriptor 2 through a pipe for the block, every line that starts with `prefix`
    left out (a subprocess's lines too, which is where git's come from); everything else,
    progress bars' carriage returns included, passes through as it arrives."""
    sys.stderr.flush()
    saved, (read_end, write_end) = os.dup(2), os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def forward() -> None:
        line = b""  # the current line, held while it may still turn out to be the left-out one
        held = True
        while chunk := os.read(read_end, 65536):
            for piece in chunk.splitlines(keepends=True):
                if held:
                    line += piece
                    if line.startswith(prefix) or (not line.endswith(b"\n") and prefix.startswith(line)):
                        if line.endswith(b"\n"):
                            line = b""  # the whole left-out line: dropped
                        continue
                    os.write(saved, line)
                    line, held = b"", False
                else:
                    os.write(saved, piece)
                held = held or piece.endswith(b"\n")
        if line and not line.startswith(prefix):
            os.write(saved, line)

    reader = threading.Thread(target=forward, daemon=True)
    reader.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees its end
        reader.join(timeout=10)
        os.close(read_end)
        os.close(saved)


def primary_metric(metrics: dict[str, float]) -> tuple[str, float] | None:
    for name in PRIMARY_METRICS:
        if name in metrics:
            return name, metrics[name]
    return None


def metrics_table(results: str | Path) -> str:
    """Markdown: every metric of every task of one results file, ×100 (what `eval` prints)."""
    metrics = read_json(results, RESULTS_HINT, keys=("metrics",))["metrics"]
    lines = ["| task | metric | value |", "|---|---|---:|"]
    lines += [f"| {task} | {name} | {100 * value:.2f} |" for task in sorted(metrics)
              for name, value in sorted(metrics[task].items())]
    return "\n".join(lines) + "\n"


def compare(first: str | Path, second: str | Path, labels: tuple[str, str] | None = None) -> str:
    """Markdown: one row per task in both files, the primary metric ×100, and the gain."""
    runs = []
    for path in (first, second):
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"compare: {path} does not exist")
        runs.append(read_json(path, RESULTS_HINT, keys=("metrics",))["metrics"])
    labels = labels or (Path(first).parent.parent.name or "first", Path(second).parent.parent.name or "second")
    lines = [f"| task | metric | {labels[0]} | {labels[1]} | gain |", "|---|---|---:|---:|---:|"]
    gains = []
    for task in sorted(set(runs[0]) & set(runs[1])):
        a, b = primary_metric(runs[0][task]), primary_metric(runs[1][task])
        if a is None or b is None or a[0] != b[0]:
            continue
        gain = 100 * (b[1] - a[1])
        gains.append((100 * a[1], 100 * b[1], gain))
        lines.append(f"| {task} | {a[0]} | {100 * a[1]:.2f} | {100 * b[1]:.2f} | {gain:+.2f} |")
    if not gains:
        raise ConfigError(f"compare: {first} and {second} have no task with a common metric")
    mean = [sum(g[i] for g in gains) / len(gains) for i in range(3)]
    lines.append(f"| **average** | | {mean[0]:.2f} | {mean[1]:.2f} | {mean[2]:+.2f} |")
    return "\n".join(lines) + "\n"
