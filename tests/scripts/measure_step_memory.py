"""Test machinery: the peak of live tensor memory during real training steps, measured with
PyTorch's memory tracker (FSDPMemTracker under FSDP, MemTracker otherwise), next to what
`gamma_titan.estimate.estimate_rank` says for the same config (tests/test_estimate.py).

    torchrun --nproc_per_node N measure_step_memory.py OUT_DIR --job.config_file ... [overrides]

Each rank builds GammaTrainer, runs two training steps (the second has AdamW's states)
inside the tracker, and writes OUT_DIR/rank{r}.json: {"peak": bytes, "parts": {kind: bytes}}.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist

import gamma_titan  # noqa: F401  (CPU platform shims before torchtitan)
from gamma_titan.config import load_job_config
from gamma_titan.training.preflight import preflight


def main() -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    from gamma_titan.training.trainer import GammaTrainer

    out, argv = Path(sys.argv[1]), sys.argv[2:]
    config = load_job_config(argv)
    preflight(config)
    trainer = GammaTrainer(config)
    [model] = trainer.model_parts
    optimizer = trainer.optimizers.optimizers[0]
    if isinstance(model, FSDPModule):
        tracker = FSDPMemTracker(mod=model, optm=optimizer)
    else:
        tracker = MemTracker()
        tracker.track_external(model, optimizer)
    batches = trainer.batch_generator(trainer.dataloader)
    with tracker:
        for step in (1, 2):  # the second step holds AdamW's states too: the peak of the two
            trainer.step = step
            trainer.train_step(batches)
            tracker.reset_mod_stats()  # per-module stats of one step at a time (the peak stays)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(
        {"peak": snapshot["Total"], "parts": {str(getattr(k, "value", k)): v for k, v in snapshot.items()}}))
    trainer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
