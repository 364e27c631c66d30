"""FSDP and TP on CPU (gloo, 2 processes) against a single-process reference: the same
initial weights, and checkpoints that convert to the same Hugging Face tensors. (Losses,
parameters and diagnostics of every layout against one process: test_layouts.py.)"""

import os
import subprocess
import sys

import pytest
import torch

from helpers import DEBUG_TOML, QUIET, REPO

pytestmark = pytest.mark.multiprocess

DETERMINISTIC = ("--debug.deterministic", "true", "--debug.seed", "7")
LAYOUTS = {
    # name: (processes, local batch, extra overrides); the global batch is 4 everywhere
    "single": (1, 4, ()),
    "fsdp2": (2, 2, ("--parallelism.data_parallel_shard_degree", "2")),
    "tp2": (2, 4, ("--parallelism.tensor_parallel_degree", "2",
                   "--parallelism.data_parallel_shard_degree", "1")),
}


def dump_init(tmp_path, layout: str) -> dict:
    nproc, batch, extra = LAYOUTS[layout]
    out = tmp_path / f"init-{layout}.pt"
    script = str(REPO / "tests" / "scripts" / "dump_init_weights.py")
    argv = [script, str(out), "--job.config_file", str(DEBUG_TOML),
            "--job.dump_folder", str(tmp_path / f"dump-{layout}"),
            "--training.local_batch_size", str(batch), "--checkpoint.enable", "true",
            *QUIET, *DETERMINISTIC, *extra]
    if nproc > 1:
        argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return torch.load(out)


def test_initial_weights_do_not_depend_on_parallel_degrees(tmp_path, builtin_assets):
    single = dump_init(tmp_path, "single")
    for layout in ("fsdp2", "tp2"):
        other = dump_init(tmp_path, layout)
        assert list(other) == list(single)
        for name, tensor in single.items():
            assert torch.equal(other[name], tensor), (layout, name)
    # and they are γ-initialised (γ = 1, d = 256), not some default
    assert abs(single["layers.0.attention.wq.weight"].std().item() * 256 - 1) < 0.05
    # Their DCP checkpoints, saved sharded at each layout, convert to the same HF tensors.
    from safetensors.torch import load_file

    from gamma_titan.convert.hf import to_hf

    converted = {}
    for layout in ("single", "fsdp2", "tp2"):
        folder = to_hf(tmp_path / f"dump-{layout}" / "checkpoint" / "step-0", tmp_path / f"hf-{layout}",
                       progress=False)
        converted[layout] = load_file(str(folder / "model.safetensors"))
    assert converted["single"]["model.layers.0.attention.wq.weight"].equal(single["layers.0.attention.wq.weight"])
    for layout in ("fsdp2", "tp2"):
        assert converted[layout].keys() == converted["single"].keys()
        assert all(converted[layout][k].equal(v) for k, v in converted["single"].items()), layout


def test_float8_tensor_parallel_plans_fit_every_gate(tmp_path):
    """Tensorwise float8 with TP 2, for every attention gate of gamma_dense and gamma_moe
    (MHA, MLA): the plan builds and a forward and backward run through it (on torch's fake
    process group: gloo cannot all-gather float8, tests/scripts/float8_tensor_parallel.py).
    The headwise gate's projection stays in high precision (too narrow for float8's scaled
    matmuls) and is column-split with torch's style, the others with torchao's; before,
    every rank failed at build time ("Expecting module to be Float8Linear")."""
    import json

    out = tmp_path / "float8_tp.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "float8_tensor_parallel.py"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert len(cases) == 9
    for name, case in cases.items():
        assert case["gradients"] == case["parameters"], name  # the backward reached every parameter
        linears = case["attention_linears"]
        assert ("gate_proj" in linears) == (not name.endswith("-none")), name
        for module, kind in linears.items():
            assert kind == ("Linear" if module == "gate_proj" and name.endswith("-headwise") else "Float8Linear")
        heads_in = [m for m in linears if m in ("wq", "wk", "wv", "wq_b", "wkv_b", "gate_proj")]
        assert all(case["column_split"][m] for m in heads_in), (name, case["column_split"])


def test_every_torchtitan_router_gets_its_tp_gradient_fix_through_compile_and_ac(tmp_path):
    """deepseek_v3 (5 MoE layers) and qwen3's MoE flavor (8) under TP 2 with torch.compile,
    with and without full activation checkpointing, parallelized by their families'
    functions (torch's fake process group, tests/scripts/compiled_routers.py): every MoE's
    router is TorchTitan's compiled wrapper of our CountingRouter, and every one has the
    group its score gradient is summed over. Before: 0 of 5 and 0 of 8 (the fix tested the
    wrapper's type), and deepseek_v3 TP 2 + compile trained a router whose update was
    1.9e-2 of the update off one process's (test_families.py, tp2c)."""
    import json

    out = tmp_path / "routers.json"
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "compiled_routers.py"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert {name: len(layers) for name, layers in cases.items()} == {
        "deepseek_v3-compile": 5, "deepseek_v3-ac+compile": 5, "qwen3_moe-compile": 8, "qwen3_moe-ac+compile": 8}
    for name, layers in cases.items():
        for layer in layers:
            assert (layer["wrapper"], layer["router"], layer["score_grad_group"]) == \
                ("OptimizedModule", "CountingRouter", True), (name, layer)
