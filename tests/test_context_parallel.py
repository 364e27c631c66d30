"""Context parallelism for gamma_dense and gamma_moe on what a CPU can run: TorchTitan's
sharding of the batch (head-tail chunks, each token's global position), our model's
forward on a rank's chunks with `positions`, and the MoE balance loss summed over the
ranks that share a sequence, on 2 gloo ranks against one process, with ring attention
replaced by an all-gather attention (tests/scripts/context_parallel.py). The run itself
(PyTorch's ring attention, CUDA only) is tools/gpu_check.sh's `dense_cp2` and `moe_cp2`.
Pre-flight's CP rules are checked here too."""

import json
import os
import subprocess
import sys

import pytest

from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.training.layout import Layout
from gamma_titan.training.preflight import check_context_parallel, check_diagnostics
from gamma_titan.training.train_spec import resolve_model
from helpers import REPO

SEQ = 32  # the script's


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cp") / "cp.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests" / "scripts" / "context_parallel.py"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["dense", "moe_mha", "moe_mla"])
def test_context_parallel_trains_the_model_one_process_trains(ranks, model):
    quarter = SEQ // 4  # head-tail: rank 0 the first and last quarter, rank 1 the middle
    expected = [[*range(quarter), *range(3 * quarter, SEQ)], list(range(quarter, 3 * quarter))]
    for rank, seen in enumerate(ranks[model]):
        assert all(row == expected[rank] for row in seen["positions"])  # global positions, every sequence
        assert seen["tokens_match"]  # the tokens and labels at those positions
        assert seen["logits_max_diff"] <= 1e-5  # rotary by global position, gate on the local tokens
        assert seen["cp_loss"] == pytest.approx(seen["loss"], rel=1e-6)
        # max_loss, one data-parallel rank holding the batch: its mean loss (TorchTitan: the half)
        assert seen["max_loss"] == pytest.approx(seen["loss"], rel=1e-6)
        # every gradient (the MoE balance loss's included) summed over the ranks: one process's
        assert seen["grad_max_rel_diff"] <= 1e-5 and seen["grads_compared"] > 20


@pytest.mark.multiprocess
def test_validation_under_context_parallelism_is_one_processs_loss(ranks):
    """TorchTitan 0.2.2's validator counted the tokens after the CP split and summed the loss
    over the CP ranks: CP 2 reported twice the loss. Ours, on the run's validation set (6
    sequences) with the ring stood in for: the loss one process computes directly."""
    for seen in ranks["validation"]:
        assert seen["cp"] == pytest.approx(seen["one_process"], rel=1e-6), seen
        assert 7 < seen["one_process"] < 9  # ln 4096 = 8.3 at γ = 1: a real loss, not 2x or 0


def cp_config(*overrides):
    config = load_job_config(["--job.config_file", str(REPO / "configs/moe/debug_mla.toml"),
                              "--parallelism.context_parallel_degree", "2", *overrides])
    return config, resolve_model(config)[1]


def test_the_sequence_must_split_into_the_balanced_chunks():
    config, args = cp_config("--training.seq_len", "36")
    with pytest.raises(ConfigError) as err:
        check_context_parallel(config, Layout(cp=2, tp=2), args)
    assert str(err.value) == ("training.seq_len = 36 must be divisible by 2 x context_parallel_degree x "
                              "tensor_parallel_degree = 8 (the sequence's load-balanced chunks)")
    config, args = cp_config("--training.seq_len", "24", "--validation.seq_len", "36")
    with pytest.raises(ConfigError, match="^validation.seq_len = 36 must be divisible"):
        check_context_parallel(config, Layout(cp=2, tp=2), args)
    config, args = cp_config("--training.seq_len", "24")
    check_context_parallel(config, Layout(cp=2, tp=2), args)


def test_the_flex_balancer_is_refused_for_sdpa_attention():
    config, args = cp_config("--parallelism.context_parallel_load_balancer", "ptrr")
    with pytest.raises(ConfigError) as err:
        check_context_parallel(config, Layout(cp=2), args)
    assert str(err.value) == ("parallelism.context_parallel_load_balancer = 'ptrr': gamma_moe's attention takes "
                              "'headtail', none (\"ptrr\" reorders a flex attention block mask)")


def test_the_live_diagnostics_are_refused_under_context_parallelism():
    config, args = cp_config()
    with pytest.raises(ConfigError, match="^gamma.diagnostics.enable = true needs parallelism.context_parallel_"):
        check_diagnostics(config, None, args)


@pytest.mark.parametrize("config_file", ["configs/dense/debug.toml", "configs/moe/debug_mla.toml"])
def test_torchtitans_validator_finds_the_rotary_cache(config_file):
    """TorchTitan 0.2's validator reads `freqs_cis` of each model part under CP."""
    import torch

    from gamma_titan.models import TRAIN_SPECS

    config = load_job_config(["--job.config_file", str(REPO / config_file)])
    name, args = config.model.name, resolve_model(config)[1]
    with torch.device("meta"):
        model = TRAIN_SPECS[name].model_cls(args)
    assert model.freqs_cis is model.rope
