"""Bad input ends in one line naming the key, exit code 2, and nothing under dump_folder."""

import subprocess
import sys

import pytest

from helpers import DEBUG_TOML, REPO
from gamma_titan.train import main

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

CASES = {
    # id: (extra TOML, CLI overrides, text the message must contain)
    "unknown gamma key": ("[gamma]\ninit_rat = 1.0\n", [], "gamma.init_rat"),
    "unknown model_args key": ("[model_args]\nwidth = 128\n", [], "model_args.width"),
    "unknown override group": ("[gamma.init_rate_overrides]\nexperts = 1.0\n", [], "gamma.init_rate_overrides.experts"),
    "init_rate zero": ("[gamma]\ninit_rate = 0.0\n", [], "gamma.init_rate"),
    "init_rate too large": ("[gamma]\ninit_rate = 4.5\n", [], "gamma.init_rate"),
    "init_rate not a number": ("[gamma]\ninit_rate = \"one\"\n", [], "gamma.init_rate"),
    "override out of range": ("[gamma.init_rate_overrides]\noutput = -1.0\n", [], "gamma.init_rate_overrides.output"),
    "norm_eps zero": ("[gamma]\nnorm_eps = 0.0\n", [], "gamma.norm_eps"),
    "norm_eps negative": ("", ["--gamma.norm_eps", "-1e-5"], "gamma.norm_eps"),
    "unknown gate": ("[gamma]\nattention_gate = \"sometimes\"\n", [], "gamma.attention_gate"),
    "heads do not divide width": ("[model_args]\nn_heads = 3\n", [], "model_args.n_heads"),
    "kv heads do not divide heads": ("", ["--model_args.n_kv_heads", "3"], "model_args.n_kv_heads"),
    "unknown flavor": ("", ["--model.flavor", "13B"], "model.flavor"),
    "unknown model": ("", ["--model.name", "gamma_sparse"], "model.name"),
    "missing dataset file": ("", ["--training.dataset", "hf", "--training.dataset_path", "/nonexistent/data.jsonl"],
                             "training.dataset_path"),
    "unknown dataset": ("", ["--training.dataset", "c5"], "training.dataset"),
    "missing tokenizer": ("", ["--model.hf_assets_path", "/nonexistent/tokenizer"], "model.hf_assets_path"),
    "vocabulary does not fit": ("[model_args]\nvocab_size = 1000\n", [], "vocab_size"),
    "unknown CLI option": ("", ["--gamma.init_rates", "1.0"], "--gamma.init_rates"),
    "CLI value of the wrong type": ("", ["--gamma.init_rate", "abc"], "gamma.init-rate"),
    "model_args value of the wrong type": ("[model_args]\ndim = \"wide\"\n", [], "model_args.dim"),
    "experts not divisible by EP": ("", ["--model.name", "gamma_moe", "--parallelism.expert_parallel_degree", "3"],
                                    "model_args.n_routed_experts"),
    "EP on a dense model": ("", ["--parallelism.expert_parallel_degree", "2"], "expert_parallel_degree"),
    "top-k above experts": ("", ["--model.name", "gamma_moe", "--model_args.top_k", "9"], "model_args.top_k"),
    "MLA rank that does not fit": ("", ["--model.name", "gamma_moe", "--model.flavor", "debug_mla",
                                        "--model_args.kv_lora_rank", "512"], "model_args.kv_lora_rank"),
    "MoE key on a dense model": ("[model_args]\ntop_k = 2\n", [], "model_args.top_k"),
    "gate unknown to MLA": ("", ["--model.name", "gamma_moe", "--model.flavor", "debug_mla",
                                 "--gamma.attention_gate", "channelwise"], "attention-gate"),
    "TP not dividing MoE width": ("", ["--model.name", "gamma_moe", "--model_args.moe_hidden_dim", "129",
                                       "--parallelism.tensor_parallel_degree", "2"], "moe_hidden_dim"),
    "unknown diagnostics key": ("[gamma.diagnostics]\nfrequency = 10\n", [], "gamma.diagnostics.frequency"),
    "diagnostics freq zero": ("[gamma.diagnostics]\nenable = true\nfreq = 0\n", [], "gamma.diagnostics.freq"),
    "probe batch negative": ("", ["--gamma.diagnostics.probe_batch", "-2"], "gamma.diagnostics.probe_batch"),
    "cosine map of a missing weight": ("[gamma.diagnostics]\nenable = true\ncosine_params = [\"layers.9.attention.wo.weight\"]\n",
                                       [], "gamma.diagnostics.cosine_params"),
    "probe data that does not exist": ("", ["--gamma.diagnostics.enable", "true", "--validation.dataset", "hf",
                                            "--validation.dataset_path", "/nonexistent/val.jsonl"], "validation.dataset_path"),
    "tp does not divide world": ("", ["--parallelism.tensor_parallel_degree", "2"], "world size"),
    "tp does not divide heads": ("", ["--parallelism.tensor_parallel_degree", "3"], "model_args.n_heads"),
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
    assert len(lines) == 1 and lines[0].startswith("error: ") and "attention-gate" in lines[0], lines
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
