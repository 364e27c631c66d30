"""Test machinery: several training runs in one launch, one after another in the same
process group (TorchTitan's init_distributed keeps a group that is already up), so that a
whole matrix of parallel layouts costs one torchrun start-up (tests/test_layouts.py).

    torchrun --nproc_per_node N tests/scripts/layout_matrix.py OUT CASES.json

CASES.json is a list of {"name", "argv", "save", "reference"}: `argv` is the trainer's
command line (the config file and overrides). Each case is pre-flighted and trained by
GammaTrainer as `gamma-titan train` would, into OUT/<name>/ (metrics.jsonl as always). Then:

  * with "save": true, rank 0 writes OUT/<name>/initial.pt and params.pt, the full
    parameters before and after training;
  * with "resume_from" (a step-N folder of an earlier case), that checkpoint is hard-linked
    into this case's checkpoint folder first, so the case resumes from it;
  * rank 0 writes OUT/<name>/run.json: pre-flight's resume notes, the data loader's final
    position (sequences of the global order read), how many all-reduces each training
    step made on rank 0 (`all_reduces`: gradients, norms, verdicts; a replica's gradients
    must cross the network once a step, whatever the micro-batches), and the config keys
    read from the trainer's start to its close on any rank, with their readers
    (`key_reads`, tests/scripts/key_reads.py), and the parameters held whole on several
    ranks whose copies differ after training (`copies_differ`: a replica's or a
    TP-replicated weight must be the same on every rank);
  * with "reference" (a folder a saving case wrote), every rank gathers its full
    parameters (its own replica's, where they are replicated) and rank 0 writes
    OUT/<name>/params.json: per rank, `compare`'s numbers against the reference.

A case pre-flight refuses ends the launch with exit code 2 and the message (the test's
layouts are all meant to train).
"""

import functools
import gc
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import gamma_titan  # noqa: F401  (platform shims before torchtitan)
import key_reads
from all_reduce_count import all_reduces, count_all_reduces
import mistaken_family
from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.init import canonical_name
from gamma_titan.training.main import single_process_env
from gamma_titan.training.preflight import preflight, resume_notes, world_size_from_env


def full_parameters(model_parts) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor on this rank (a collective for sharded ones)."""
    out = {}
    for part in model_parts:
        for name, p in part.named_parameters():
            value = p.full_tensor() if isinstance(p, DTensor) else p
            out[canonical_name(name)] = value.detach().float().cpu().clone()
    return out


def compare(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor],
            initial: dict[str, torch.Tensor]) -> dict:
    """How far `params` are from the reference's: the largest absolute difference, and the
    difference's norm over the norm of what the reference's training moved (its update).
    A pipeline stage holds some of the parameters: those are compared, and their names
    returned (the test checks that the stages together hold all of them); `digest` hashes
    their bytes (for runs that must agree bit for bit)."""
    assert params.keys() <= reference.keys(), sorted(set(params) - set(reference))
    diff = max((params[k] - reference[k]).abs().max().item() for k in params)
    off = sum(((params[k] - reference[k]).double() ** 2).sum() for k in params).sqrt()
    moved = sum(((reference[k] - initial[k]).double() ** 2).sum() for k in params).sqrt()
    digest = hashlib.sha256(b"".join(params[k].numpy().tobytes() for k in sorted(params))).hexdigest()
    return {"max_abs_diff": diff, "update_rel_diff": (off / moved).item(), "names": sorted(params),
            "reference_names": len(reference), "digest": digest}


def unsharded_digests(model_parts) -> dict[str, str]:
    """{name: hash of this rank's copy} of every parameter this rank holds whole: a plain
    tensor (a DDP replica's) or a DTensor replicated on every mesh dimension (a TP-replicated
    norm or router: NoParallel, SequenceParallel). Every rank that holds one must hold the
    same bytes; a norm planned NoParallel inside attention, whose gradient is each rank's
    heads' alone, drifts apart on the ranks while the losses still agree."""
    out = {}
    for part in model_parts:
        for name, p in part.named_parameters():
            if isinstance(p, DTensor):
                if not all(placement.is_replicate() for placement in p.placements):
                    continue
                p = p.to_local()
            out[canonical_name(name)] = hashlib.sha256(p.detach().float().cpu().numpy().tobytes()).hexdigest()
    return out


def link_checkpoint(source: Path, target: Path) -> None:
    """Another run's checkpoint folder, hard-linked file by file (it stays as it was)."""
    for path in sorted(source.rglob("*")):
        destination = target / path.relative_to(source)
        if path.is_dir():
            destination.mkdir(parents=True, exist_ok=True)
        else:
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, destination)


mistaken_family.register()  # a case may train it (model.name = mistaken_family.NAME)

# Whoever calls it (FSDP's reduction, TorchTitan's norm, ours) calls it through the module.
count_all_reduces(dist)


@functools.cache
def saved(folder: str) -> tuple[dict, dict]:
    """A saving case's final and initial parameters."""
    return torch.load(Path(folder) / "params.pt"), torch.load(Path(folder) / "initial.pt")


def run_case(out: Path, case: dict) -> None:
    from torchtitan.tools.logging import logger

    from gamma_titan.training.trainer import GammaTrainer

    dump = out / case["name"]
    if case.get("resume_from"):  # rank 0 links, the others wait (a launch's first case has no group yet)
        assert dist.is_initialized() or int(os.environ["WORLD_SIZE"]) == 1, "a resume cannot be a launch's first case"
        source = Path(case["resume_from"])
        if int(os.environ["RANK"]) == 0:
            link_checkpoint(source, dump / "checkpoint" / source.name)
        if dist.is_initialized():
            dist.barrier()
    config = load_job_config([*case["argv"], "--job.dump_folder", str(dump)])
    try:
        preflight(config)
        notes = resume_notes(config, world_size_from_env())
    except ConfigError as e:
        print(f"error: {case['name']}: {e}", file=sys.stderr)
        sys.exit(2)
    logger.info(f"layout_matrix: case {case['name']}")
    start = time.monotonic()
    key_reads.record(config)
    trainer = GammaTrainer(config)
    built = time.monotonic()
    per_step = []
    train_step = trainer.train_step

    def counted_step(data_iterator):  # this instance's step, counted
        before = all_reduces[0]
        train_step(data_iterator)
        per_step.append(all_reduces[0] - before)

    trainer.train_step = counted_step
    try:
        if case.get("save"):
            initial = full_parameters(trainer.model_parts)
        trainer.train()
        trained = time.monotonic()
        params = full_parameters(trainer.model_parts)
    finally:
        trainer.close()
    rank = dist.get_rank()
    every_ranks_reads = [None] * dist.get_world_size()
    dist.all_gather_object(every_ranks_reads, key_reads.take())
    every_ranks_digests = [None] * dist.get_world_size()
    dist.all_gather_object(every_ranks_digests, unsharded_digests(trainer.model_parts))
    if rank == 0:
        position = trainer.dataloader.position() if hasattr(trainer.dataloader, "position") else None
        read = {}
        for ranks_reads in every_ranks_reads:
            for key, readers in ranks_reads.items():
                read[key] = sorted(set(read.get(key, [])) | set(readers))
        copies = {}
        for digests in every_ranks_digests:
            for name, digest in digests.items():
                copies.setdefault(name, set()).add(digest)
        (dump / "run.json").write_text(json.dumps({
            "notes": notes, "position": position, "all_reduces": per_step, "key_reads": read,
            "world": dist.get_world_size(),
            "unsharded": len(copies), "copies_differ": sorted(n for n, d in copies.items() if len(d) > 1)}))
    if case.get("save") and rank == 0:
        torch.save(params, dump / "params.pt")
        torch.save(initial, dump / "initial.pt")
    if case.get("reference"):
        mine = compare(params, *saved(case["reference"]))
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            (dump / "params.json").write_text(json.dumps(everyone))
    del trainer, params
    gc.collect()
    logger.info(f"layout_matrix: case {case['name']}: built in {built - start:.1f} s, trained in "
                f"{trained - built:.1f} s, compared in {time.monotonic() - trained:.1f} s")


class _NoSleep:
    """`time` for torchtitan.train, whose end of training sleeps 2 s on rank 0 ("for other
    ranks to complete"): 2 s per case here, and the next case's first collective waits for
    every rank anyway."""

    def __getattr__(self, name):
        import time

        return (lambda seconds: None) if name == "sleep" else getattr(time, name)


def main() -> None:
    import torchtitan.train
    from torchtitan.tools.logging import init_logger

    torchtitan.train.time = _NoSleep()

    out, cases = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    single_process_env()
    init_logger()
    try:
        for case in cases:
            run_case(out, case)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
