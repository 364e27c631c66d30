"""Every file a command reads and did not write this time — a tokenizer's, a shard folder's,
pretokenize's plan, a checkpoint's model record, a run's start records, a recipe's records,
eval's results, a Hugging Face folder's config — truncated or garbled, then the command that
reads it run: exit 2, one line naming the file and what is wrong, nothing written (the
folders the command would write to are as they were), and, the file restored, the same
command passes that check. One set of real artifacts, made once: a tokenizer and its shards
from `tokenizer train` and `pretokenize`, a 2-step checkpointed run, a converted Hugging
Face folder, a recipe's plan (`recipe run --launcher slurm --dry-run`)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from helpers import QUIET, REPO, run_trainer

from gamma_titan.cli import main as cli_main

#: A truncated file keeps its first half; a garbled one has bytes in its middle overwritten
#: with 0xFF (never UTF-8, never JSON, never a valid .npy header field).
DAMAGES = ("truncated", "garbled")


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        middle = len(data) // 2
        path.write_bytes(data[:middle] + b"\xff" * min(16, len(data) - middle) + data[middle + 16:])


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root`: (size, mtime) by relative path."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def made(tmp_path_factory, builtin_assets) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("damaged")
    corpus = root / "corpus.jsonl"
    words = [f"w{i}" for i in range(60)]
    corpus.write_text("".join(json.dumps({"text": " ".join(words[(i * 7 + j) % 60] for j in range(40))}) + "\n"
                              for i in range(400)))
    run = root / "run"
    run_trainer(run, *QUIET, "--training.steps", "2", "--training.local_batch_size", "2", "--training.seq_len", "64",
                "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--gamma.diagnostics.enable", "false")
    for argv in (["tokenizer", "train", "--input", corpus, "--vocab-size", "300", "--out", root / "tok"],
                 ["pretokenize", "--input", corpus, "--tokenizer", root / "tok", "--out", root / "shards",
                  "--val-fraction", "0.2", "--docs-per-shard", "100", "--quiet"],
                 ["convert", "to-hf", run / "checkpoint" / "step-2", root / "hf"],
                 ["recipe", "run", "eps_ablation", "--scale", "tiny", "--launcher", "slurm", "--dry-run",
                  "--out", root / "recipe"]):
        with pytest.raises(SystemExit) as done:
            cli_main([str(a) for a in argv])
        assert done.value.code == 0, argv
    (root / "recipe" / "status.json").write_text("{}\n")
    results = {"metrics": {"arc_easy": {"acc": 0.5}}, "results": {}}
    for name in ("a", "b"):
        (root / name / "eval").mkdir(parents=True)
        (root / name / "eval" / "results.json").write_text(json.dumps(results))
    return {"root": root, "corpus": corpus, "run": run}


def memmap_run(root: Path, dump: str) -> list[str]:
    """`train` on the pretokenized shards with their tokenizer (pre-flight opens both)."""
    return ["train", str(REPO / "configs" / "dense" / "debug.toml"), "--nproc", "1",
            "--model.hf_assets_path", str(root / "tok"), "--training.dataset", "memmap",
            "--training.dataset_path", str(root / "shards"), "--validation.enable", "false",
            "--job.dump_folder", str(root / dump), "--training.steps", "1", "--metrics.enable_tensorboard", "false"]


#: file (under the artifacts' root; a glob for a run record) -> (command, the folder it would
#: write to): every file a command reads that an earlier command wrote.
CASES = {
    "tok/tokenizer.json": (lambda r: ["pretokenize", "--input", str(r / "corpus.jsonl"), "--tokenizer",
                                      str(r / "tok"), "--out", str(r / "new_shards"), "--quiet"], "new_shards"),
    "tok/tokenizer_config.json": (lambda r: ["pretokenize", "--input", str(r / "corpus.jsonl"), "--tokenizer",
                                             str(r / "tok"), "--out", str(r / "new_shards"), "--quiet"],
                                  "new_shards"),
    "shards/meta.json": (lambda r: memmap_run(r, "new_run"), "new_run"),
    "shards/train/00000.idx.npy": (lambda r: memmap_run(r, "new_run"), "new_run"),
    "shards/.progress/plan.json": (lambda r: ["pretokenize", "--input", str(r / "corpus.jsonl"), "--tokenizer",
                                              str(r / "tok"), "--out", str(r / "shards"), "--val-fraction", "0.2",
                                              "--docs-per-shard", "100", "--quiet"], "shards"),
    "run/checkpoint/model.json": (lambda r: ["convert", "to-hf", str(r / "run" / "checkpoint" / "step-2"),
                                             str(r / "new_hf")], "new_hf"),
    "hf/config.json": (lambda r: ["convert", "from-hf", str(r / "hf"), str(r / "new_ckpt")], "new_ckpt"),
    "hf/tokenizer.json": (lambda r: ["convert", "to-hf", str(r / "run" / "checkpoint" / "step-2"),
                                     str(r / "new_hf"), "--tokenizer", str(r / "hf")], "new_hf"),
    "run/runs/*/config.toml": (lambda r: ["train", str(REPO / "configs" / "dense" / "debug.toml"), "--nproc", "1",
                                           "--job.dump_folder", str(r / "run"), *QUIET, "--training.steps", "3",
                                           "--training.local_batch_size", "2", "--training.seq_len", "64",
                                           "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                                           "--gamma.diagnostics.enable", "false"], "run"),
    "recipe/recipe.json": (lambda r: ["report", "recipe", str(r / "recipe"), "--out", str(r / "new_report")],
                           "new_report"),
    "recipe/status.json": (lambda r: ["report", "recipe", str(r / "recipe"), "--out", str(r / "new_report")],
                           "new_report"),
    "a/eval/results.json": (lambda r: ["eval", "compare", str(r / "a" / "eval" / "results.json"),
                                       str(r / "b" / "eval" / "results.json"), "--out", str(r / "new_table.md")],
                            "new_table.md"),
}


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", list(CASES))
def test_a_damaged_file_is_one_line_naming_it_and_nothing_is_written(made, name, how, capsys):
    root = made["root"]
    path = next(root.glob(name))  # a run record's folder is named by its start
    command, target = CASES[name]
    argv = command(root)
    original = path.read_bytes()
    before = tree(root / target) if (root / target).is_dir() else None
    damage(path, how)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as done:
            cli_main(argv)
        # a command that failed leaves its caller's stop signals as they were (train installs its own)
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert done.value.code == 2 and len(lines) == 1, err[-3000:]
        assert str(path) in lines[0] and "Traceback" not in err, lines[0]
        print(f"{name} ({how}): {lines[0].replace(str(root) + '/', '')}")  # the closing notes quote these
        if before is None:
            assert not (root / target).exists()
        else:  # the folder it reads and would write: as it was, but for the file damaged here
            inside = str(path.relative_to(root / target))
            assert {k: v for k, v in tree(root / target).items() if k != inside} == \
                {k: v for k, v in before.items() if k != inside}
    finally:
        path.write_bytes(original)
