"""TorchTitan's models with the paper's knobs, trained: a checkpoint converts to Hugging Face
with the same logits, to transformers' own class where the knobs allow it. (Their FSDP, TP,
PP and DDP runs against one process: the family matrix, tests/test_families.py.) One module
fixture trains each (model, layout) once."""

import json

import pytest
import torch

from titan_cases import SMALL_BATCH, TITAN_CONFIGS


#: The gated llama3, qwen3 and deepseek_v3 (GammaForCausalLM; deepseek_v3's routed by its
#: top-k scores, its expert bias trained) convert in the family matrix (tests/test_families.py).
HF_CLASSES = {"llama3": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("model", sorted(HF_CLASSES))
def test_trained_checkpoint_converts_to_hf_with_the_same_logits(model, titan_run, tmp_path, capsys):
    """A trained checkpoint without the gate: TorchTitan's mapping to transformers' own class
    (Llama, Qwen3; ε = 1e-12 in its config); transformers' logits equal the model's to 1e-4.
    (Gated, GammaForCausalLM: the family matrix; deepseek_v3's ungated and sigmoid-routed
    forms: test_titan.py, on random weights.)"""
    transformers = pytest.importorskip("transformers")
    from gamma_titan.convert.dcp_io import load_model_state
    from gamma_titan.convert.hf import to_hf
    from gamma_titan.convert.model_record import read_model_record
    from gamma_titan.models import TRAIN_SPECS

    step = titan_run(model) / "checkpoint" / "step-4"
    name, args, _ = read_model_record(step)
    assert name == model and args.attention_gate == "none" and args.init.rate == 1.0
    net = TRAIN_SPECS[model].model_cls(args)
    net.load_state_dict(load_model_state(step))
    folder = to_hf(step, tmp_path / "hf", progress=True)
    assert "GammaForCausalLM" not in capsys.readouterr().err  # transformers' own class, no package of ours
    config = json.loads((folder / "config.json").read_text())
    hf_class = HF_CLASSES[model]
    assert config["architectures"] == [hf_class] and config["rms_norm_eps"] == 1e-12
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True)
    assert type(hf).__name__ == hf_class
    seq = min(96, args.max_seq_len)  # the rotary table's length (qwen3 here: trained at 64)
    tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = net(tokens), hf(tokens).logits
    assert ours.abs().max() > 1e-3  # trained logits, not a zero model
    assert (ours - theirs).abs().max().item() <= 1e-4


@pytest.fixture(scope="module")
def titan_run(tmp_path_factory, builtin_assets):
    """`titan_run(model)`: the dump folder of 4 deterministic steps of the model's debug
    config with γ-init and ε, without the gate, validated at steps 1 and 4 and checkpointed
    at step 4, on one process. Each runs once, when first asked for."""
    from helpers import QUIET, run_trainer

    dumps = {}

    def run(model: str):
        if model not in dumps:
            dump = tmp_path_factory.mktemp(f"{model}_ungated") / "run"
            run_trainer(dump, *QUIET, "--training.steps", "4", "--debug.deterministic", "true",
                        "--optimizer.weight_decay_policy", "megatron",
                        "--validation.enable", "true", "--validation.freq", "4", "--validation.steps", "2",
                        "--checkpoint.enable", "true", "--checkpoint.interval", "4",
                        "--gamma.attention_gate", "none", *SMALL_BATCH[model], config=TITAN_CONFIGS[model])
            dumps[model] = dump
        return dumps[model]

    return run
