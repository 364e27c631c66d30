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


@pytest.mark.parametrize("layout", ["fsdp2", "ep2", "tp2"])
def test_losses_match_single_process(records, layout):
    losses = {k: [r["loss"] for r in v] for k, v in records.items() if k != "attention"}
    assert len(losses["single"]) == 5 and losses["single"][-1] < losses["single"][0]
    torch.testing.assert_close(torch.tensor(losses[layout]), torch.tensor(losses["single"]), rtol=RTOL, atol=0)


@pytest.mark.parametrize("layout", ["fsdp2", "ep2", "tp2"])
def test_diagnostics_match_single_process(records, layout):
    """Including the expert stacks' stable-rank summaries (experts sharded under EP)."""
    single, other = diagnostics(records["single"]), diagnostics(records[layout])
    assert "5:gamma/stable_rank/layers.1.moe.experts.w2/min" in single
    assert set(other) == set(single)
    for key, value in single.items():
        assert other[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
