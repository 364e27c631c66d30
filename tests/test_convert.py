"""DCP <-> Hugging Face: dense models without the gate become transformers' Llama, gated
dense and all MoE models the self-contained GammaForCausalLM package; every variant gives
our logits in transformers and round-trips bitwise, through `convert` and through
TorchTitan's `checkpoint.last_save_in_hf` / `initial_load_in_hf` (the family's state-dict
adapter both ways)."""

import json

import pytest
import torch

from helpers import hf_checkpointer, small_args

from gamma_titan.cli import main as cli_main
from gamma_titan.convert.dcp_io import load_model_state, save_model_state
from gamma_titan.convert.model_record import model_record, write_model_record
from gamma_titan.models import TRAIN_SPECS
from gamma_titan.models.dense import GammaDense
from gamma_titan.models.moe import moe_flavors

transformers = pytest.importorskip("transformers")


def _cli(*argv):
    with pytest.raises(SystemExit) as exit_:
        cli_main([str(a) for a in argv])
    return exit_.value.code


def _train(model, steps=3):
    """A few AdamW steps on random tokens: weights that are no longer at their init."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        tokens = torch.randint(0, model.model_args.vocab_size, (2, 33))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad()


def _model(args, seed=0, model_name="gamma_dense", trained=False):
    """A model whose every tensor matters: gates, routers and expert biases drawn wide."""
    torch.manual_seed(seed)
    model = TRAIN_SPECS[model_name].model_cls(args)
    model.init_weights()
    if trained:
        _train(model)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if "gate_proj" in name:  # gates away from 1/2, so a wrongly applied gate shows
                tensor.normal_(0, 0.5)
            if "router.gate" in name:  # routers that separate experts, so routing matters
                tensor.normal_(0, 0.2)
        for name, buffer in model.named_buffers():
            if name.endswith("expert_bias"):  # a bias that changes which experts are chosen
                buffer.normal_(0, 0.1)
    return model


def _checkpoint(root, args, tokenizer, seed=0, model_name="gamma_dense", trained=False):
    """A run folder as the trainer leaves it: checkpoint/step-1 and checkpoint/model.json."""
    model = _model(args, seed, model_name, trained)
    step = root / "checkpoint" / "step-1"
    save_model_state(model.state_dict(), step)
    write_model_record(root / "checkpoint", model_record(model_name, "debug", args, tokenizer))
    return model, step


def _moe_args(flavor, **shape):
    args = moe_flavors[flavor]
    for key, value in shape.items():
        setattr(args, key, value)
    args.check()
    return args


# variant: (model name, args, transformers class)
VARIANTS = {
    "dense-none": ("gamma_dense", lambda: small_args(gamma=0.5, gate="none", n_layers=2, n_kv_heads=2),
                   "LlamaForCausalLM"),
    "dense-headwise": ("gamma_dense", lambda: small_args(gamma=0.5, gate="headwise", n_layers=2, n_kv_heads=2),
                       "GammaForCausalLM"),
    "dense-elementwise": ("gamma_dense", lambda: small_args(gamma=0.5, gate="elementwise", n_layers=2),
                          "GammaForCausalLM"),
    "moe-mha": ("gamma_moe", lambda: _moe_args("debug", n_layers=3, n_kv_heads=2, attention_gate="none"),
                "GammaForCausalLM"),
    "moe-mla": ("gamma_moe", lambda: _moe_args("debug_mla", n_layers=3, score_func="softmax"), "GammaForCausalLM"),
}


@pytest.fixture(scope="module", params=[f"{v}-{state}" for v in VARIANTS for state in ("init", "trained")])
def dense(request, tmp_path_factory, builtin_assets):
    _, tokenizer = builtin_assets
    root = tmp_path_factory.mktemp(f"convert-{request.param}")
    variant, state = request.param.rsplit("-", 1)
    model_name, make_args, hf_class = VARIANTS[variant]
    model, step = _checkpoint(root, make_args(), tokenizer, model_name=model_name, trained=state == "trained")
    model.eval()
    assert _cli("convert", "to-hf", step, root / "hf") == 0
    return root, model, step, hf_class


def test_logits_match_ours_in_transformers(dense):
    root, model, _, hf_class = dense
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32, trust_remote_code=True)
    assert type(hf).__name__ == hf_class
    assert hf.config.rms_norm_eps == 1e-12
    tokens = torch.randint(0, model.model_args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(root / "hf")
    assert (tok.bos_token_id, tok.eos_token_id) == (hf.config.bos_token_id, hf.config.eos_token_id) == (0, 1)
    # right padding (how lm-evaluation-harness batches): the real tokens' logits do not change
    mask = torch.ones_like(tokens)
    mask[1, 40:] = 0
    with torch.no_grad():
        padded = hf(tokens, attention_mask=mask).logits
    assert (padded[1, :40] - theirs[1, :40]).abs().max().item() <= 1e-5


def test_round_trip_is_bitwise(dense, tmp_path):
    root, _, step, _ = dense
    # the weights are as readable as the rest of the folder (safetensors wrote them 0600)
    mode = lambda name: (root / "hf" / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.json")
    assert _cli("convert", "from-hf", root / "hf", tmp_path / "back") == 0
    original, back = load_model_state(step), load_model_state(tmp_path / "back")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) for k in original)
    assert json.loads((tmp_path / "back" / "model.json").read_text())["args"]["norm_eps"] == 1e-12


def test_bf16_and_bad_input_writes_nothing(tmp_path, builtin_assets, capsys):
    model, step = _checkpoint(tmp_path / "run", small_args(gate="none", n_layers=2), builtin_assets[1])
    root = tmp_path / "run"
    assert _cli("convert", "to-hf", step, tmp_path / "bf16", "--dtype", "bf16") == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16")
    assert hf.config.dtype == torch.bfloat16 and hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert hf.model.embed_tokens.weight.equal(model.tok_embeddings.weight.bfloat16())
    assert _cli("convert", "to-hf", step, tmp_path / "fp16", "--dtype", "fp16") == 2
    assert "--dtype fp16: allowed fp32, bf16" in capsys.readouterr().err
    assert _cli("convert", "to-hf", root / "checkpoint", tmp_path / "a") == 2
    assert "is not a DCP checkpoint folder" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert _cli("convert", "to-hf", step, tmp_path / "full") == 2
    assert "exists and is not empty; choose a new folder or pass --overwrite" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    moe_step = tmp_path / "moe" / "checkpoint" / "step-1"  # a dense model's tensors under a MoE model.json
    save_model_state(GammaDense(small_args(n_layers=2)).state_dict(), moe_step)
    write_model_record(moe_step.parent, model_record("gamma_moe", "debug", moe_flavors["debug"], builtin_assets[1]))
    assert _cli("convert", "to-hf", moe_step, tmp_path / "b") == 2
    assert "does not hold the gamma_moe of its model.json" in capsys.readouterr().err
    # another architecture's tensors under this model.json
    _, gated_step = _checkpoint(tmp_path / "gated", small_args(gate="elementwise", n_layers=2), builtin_assets[1])
    write_model_record(gated_step.parent, model_record("gamma_dense", "debug", small_args(gate="none", n_layers=2),
                                                       builtin_assets[1]))
    assert _cli("convert", "to-hf", gated_step, tmp_path / "c") == 2
    assert "does not hold the gamma_dense of its model.json" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c", "fp16"))


def test_an_interrupted_conversion_leaves_nothing_and_the_old_folder_whole(tmp_path, builtin_assets, monkeypatch):
    """Both directions write into a hidden sibling renamed into place when whole: Ctrl-C (or a
    failure) while the weights are written leaves no folder to block the retry, and under
    --overwrite the folder that was there is untouched until the new one is complete."""
    import gamma_titan.convert.hf as hf_module

    _, step = _checkpoint(tmp_path / "run", small_args(gate="none", n_layers=2), builtin_assets[1])
    assert _cli("convert", "to-hf", step, tmp_path / "hf") == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert _cli("convert", "from-hf", tmp_path / "hf", tmp_path / "back") == 0
    old_back = {p.relative_to(tmp_path / "back"): p.read_bytes() for p in (tmp_path / "back").rglob("*") if p.is_file()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf_module, "_write_safetensors", interrupted)
    monkeypatch.setattr(hf_module, "save_model_state", interrupted)
    for argv in (("to-hf", step, tmp_path / "new"), ("to-hf", step, tmp_path / "hf", "--overwrite"),
                 ("from-hf", tmp_path / "hf", tmp_path / "new_back"),
                 ("from-hf", tmp_path / "hf", tmp_path / "back", "--overwrite")):
        assert _cli("convert", *argv) == 130  # the one line of a Ctrl-C
    assert not (tmp_path / "new").exists() and not (tmp_path / "new_back").exists()
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()} == before
    assert {p.relative_to(tmp_path / "back"): p.read_bytes() for p in (tmp_path / "back").rglob("*")
            if p.is_file()} == old_back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["back", "hf", "run"]  # no hidden leftovers



@pytest.mark.parametrize("variant", ["dense-none", "dense-headwise", "moe-mla"])
def test_checkpoints_save_and_load_in_hf(variant, tmp_path, builtin_assets):
    """TorchTitan's own HF path through the family's adapter: `checkpoint.last_save_in_hf`
    writes a folder transformers loads with our logits (and `convert from-hf` reads), and
    `checkpoint.initial_load_in_hf` starts a run from it with the same weights, bitwise."""
    model_name, make_args, hf_class = VARIANTS[variant]
    args, tokenizer = make_args(), builtin_assets[1]
    model = _model(args, model_name=model_name).eval()
    saver = hf_checkpointer(tmp_path, "checkpoint", model, model_name, args, tokenizer,
                             last_save_model_only=True, last_save_in_hf=True)
    saver.save(2, last_step=True)
    step = tmp_path / "checkpoint" / "step-2"
    assert not (step / ".metadata").exists()  # safetensors, not DCP

    hf = transformers.AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32, trust_remote_code=True)
    assert type(hf).__name__ == hf_class
    assert hf.config.rms_norm_eps == 1e-12 and (hf.config.bos_token_id, hf.config.eos_token_id) == (0, 1)
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-4

    fresh = _model(args, seed=1, model_name=model_name)
    loader = hf_checkpointer(tmp_path, "new-run", fresh, model_name, args, tokenizer,
                              initial_load_path=str(step), initial_load_in_hf=True)
    assert loader.load()
    ours, loaded = model.state_dict(), fresh.state_dict()
    assert ours.keys() == loaded.keys() and all(torch.equal(ours[k], loaded[k]) for k in ours)

    assert _cli("convert", "from-hf", step, tmp_path / "back") == 0
    back = load_model_state(tmp_path / "back")
    assert back.keys() == ours.keys() and all(torch.equal(ours[k], back[k]) for k in ours)


def test_from_hf_finds_the_family_or_refuses(tmp_path, capsys):
    """config.json names the family (or its model_type has one reader); otherwise, or for a
    Llama gamma_dense cannot represent, one line names the key, and nothing is written. The
    lists of families and model types are the registry's, in its order (a new family joins them)."""
    adapters = {name: spec.state_dict_adapter for name, spec in TRAIN_SPECS.items() if spec.state_dict_adapter}
    packaged = [name for name, adapter in adapters.items() if "gamma_titan" in adapter.HF_MODEL_TYPES]
    model_types = sorted({t for adapter in adapters.values() for t in adapter.HF_MODEL_TYPES})
    assert {"gamma_dense", "gamma_moe"} <= set(packaged) and {"gamma_titan", "llama"} <= set(model_types)
    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 96, "vocab_size": 512}
    for cfg, message in [
        ({"model_type": "mistral"}, f"model_type 'mistral' cannot be converted; allowed: {', '.join(model_types)}\n"),
        ({"model_type": "gamma_titan"}, f"model_type 'gamma_titan' is read by {', '.join(packaged)}; "
                                        "name one in gamma_titan_model"),
        ({**llama, "gamma_titan_model": "gamma_moe"}, "cannot be converted to gamma_moe; allowed: gamma_titan"),
        ({**llama, "gamma_titan_model": "gpt2"}, f"gamma_titan_model = 'gpt2': allowed {', '.join(adapters)}\n"),
        ({k: v for k, v in llama.items() if k != "hidden_size"}, "config.json: 'hidden_size' is missing"),
        ({**llama, "attention_bias": True, "hidden_act": "gelu"},
         "this Llama uses attention_bias, hidden_act, which gamma_dense does not represent"),
    ]:
        (tmp_path / "hf").mkdir(exist_ok=True)
        (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
        assert _cli("convert", "from-hf", tmp_path / "hf", tmp_path / "out") == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
        assert not (tmp_path / "out").exists()


def test_eval_on_a_local_task_and_the_comparison_table(tmp_path, builtin_assets, capsys):
    """`gamma-titan eval` (lm-evaluation-harness) on converted debug models, offline."""
    pytest.importorskip("lm_eval")
    from gamma_titan.evaluation import compare, run

    questions = [{"question": f"What is {a} plus {b}?", "choices": [str(a + b), str(a + b + 1), str(a * b)],
                  "answer": 0} for a in range(3) for b in range(3)]
    task = tmp_path / "arith.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in questions))
    results = {}
    for variant in ("dense-none", "dense-elementwise"):
        model_name, make_args, _ = VARIANTS[variant]
        _, step = _checkpoint(tmp_path / variant, make_args(), builtin_assets[1], model_name=model_name)
        assert _cli("convert", "to-hf", step, tmp_path / variant / "hf") == 0
        results[variant] = run(tmp_path / variant / "hf", [], local_tasks=[f"arith={task}"], batch_size=4)
        record = json.loads(results[variant].read_text())
        assert record["n_samples"]["arith"]["effective"] == len(questions)
        assert set(record["metrics"]["arith"]) == {"acc", "acc_norm"}
        assert 0 <= record["metrics"]["arith"]["acc"] <= 1
    # the same task as a YAML file of one's own (--include-path)
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arith.yaml").write_text(
        f"task: arith_yaml\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc_norm\n")
    capsys.readouterr()
    yaml_run = tmp_path / "yaml.json"  # through the CLI: it prints the metrics, then where they are
    assert _cli("eval", tmp_path / "dense-none" / "hf", "--tasks", "arith_yaml", "--include-path",
                tmp_path / "tasks", "--out", yaml_run) == 0
    acc_norm = json.loads(yaml_run.read_text())["metrics"]["arith_yaml"]["acc_norm"]
    assert acc_norm == json.loads(results["dense-none"].read_text())["metrics"]["arith"]["acc_norm"]
    printed = capsys.readouterr().out
    assert f"| arith_yaml | acc_norm | {100 * acc_norm:.2f} |" in printed and printed.endswith(f"results: {yaml_run}\n")
    table = compare(results["dense-none"], results["dense-elementwise"], labels=("γ = 0.5", "γ = 1"))
    none, gated = (json.loads(results[v].read_text())["metrics"]["arith"]["acc_norm"] for v in results)
    assert f"| arith | acc_norm | {100 * none:.2f} | {100 * gated:.2f} | {100 * (gated - none):+.2f} |" in table
    assert table.splitlines()[0] == "| task | metric | γ = 0.5 | γ = 1 | gain |"

    # bad input: one line, nothing written
    capsys.readouterr()
    hf = tmp_path / "dense-none" / "hf"
    for argv, message in [
        ((hf, "--local-task", f"arith={tmp_path / 'missing.jsonl'}"), "missing.jsonl does not exist"),
        ((hf, "--local-task", "arith"), "write it as NAME=FILE.jsonl"),
        ((hf, "--local-task", f"arith={task}"), "results.json exists; choose another file or pass --overwrite"),
        ((tmp_path, "--tasks", "hellaswag"), "has no config.json"),
    ]:
        assert _cli("eval", *argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1


def test_eval_leaves_out_gits_line_outside_a_checkout_and_nothing_else(tmp_path, monkeypatch, capfd):
    """lm-eval asks git for a commit hash (`git describe`); outside a checkout git prints
    "fatal: not a git repository" on the terminal. `eval` runs lm-eval with that one line left
    out of its standard error, a subprocess's included; every other byte passes, progress
    bars' carriage returns and a line merely starting like it included."""
    import os
    import subprocess
    import sys

    from gamma_titan.evaluation import GIT_OUTSIDE_A_CHECKOUT, stderr_without

    monkeypatch.chdir(tmp_path)
    probe = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True)
    assert probe.stderr.startswith(GIT_OUTSIDE_A_CHECKOUT.decode())  # the line it is about
    with stderr_without(GIT_OUTSIDE_A_CHECKOUT):
        print("before", file=sys.stderr, flush=True)
        subprocess.run(["git", "describe", "--always"], stdout=subprocess.DEVNULL)
        sys.stderr.write("10%\r50%\r100%\n")
        sys.stderr.flush()
        os.write(2, b"fat")
        os.write(2, b"al: a line of another kind\n")
    print("after", file=sys.stderr, flush=True)
    assert capfd.readouterr().err == "before\n10%\r50%\r100%\nfatal: a line of another kind\nafter\n"
