"""FSDP and TP on CPU (gloo, 2 processes) against a single-process reference: the same
initial weights, the same losses step by step, and the same live diagnostics; and
diagnostics that leave the losses bitwise unchanged."""

import os
import subprocess
import sys

import pytest
import torch

from helpers import DEBUG_TOML, QUIET, REPO, read_metrics, run_trainer

pytestmark = pytest.mark.multiprocess

DETERMINISTIC = ("--debug.deterministic", "true", "--debug.seed", "7")
DIAGNOSTICS = ("--gamma.diagnostics.enable", "true", "--gamma.diagnostics.freq", "5")  # steps 1 and 5
LAYOUTS = {
    # name: (processes, local batch, extra overrides); the global batch is 4 everywhere
    "single": (1, 4, ()),
    "single-no-diagnostics": (1, 4, ("--gamma.diagnostics.enable", "false")),
    "fsdp2": (2, 2, ("--parallelism.data_parallel_shard_degree", "2")),
    "tp2": (2, 4, ("--parallelism.tensor_parallel_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "1")),
}


def dump_init(tmp_path, layout: str) -> dict:
    nproc, batch, extra = LAYOUTS[layout]
    out = tmp_path / f"init-{layout}.pt"
    script = str(REPO / "tests" / "scripts" / "dump_init_weights.py")
    argv = [script, str(out), "--job.config_file", str(DEBUG_TOML),
            "--job.dump_folder", str(tmp_path / f"dump-{layout}"),
            "--training.local_batch_size", str(batch), "--checkpoint.enable", "true",
            *QUIET, *DETERMINISTIC, *extra]
    if nproc > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out)


def test_initial_weights_do_not_depend_on_parallel_degrees(tmp_path, builtin_assets):
    single = dump_init(tmp_path, "single")
    for layout in ("fsdp2", "tp2"):
        other = dump_init(tmp_path, layout)
        assert list(other) == list(single)
        for name, tensor in single.items():
            assert torch.equal(other[name], tensor), (layout, name)
    # and they are γ-initialised (γ = 1, d = 256), not some default
    assert abs(single["layers.0.attention.wq.weight"].std().item() * 256 - 1) < 0.05
    # Their DCP checkpoints, saved sharded at each layout, convert to the same HF tensors.
    from safetensors.torch import load_file

    from gamma_titan.convert.hf import to_hf

    converted = {}
    for layout in ("single", "fsdp2", "tp2"):
        folder = to_hf(tmp_path / f"dump-{layout}" / "checkpoint" / "step-0", tmp_path / f"hf-{layout}",
                       progress=False)
        converted[layout] = load_file(str(folder / "model.safetensors"))
    assert converted["single"]["model.layers.0.attention.wq.weight"].equal(single["layers.0.attention.wq.weight"])
    for layout in ("fsdp2", "tp2"):
        assert converted[layout].keys() == converted["single"].keys()
        assert all(converted[layout][k].equal(v) for k, v in converted["single"].items()), layout


@pytest.fixture(scope="module")
def records(tmp_path_factory, builtin_assets):
    out = {}
    for layout, (nproc, batch, extra) in LAYOUTS.items():
        dump = tmp_path_factory.mktemp(layout)
        run_trainer(dump, "--training.steps", "5", "--training.local_batch_size", str(batch),
                    *QUIET, *DETERMINISTIC, *DIAGNOSTICS, *extra, nproc=nproc)
        out[layout] = read_metrics(dump)
    return out


@pytest.fixture(scope="module")
def losses(records):
    return {layout: [r["loss"] for r in rs] for layout, rs in records.items()}


def diagnostics(records: list[dict]) -> dict[str, float]:
    """gamma/* of every measured step, keyed 'step:tag' (timing left out)."""
    return {f"{r['step']}:{k}": v for r in records for k, v in r.items()
            if k.startswith("gamma/") and k != "gamma/diagnostics_seconds"}


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_losses_match_single_process(losses, layout):
    assert len(losses["single"]) == 5
    assert losses["single"][-1] < losses["single"][0]
    # The issue asks for rtol 1e-4; matched layouts agree to ~5e-7, so hold them to 2e-5.
    torch.testing.assert_close(torch.tensor(losses[layout]), torch.tensor(losses["single"]),
                               rtol=2e-5, atol=0)


def test_diagnostics_leave_losses_bitwise_unchanged(losses, records):
    assert losses["single"] == losses["single-no-diagnostics"]
    assert not diagnostics(records["single-no-diagnostics"])


@pytest.mark.parametrize("layout", ["fsdp2", "tp2"])
def test_diagnostics_match_single_process(records, layout):
    """Sink score, residual flow, ε-domination, gate statistics and stable ranks at steps 1
    and 5: the same at FSDP=2 and TP=2 as in one process (the weights themselves agree to
    ~1e-6 after a step: gradient sums are added in another order)."""
    single, other = diagnostics(records["single"]), diagnostics(records[layout])
    assert {k.split(":")[0] for k in single} == {"1", "5"}
    assert any("sink_score/layer_3" in k for k in single) and any("stable_rank/output.weight" in k for k in single)
    assert set(other) == set(single)
    for key, value in single.items():
        assert other[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
