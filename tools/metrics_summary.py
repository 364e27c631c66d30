"""Summarise a run's metrics.jsonl: loss at the first and last logged step, validation
loss, the median training tokens/s per device (after the first logged step, which
includes start-up), and the first and last mean sink score and residual-flow ratio when
diagnostics ran.

    python tools/metrics_summary.py outputs/debug
"""

import json
import statistics
import sys
from pathlib import Path


def summarise(run_dir: str) -> dict:
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    diag = [r for r in records if "gamma/sink_score/mean" in r]
    return {
        "steps": [train[0]["step"], train[-1]["step"]],
        "loss": [round(train[0]["loss"], 4), round(train[-1]["loss"], 4)],
        "val_loss": [round(val[0]["val_loss"], 4), round(val[-1]["val_loss"], 4)] if val else None,
        "median_tps": round(statistics.median(r["tps"] for r in train[1:])) if len(train) > 1 else None,
        "sink_score": [round(diag[0]["gamma/sink_score/mean"], 4), round(diag[-1]["gamma/sink_score/mean"], 4)]
        if diag else None,
        "residual_flow_ratio": [round(diag[0]["gamma/residual_flow_ratio"], 3),
                                round(diag[-1]["gamma/residual_flow_ratio"], 3)] if diag else None,
    }


if __name__ == "__main__":
    print(json.dumps(summarise(sys.argv[1] if len(sys.argv) > 1 else "outputs/debug")))
