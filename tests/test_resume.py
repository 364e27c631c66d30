"""Resuming as a cluster user does: a finished run extended with more steps on the same
dump folder, and the checkpoints pre-flight refuses to resume from (a model-only save, one
of another model), each in one line before anything starts."""

import json

import pytest
import torch

from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.training.preflight import preflight
from helpers import DEBUG_TOML, QUIET, read_metrics, run_trainer

# A schedule that does not depend on training.steps (warm-up, then constant): the first 8
# steps of an 8-step and of a 16-step run are then the same computation.
RUN = (*QUIET, "--gamma.diagnostics.enable", "false", "--lr_scheduler.warmup_steps", "2",
       "--lr_scheduler.decay_ratio", "0", "--checkpoint.enable", "true", "--checkpoint.interval", "8")


@pytest.mark.multiprocess
def test_extending_a_finished_run_continues_it_bitwise(tmp_path, builtin_assets):
    """Hazard 13: 8 steps, then the same command with 16 on the same dump folder. The final
    save of the first run must be a full checkpoint, and steps 9-16 must be those of an
    uninterrupted 16-step run."""
    dump = tmp_path / "run"
    run_trainer(dump, *RUN, "--training.steps", "8")
    run_trainer(dump, *RUN, "--training.steps", "16")
    reference = tmp_path / "reference"
    run_trainer(reference, *RUN, "--training.steps", "16")
    extended = read_metrics(dump)
    assert [r["step"] for r in extended] == list(range(1, 17))
    assert [r["loss"] for r in extended] == [r["loss"] for r in read_metrics(reference)]


def save_checkpoint(folder, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=str(folder))


def check(dump, *overrides: str) -> None:
    preflight(load_job_config(["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump),
                               "--checkpoint.enable", "true", *overrides]), world_size=1)


def test_a_model_only_checkpoint_is_refused_with_the_ways_forward(tmp_path):
    ckpt = tmp_path / "run" / "checkpoint"
    save_checkpoint(ckpt / "step-8", {"tok_embeddings.weight": torch.zeros(4, 2)})  # what last_save_model_only writes
    with pytest.raises(ConfigError) as err:
        check(tmp_path / "run")
    text = str(err.value)
    assert "\n" not in text and "step-8" in text and "model only" in text
    assert f"--checkpoint.initial_load_path {ckpt / 'step-8'}" in text and "--checkpoint.load_step" in text
    # a full checkpoint at an earlier step, asked for by load_step, is fine
    save_checkpoint(ckpt / "step-4", {"tok_embeddings.weight": torch.zeros(4, 2), "train_state": {"step": 4}})
    check(tmp_path / "run", "--checkpoint.load_step", "4")


def test_checkpoints_of_another_model_shape_are_refused(tmp_path, builtin_assets):
    from gamma_titan.convert.model_record import model_record, write_model_record
    from gamma_titan.training.train_spec import resolve_model

    ckpt = tmp_path / "run" / "checkpoint"
    save_checkpoint(ckpt / "step-2", {"tok_embeddings.weight": torch.zeros(4, 2), "train_state": {"step": 2}})
    config = load_job_config(["--job.config_file", str(DEBUG_TOML), "--model_args.dim", "128",
                              "--model_args.ffn_hidden_dim", "512"])
    write_model_record(ckpt, model_record("gamma_dense", "debug", resolve_model(config)[1], None))
    before = sorted(p.name for p in ckpt.iterdir())
    with pytest.raises(ConfigError) as err:
        check(tmp_path / "run")  # the debug flavor: dim 256
    text = str(err.value)
    assert "\n" not in text and "another model shape" in text
    assert "model_args.dim = 128 there, 256 here" in text and "model_args.ffn_hidden_dim = 512 there" in text
    assert sorted(p.name for p in ckpt.iterdir()) == before
    # the same shapes resume, whatever else differs (γ and the sequence length matter at the
    # start only; ε is the user's call)
    check(tmp_path / "run", "--model_args.dim", "128", "--model_args.ffn_hidden_dim", "512",
          "--gamma.init_rate", "0.5", "--training.seq_len", "1024", "--gamma.norm_eps", "1e-5")
    with pytest.raises(ConfigError, match="model_args.attention_gate = 'elementwise' there, 'none' here"):
        check(tmp_path / "run", "--model_args.dim", "128", "--model_args.ffn_hidden_dim", "512",
              "--gamma.attention_gate", "none")
    json.loads((ckpt / "model.json").read_text())
