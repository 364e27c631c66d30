"""gamma_moe end to end on CPU: expert parallelism, FSDP and tensor parallelism (2 gloo
processes) against a single process, with MHA and with MLA, the attention gate on (losses
and live diagnostics). Single-process runs (30 steps, compile, float8) are in test_moe_runs.py."""

import pytest
import torch

from helpers import QUIET, REPO, read_metrics, run_trainer
from test_parallel import DIAGNOSTICS, diagnostics

pytestmark = pytest.mark.multiprocess

CONFIGS = {"mha": REPO / "configs" / "moe" / "debug.toml", "mla": REPO / "configs" / "moe" / "debug_mla.toml"}
DETERMINISTIC = ("--debug.deterministic", "true", "--debug.seed", "7")
LAYOUTS = {  # global batch 4 everywhere
    "single": (1, 4, ()),
    "fsdp2": (2, 2, ()),
    "ep2": (2, 2, ("--parallelism.expert_parallel_degree", "2")),
    "tp2": (2, 4, ("--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")),
    # the CUDA path of the experts on the CPU: all-to-all dispatch, TorchTitan's token
    # permutation (its CPU implementation), grouped GEMMs in bf16 (torch's CPU fallback)
    "ep2_grouped": (2, 2, ("--parallelism.expert_parallel_degree", "2", "--model_args.expert_kernel", "grouped")),
}
# rtol 2e-5: matched layouts agree to ~5e-7 here; a missing gradient all-reduce (e.g. of
# MLA's head-shared rotary key under TP) showed up as 7e-5 by step 5, inside the 1e-4
# that the issue asks for.
RTOL = 2e-5


@pytest.fixture(scope="module", params=["mha", "mla"])
def records(request, tmp_path_factory, builtin_assets):
    out = {"attention": request.param}
    for layout, (nproc, batch, extra) in LAYOUTS.items():
        dump = tmp_path_factory.mktemp(f"{request.param}-{layout}")
        run_trainer(dump, "--training.steps", "5", "--training.local_batch_size", str(batch),
                    *QUIET, *DETERMINISTIC, *DIAGNOSTICS, *extra, nproc=nproc, config=CONFIGS[request.param])
        out[layout] = read_metrics(dump)
    return out


# The grouped kernel computes the experts in bf16 (gradients within 2^-6 of the fp32 loop's:
# test_moe.py); at γ = 1 the experts' output is a small share of the residual stream, and 5
# steps moved the loss by 1.5e-6 (MHA) and 1.4e-5 (MLA) from the single-process fp32 loop.
RTOL_GROUPED = 1e-4


@pytest.mark.parametrize("layout", ["fsdp2", "ep2", "tp2", "ep2_grouped"])
def test_losses_match_single_process(records, layout):
    losses = {k: [r["loss"] for r in v] for k, v in records.items() if k != "attention"}
    assert len(losses["single"]) == 5 and losses["single"][-1] < losses["single"][0]
    rtol = RTOL_GROUPED if layout == "ep2_grouped" else RTOL
    torch.testing.assert_close(torch.tensor(losses[layout]), torch.tensor(losses["single"]), rtol=rtol, atol=0)
    if layout == "ep2_grouped":
        assert losses[layout] != losses["ep2"]  # the bf16 kernel ran


def test_a_resume_with_strided_expert_shards_is_bitwise(tmp_path, builtin_assets):
    """EP 2 x FSDP 2 on 4 gloo ranks (the experts are FSDP-sharded inside each EP group:
    strided DTensors), grouped kernel: a run resumed from the step-3 checkpoint of a 6-step
    run (hard-linked into a folder of its own) logs steps 4-6 exactly as that run did."""
    import os

    run = ("--training.steps", "6", "--training.local_batch_size", "1", *QUIET, *DETERMINISTIC,
           "--gamma.diagnostics.enable", "false", "--checkpoint.enable", "true", "--checkpoint.interval", "3",
           "--parallelism.expert_parallel_degree", "2", "--model_args.expert_kernel", "grouped")
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    run_trainer(first, *run, nproc=4, config=CONFIGS["mha"])
    for path in sorted((first / "checkpoint" / "step-3").rglob("*")):
        target = resumed / "checkpoint" / "step-3" / path.relative_to(first / "checkpoint" / "step-3")
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    run_trainer(resumed, *run, nproc=4, config=CONFIGS["mha"])
    uninterrupted, again = read_metrics(first), read_metrics(resumed)
    assert [r["step"] for r in again] == [4, 5, 6]
    assert [r["loss"] for r in again] == [r["loss"] for r in uninterrupted[3:]]
    assert [r["grad_norm"] for r in again] == [r["grad_norm"] for r in uninterrupted[3:]]


@pytest.mark.parametrize("layout", ["fsdp2", "ep2", "tp2"])
def test_diagnostics_match_single_process(records, layout):
    """Including the expert stacks' stable-rank summaries (experts sharded under EP)."""
    single, other = diagnostics(records["single"]), diagnostics(records[layout])
    assert "5:gamma/stable_rank/layers.1.moe.experts.w2/min" in single
    assert set(other) == set(single)
    for key, value in single.items():
        assert other[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("nproc", [2, 4])
def test_each_rank_draws_only_the_chunks_of_its_own_shards(tmp_path, builtin_assets, nproc):
    """gamma_moe debug with 2048-wide experts (each expert stack 4 chunks of the init's
    2^20 values) at EP 2 on 2 ranks, and EP 2 x FSDP 2 on 4 (strided expert shards):
    every rank's init draws exactly the chunks that hold its shards' values (found here by
    cutting the tensor of flat positions as DTensor does), and the ranks' shards add up to
    the model once. Before, every rank drew every expert stack whole."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "draws"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(REPO / "tests" / "scripts" / "count_init_draws.py"), str(out),
            "--job.config_file", str(CONFIGS["mha"]), "--job.dump_folder", str(tmp_path / "run"), *QUIET,
            "--checkpoint.enable", "false", "--gamma.diagnostics.enable", "false", "--training.local_batch_size", "1",
            "--parallelism.expert_parallel_degree", "2", "--model_args.moe_hidden_dim", "2048"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
    total = ranks[0]["total"]
    assert sum(r["held"] for r in ranks) == total  # each value is held once
    for r in ranks:
        assert r["logged"] == [r["chunk_cover"], r["held"]]
        # the rest of the chunk cover is the small matrices (embedding, attention: under a
        # chunk each, drawn whole) and the chunk at each end of a shard: measured 0.59 and
        # 0.39 of the model at 2 and 4 ranks; the expert stacks alone are 0.81 of it
        assert r["chunk_cover"] < (0.65 if nproc == 2 else 0.45) * total
