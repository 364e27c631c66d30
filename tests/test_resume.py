"""Resuming as a cluster user does: a finished run extended with more steps on the same
dump folder, and the checkpoints pre-flight refuses to resume from (a model-only save, one
of another model), each in one line before anything starts."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from gamma_titan.config import load_job_config
from gamma_titan.errors import ConfigError
from gamma_titan.training.preflight import preflight, resume_notes
from helpers import DEBUG_TOML, QUIET, REPO, read_metrics, run_trainer

README = (REPO / "README.md").read_text(encoding="utf-8")

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

    # the same command once more: nothing to do, said in one line, no new run record
    records = sorted((dump / "runs").iterdir())
    again = run_trainer(dump, *RUN, "--training.steps", "16")
    assert again.stdout.strip().splitlines()[-1] == \
        f"nothing to do: step 16 of 16 is done ({dump / 'checkpoint'}); raise --training.steps to extend"
    assert sorted((dump / "runs").iterdir()) == records and len(read_metrics(dump)) == 16
    # an extension whose schedule spans training.steps (a decay to the last step) says so
    config = load_job_config(["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump),
                              *RUN[:-6], "--checkpoint.enable", "true", "--training.steps", "24"])
    notes = resume_notes(config, 1)
    assert len(notes) == 1 and "decay of the learning rate now ends at step 24, not 16" in notes[0]
    assert resume_notes(load_job_config([*config_argv(dump), "--training.steps", "24",
                                         "--lr_scheduler.total_steps", "24"]), 1) == []
    # ... and the command line says it too (the run record of this launch is written after the
    # notes are read: before, the new record hid the previous one's steps)
    extended = run_trainer(dump, *RUN[:-6], "--checkpoint.enable", "true", "--checkpoint.interval", "8",
                           "--training.steps", "24")
    out = extended.stdout + extended.stderr
    assert "the cosine decay of the learning rate now ends at step 24, not 16" in out, out[-3000:]
    assert [r["step"] for r in read_metrics(dump)][-8:] == list(range(17, 25))


def config_argv(dump):
    return ["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump), "--checkpoint.enable", "true"]


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


def check_at(dump, world: int, *overrides: str) -> list[str]:
    """Pre-flight at `world` ranks, then the notes a resume prints at start."""
    from gamma_titan.training.preflight import resume_notes

    config = load_job_config(["--job.config_file", str(DEBUG_TOML), "--job.dump_folder", str(dump),
                              "--checkpoint.enable", "true", *overrides])
    preflight(config, world_size=world)
    return resume_notes(config, world)


def test_a_per_rank_data_position_resumes_at_its_own_degree_only(tmp_path, builtin_assets):
    """TorchTitan's dataloader state (one entry per data-parallel rank: the text loader's,
    and ours before positions were global) at 2 ranks: degree 2 resumes it, degree 1 is
    refused in one line naming the degree and the ways forward; excluding the dataloader
    resumes it with a note that the data starts over."""
    ckpt = tmp_path / "run" / "checkpoint"
    save_checkpoint(ckpt / "step-3", {"train_state": {"step": 3, "ntokens_seen": 3 * 2048},
                                      "dataloader": {"dp_rank_0": b"x", "dp_rank_1": b"y", "world_size": 2}})
    assert check_at(tmp_path / "run", 2, "--training.local_batch_size", "4") == []
    with pytest.raises(ConfigError) as err:
        check_at(tmp_path / "run", 1)
    assert str(err.value) == (
        f"checkpoint.folder: {ckpt / 'step-3'} was saved at data-parallel degree 2 and this launch has 1; it holds the "
        "data position per rank (written before positions were global), so only degree 2 continues its data: launch "
        "with that degree, pretokenize the data (gamma-titan pretokenize: any degree resumes shards), or start its "
        "data over with --checkpoint.exclude_from_loading dataloader")
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * 50}) + "\n" for i in range(20)))
    with pytest.raises(ConfigError, match="training.dataset 'hf' is read per rank \\(TorchTitan's text loader\\)"):
        check_at(tmp_path / "run", 1, "--training.dataset", "hf", "--training.dataset_path", str(text),
                 "--validation.enable", "false")
    assert check_at(tmp_path / "run", 1, "--checkpoint.exclude_from_loading", "dataloader") == [
        "resuming step-3 with checkpoint.exclude_from_loading = dataloader: the data starts again from its first "
        "sequence"]


def test_the_loaders_and_the_trainers_checkpoint_forms():
    """The shard loader saves one position any degree continues; it reads TorchTitan's
    per-rank form when the checkpoint holds that. The trainer saves the whole run's tokens,
    and scales TorchTitan's per-rank count by the ranks that saved it."""
    from gamma_titan.data.loader import shard_dataloader
    from gamma_titan.training.trainer import GammaTrainer
    from test_packed import in_order
    from gamma_titan.data.rank_batches import PackedSequences
    from torchtitan.config.job_config import DataLoader

    def loader(rank, world, batch):
        return shard_dataloader(PackedSequences(in_order(), rank, world, batch), rank, world, DataLoader())

    two = loader(1, 2, 3)
    it = iter(two)
    for _ in range(4):
        next(it)
    assert two.state_dict() == {"position": 24}  # 4 global batches of 2 x 3
    one = loader(0, 1, 6)
    one.load_state_dict(two.state_dict())
    first = next(iter(one))[0]["input"]
    whole = loader(0, 1, 6)
    it = iter(whole)
    for _ in range(4):
        expected = next(it)[0]["input"]
    assert torch.equal(first, next(it)[0]["input"]) and not torch.equal(first, expected)
    legacy = loader(1, 2, 3)
    legacy.read_form({"dataloader.dp_rank_0", "dataloader.dp_rank_1", "dataloader.world_size"})
    assert set(legacy.state_dict()) == {"dp_rank_1", "world_size"}  # TorchTitan's form, to be filled
    legacy.read_form({"dataloader.position"})
    assert legacy.state_dict() == {"position": 0}

    trainer = GammaTrainer.__new__(GammaTrainer)
    resumed = []  # the steps TensorBoard is told it resumed at (it purges what follows)
    trainer.metrics_processor = SimpleNamespace(resumed_at=resumed.append)
    trainer.read_form({"train_state.step", "train_state.ntokens_seen", "dataloader.dp_rank_0", "dataloader.dp_rank_1",
                       "dataloader.dp_rank_2", "dataloader.dp_rank_3"})
    trainer.load_state_dict({"step": 5, "ntokens_seen": 100})
    assert (trainer.step, trainer.ntokens_seen) == (5, 400)
    trainer.read_form({"train_state.step", "train_state.tokens_seen"})
    trainer.load_state_dict({"step": 6, "tokens_seen": 700})
    assert (trainer.step, trainer.ntokens_seen, trainer.legacy_train_state) == (6, 700, 0)
    assert resumed == [5, 6]


@pytest.mark.multiprocess
def test_tensorboard_keeps_one_curve_across_resume_extension_and_a_restart_from_an_earlier_step(tmp_path,
                                                                                                 builtin_assets):
    """One TensorBoard run per dump folder: 6 steps, extended to 8 (the same event folder,
    appended), then restarted from the step-4 checkpoint to 7: TensorBoard (read back with
    its own EventAccumulator) shows steps 1-7 once each, 5-7 those of the restart (what
    the first launches logged from step 5 on is purged)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dump = tmp_path / "run"
    validate = ("--validation.enable", "true", "--validation.freq", "3", "--validation.steps", "1")
    run = (*RUN[:-2], *validate, "--checkpoint.interval", "2", "--metrics.enable_tensorboard", "true")
    run_trainer(dump, *run, "--training.steps", "6")
    run_trainer(dump, *run, "--training.steps", "8")
    run_trainer(dump, *run[:-4], "--checkpoint.interval", "100", "--metrics.enable_tensorboard", "true",
                "--checkpoint.load_step", "4", "--training.steps", "7")
    events = EventAccumulator(str(dump / "tb"))
    events.Reload()
    assert sorted({p.parent for p in (dump / "tb").rglob("events.out.tfevents.*")}) == [dump / "tb"]
    scalars = events.Scalars("loss_metrics/global_avg_loss")
    assert [s.step for s in scalars] == list(range(1, 8))
    logged = [(r["step"], r["loss"]) for r in read_metrics(dump)]
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7]  # metrics.jsonl keeps every launch
    assert [round(s.value, 5) for s in scalars[4:]] == [round(loss, 5) for _, loss in logged[-3:]]
    assert [round(s.value, 5) for s in scalars[:4]] == [round(loss, 5) for _, loss in logged[:4]]
    assert [s.step for s in events.Scalars("validation_metrics/loss")] == [1, 3, 6]
    # the README's table of names: each TensorBoard scalar is there, under its metrics.jsonl name
    # in metrics.jsonl (a mixture source's row aside: this run reads one source)
    table = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| [^|]+ \|$", README.split("**TensorBoard**")[1], re.M)
    assert len(table) == 13
    records = read_metrics(dump)
    for board, jsonl in table:
        if "<source>" not in board:
            assert board in events.Tags()["scalars"], board
            assert any(jsonl in r for r in records), jsonl


def test_reading_where_a_checkpoint_stood_warns_nothing(tmp_path):
    """Pre-flight reads a checkpoint's train_state without a process group; torch's two-line
    "torch.distributed is disabled ... single process" warning is not ours to print."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from gamma_titan.training.checkpoint_folders import saved_progress

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"train_state": {"step": 7}}, checkpoint_id=str(tmp_path / "step-7"), no_dist=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        progress = saved_progress(tmp_path / "step-7")
    assert progress["step"] == 7 and not caught, [str(w.message) for w in caught]
