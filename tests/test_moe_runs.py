"""gamma_moe single-process runs on CPU: 30 steps that log expert load and whose checkpoint
converts to transformers with the same logits, and torch.compile / float8 for 10 steps
against those eager runs' losses.
(A file of its own so that the test workers run it next to test_moe_training.py.)"""

import pytest
import torch

from helpers import QUIET, read_metrics, run_trainer
from test_moe_training import CONFIGS

pytestmark = pytest.mark.multiprocess


AUX = {"mha": (), "mla": ("--model_args.aux_loss_coeff", "0.01")}  # the optional aux loss, on MLA


@pytest.fixture(scope="module")
def thirty_steps(tmp_path_factory, builtin_assets):
    """`thirty_steps(attention)`: the folder of a 30-step eager run (loss logged at steps 1,
    10, 20, 30; a checkpoint at 30), run once per attention kind, when first asked for."""
    dumps = {}

    def run(attention: str):
        if attention not in dumps:
            dump = tmp_path_factory.mktemp(f"thirty-{attention}") / "run"
            run_trainer(dump, "--training.steps", "30", "--metrics.log_freq", "10", "--validation.enable", "false",
                        "--checkpoint.enable", "true", "--checkpoint.interval", "30", *AUX[attention],
                        config=CONFIGS[attention])
            dumps[attention] = dump
        return dumps[attention]

    return run


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_thirty_steps_train_and_log_expert_load(tmp_path, attention, thirty_steps):
    dump = thirty_steps(attention)
    aux = AUX[attention]
    records = read_metrics(dump)
    if aux:  # α·E·Σ f·P ≈ α near balance, > α when skewed
        assert all(0.009 < r["moe/aux_loss"] < 0.04 for r in records)
    else:
        assert all("moe/aux_loss" not in r for r in records)
    assert [r["step"] for r in records] == [1, 10, 20, 30]
    assert records[-1]["loss"] < records[0]["loss"] - 1.0
    for r in records:
        for layer in (1, 2, 3):  # layer 0 is dense
            assert r[f"moe/load_max_over_mean/layer_{layer}"] >= 1.0
            assert 0.0 <= r[f"moe/load_min_over_mean/layer_{layer}"] <= 1.0
        assert "moe/load_max_over_mean/layer_0" not in r
    assert list((dump / "tb").rglob("events.out.tfevents.*"))

    # The trained checkpoint (expert bias moved by load balancing) gives our logits in transformers.
    transformers = pytest.importorskip("transformers")
    from gamma_titan.convert.dcp_io import load_model_state
    from gamma_titan.convert.hf import to_hf
    from gamma_titan.convert.model_record import read_model_record
    from gamma_titan.models.moe import GammaMoE

    step = dump / "checkpoint" / "step-30"
    _, args, _ = read_model_record(step)
    state = load_model_state(step)
    assert state["layers.1.moe.expert_bias"].abs().sum() > 0
    model = GammaMoE(args)
    model.load_state_dict(state)
    hf = transformers.AutoModelForCausalLM.from_pretrained(to_hf(step, tmp_path / "hf", progress=False),
                                                           dtype=torch.float32, trust_remote_code=True)
    tokens = torch.randint(0, args.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("attention, extra, log_line, rtol", [
    # Against the eager 30-step run of the same config, seed, data and learning rates
    # (--lr_scheduler.total_steps 30) at the steps both log, 1 (the forward) and 10 (after
    # nine updates). Measured largest relative differences: compile 6.5e-8 (step 1 bitwise),
    # float8 (emulated) 5.9e-4 (1.2e-5 at step 1); the bounds leave a margin of 150 and 5.
    ("mla", ("--compile.enable", "true"), "Compiling each TransformerBlock", 1e-5),
    ("mha", ("--model.converters", "quantize.linear.float8", "--quantize.linear.float8.emulate", "true",
             "--quantize.linear.float8.filter_fqns", "output"), "Swapped to Float8Linear", 3e-3),
], ids=["compile-mla", "float8-mha"])
def test_compile_and_float8_follow_the_eager_run(tmp_path, attention, extra, log_line, rtol, thirty_steps):
    dump = tmp_path / "run"
    proc = run_trainer(dump, "--training.steps", "10", "--lr_scheduler.total_steps", "30", *QUIET, *AUX[attention],
                       *extra, config=CONFIGS[attention])
    records = read_metrics(dump)
    losses = {r["step"]: r["loss"] for r in records}
    eager = {r["step"]: r["loss"] for r in read_metrics(thirty_steps(attention))}
    assert list(losses) == list(range(1, 11))
    assert [losses[1], losses[10]] == pytest.approx([eager[1], eager[10]], rel=rtol)
    if "Float8" in log_line:
        assert [losses[1], losses[10]] != [eager[1], eager[10]]  # the float8 casts did change the numbers
    assert records[0]["gamma/sink_score/mean"] > 0  # diagnostics (on in the config) ran on this path
    assert log_line in proc.stdout + proc.stderr
