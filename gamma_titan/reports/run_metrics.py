"""Reading a run's `metrics.jsonl` (gamma_titan/training/metrics.py writes it, one line per logged step).

The file is appended to: a run resumed from a checkpoint, or restarted from scratch after
a crash, logs steps it had logged before. The newer attempt wins: a step at or below the
last one seen drops everything logged from that step on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from statistics import mean
from typing import Any

from gamma_titan.files import METRICS_FILE, SOURCE_VAL_LOSS

_SINK = re.compile(r"gamma/sink_score/layer_(\d+)")
_EPS_DOMINATED = re.compile(r"gamma/eps_dominated_fraction/(layer_\d+|final_norm)")
_LOAD_MIN = "moe/load_min_over_mean/layer_"


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's records in step order, from its latest attempt at each step."""
    path = Path(run_dir) / METRICS_FILE
    records: list[dict[str, Any]] = []
    if not path.is_file():
        return records
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():  # damage: lines skipped
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a crash
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            continue
        while records and records[-1]["step"] >= record["step"]:
            records.pop()
        records.append(record)
    return records


def series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of every record that has `key`."""
    return [(r["step"], r[key]) for r in records if key in r]


def sink_by_layer(records: list[dict[str, Any]]) -> dict[int, list[tuple[int, float]]]:
    """layer -> [(step, sink score)]."""
    sink: dict[int, list[tuple[int, float]]] = {}
    for r in records:
        for key, value in r.items():
            match = _SINK.fullmatch(key)
            if match:
                sink.setdefault(int(match.group(1)), []).append((r["step"], value))
    return sink


def final_values(records: list[dict[str, Any]], tail: int = 5) -> dict[str, Any]:
    """What a report table shows of a run: the last step, the last validation loss (and
    each source's, `val_loss/<source>`, for a mixture), the mean training loss over the last `tail` logged steps, the last sink scores and residual
    flow, and the fraction of RMSNorm inputs whose variance sits under 10·ε at step 1."""
    out: dict[str, Any] = {"step": records[-1]["step"] if records else 0}
    losses = [v for _, v in series(records, "loss")][-tail:]
    out["train_loss"] = mean(losses) if losses else None
    val = series(records, "val_loss")
    out["val_loss"] = val[-1][1] if val else None
    last_val = next((r for r in reversed(records) if "val_loss" in r), {})
    out.update({k: v for k, v in last_val.items() if k.startswith(SOURCE_VAL_LOSS)})  # a mixture's sources
    sink = sink_by_layer(records)
    out["sink"] = [sink[layer][-1][1] for layer in sorted(sink)] if sink else []
    out["sink_mean"] = mean(out["sink"]) if out["sink"] else None
    first = next((r for r in records if any(_EPS_DOMINATED.fullmatch(k) for k in r)), None)
    eps = [v for k, v in first.items() if _EPS_DOMINATED.fullmatch(k)] if first else []
    out["eps_dominated_first"] = mean(eps) if eps else None  # at the first measurement (step 1)
    flow = series(records, "gamma/residual_flow_ratio")
    out["residual_flow"] = flow[-1][1] if flow else None
    load_max = series(records, "moe/load_max_over_mean")
    out["load_max"] = load_max[-1][1] if load_max else None  # the worst layer, last logged step
    last_load = next((r for r in reversed(records) if any(k.startswith(_LOAD_MIN) for k in r)), None)
    out["load_min"] = min(v for k, v in last_load.items() if k.startswith(_LOAD_MIN)) if last_load else None
    return out
