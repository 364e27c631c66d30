"""Bad input ends in one line naming the key, exit code 2, and nothing under dump_folder."""

import subprocess
import sys

import pytest

from helpers import DEBUG_TOML, REPO
from gamma_titan.training.main import main

BASE = """
[job]
dump_folder = "{dump}"
[model]
name = "gamma_dense"
flavor = "debug"
hf_assets_path = "builtin"
[training]
dataset = "builtin"
seq_len = 64
steps = 2
"""

# Through `main` (exit code 2, one line, nothing written), from TOML or the command line.
# Every other bad value is in test_config_battery.py's table with its exact pre-flight
# message: each case lives in one of the two tables.
CASES = {
    # id: (extra TOML, CLI overrides, text the message must contain)
    "unknown gamma key": ("[gamma]\ninit_rat = 1.0\n", [], "gamma.init_rat"),
    "unknown model_args key": ("[model_args]\nwidth = 128\n", [], "model_args.width"),
    "unknown override group": ("[gamma.init_rate_overrides]\nexperts = 1.0\n", [], "gamma.init_rate_overrides.experts"),
    "init_rate not a number": ("[gamma]\ninit_rate = \"one\"\n", [], "gamma.init_rate"),
    "missing dataset file": ("", ["--training.dataset", "hf", "--training.dataset_path", "/nonexistent/data.jsonl"],
                             "training.dataset_path"),
    "unknown CLI option": ("", ["--gamma.init_rates", "1.0"], "--gamma.init_rates"),
    "CLI value of the wrong type": ("", ["--gamma.init_rate", "abc"], "gamma.init_rate"),
    "model_args value of the wrong type": ("[model_args]\ndim = \"wide\"\n", [], "model_args.dim"),
    "MLA rank that does not fit": ("", ["--model.name", "gamma_moe", "--model.flavor", "debug_mla",
                                        "--model_args.kv_lora_rank", "512"], "model_args.kv_lora_rank"),
    "MoE key on a dense model": ("[model_args]\ntop_k = 2\n", [], "model_args.top_k"),
    "unknown diagnostics key": ("[gamma.diagnostics]\nfrequency = 10\n", [], "gamma.diagnostics.frequency"),
    "probe batch negative": ("", ["--gamma.diagnostics.probe_batch", "-2"], "gamma.diagnostics.probe_batch"),
    "probe data that does not exist": ("", ["--gamma.diagnostics.enable", "true", "--validation.dataset", "hf",
                                            "--validation.dataset_path", "/nonexistent/val.jsonl"], "validation.dataset_path"),
    "tp does not divide world": ("", ["--parallelism.tensor_parallel_degree", "2"], "world size"),
}


def run_main(argv, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, capsys, builtin_assets):
    extra, overrides, expected = CASES[case]
    dump = tmp_path / "run"
    config = tmp_path / "bad.toml"
    config.write_text(BASE.format(dump=dump) + extra)
    code, err = run_main(["--job.config_file", str(config), *overrides], capsys)
    lines = err.strip().splitlines()
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expected in lines[0], lines[0]
    assert not dump.exists()


def test_invalid_toml_and_missing_file(tmp_path, capsys):
    broken = tmp_path / "broken.toml"
    broken.write_text("[gamma\ninit_rate = 1\n")
    code, err = run_main(["--job.config_file", str(broken)], capsys)
    assert code == 2 and "not valid TOML" in err and len(err.strip().splitlines()) == 1
    code, err = run_main(["--job.config_file", str(tmp_path / "nope.toml")], capsys)
    assert code == 2 and "job.config_file" in err and len(err.strip().splitlines()) == 1


def test_cli_launcher_fails_before_torchrun(tmp_path, builtin_assets):
    dump = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gamma_titan.cli", "train", str(DEBUG_TOML), "--nproc", "2",
         "--job.dump_folder", str(dump), "--gamma.attention_gate", "sometimes"],
        cwd=REPO, capture_output=True, text=True,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0] == ("error: gamma.attention_gate = 'sometimes': allowed none, "
                                                              "headwise, elementwise"), lines
    assert "torch.distributed.run" not in proc.stdout
    assert not dump.exists()


def test_boolean_overrides_accept_true_false(tmp_path):
    from gamma_titan.config import load_job_config

    config = load_job_config(["--job.config_file", str(DEBUG_TOML), "--validation.enable", "false",
                              "--metrics.enable_tensorboard=false", "--compile.enable", "true"])
    assert config.validation.enable is False
    assert config.metrics.enable_tensorboard is False
    assert config.compile.enable is True
    assert config.gamma.attention_gate == "elementwise"
    assert config.model_args.dim is None
