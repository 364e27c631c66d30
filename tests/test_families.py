"""The family matrix: every registered model family — the package's own (gamma_titan/models/),
TorchTitan's with the knobs, and those installed by entry points (tests/families/, installed
for the session by tests/conftest.py, as a user's own package would be) — is trained by the
same few launches, with no list to edit when a family is added:

* one process (the reference; checkpointed), and again in 2 micro-batches (the tolerance);
* FSDP 2, TP 2, PP 2 and DDP 2 in one 2-rank launch: the losses, validation loss and every
  rank's final parameters as one process's, within 25x what the micro-batches alone move
  (as tests/test_layouts.py measures its tolerances); for a family with routed experts,
  which route by their real top-k scores (and expert bias) here, also EP 2 where pre-flight
  takes it on a CPU, TP 2 with torch.compile (TorchTitan's apply_compile wraps each router),
  and round-robin routing (debug.moe_force_load_balance), FSDP 2 against one process;
* the live diagnostics at step 1 (sink score, residual flow, ε-domination per norm), the
  same on FSDP 2 and TP 2 as on one process;
* the checkpoint converted to Hugging Face (`convert to-hf`), loaded by transformers with
  the logits of our model, and back (`convert from-hf`) bit for bit.

Each family's config is its debug config (configs/*/*debug.toml naming it), else the dense
one with the family's first flavor (helpers.family_debug_config). A layout pre-flight
refuses on a CPU is skipped, naming the refusal. The families tests/test_layouts.py trains
at every kind of layout (gamma_dense, gamma_moe: the depth axis, with resumes, schedules,
diagnostics and a Hugging Face export) are left to it."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import REPO, family_debug_config, key_reads_of, launch_cases, read_metrics, relative

from gamma_titan.models import TRAIN_SPECS

pytestmark = pytest.mark.multiprocess



def depth_matrix_families() -> set[str]:
    """The families tests/test_layouts.py trains at every kind of layout (its configs'
    models), with their diagnostics, resumes and a Hugging Face export: the family matrix
    would repeat it."""
    import tomllib

    from test_layouts import FAMILIES as DEPTH

    return {tomllib.loads((REPO / config).read_text())["model"]["name"] for config, _ in DEPTH.values()}


FAMILIES = sorted(set(TRAIN_SPECS) - depth_matrix_families())
STEPS = 2
GLOBAL_BATCH = 4
#: A small learning rate: Adam's first updates, lr·sign(g), turn last-bit differences of
#: near-zero gradients into lr-sized ones (tests/titan_cases.py measures it for deepseek_v3).
RUN = ("--training.steps", str(STEPS), "--training.seq_len", "64", "--training.global_batch_size",
       str(GLOBAL_BATCH), "--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "3e-4",
       "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
       "--debug.deterministic", "true", "--debug.seed", "7",
       "--validation.enable", "true", "--validation.freq", str(STEPS), "--validation.steps", "1",
       "--validation.local_batch_size", "8", "--validation.seq_len", "64",
       "--gamma.diagnostics.freq", "100", "--gamma.diagnostics.probe_batch", "2",
       "--optimizer.weight_decay_policy", "megatron")  # Megatron-LM's groups, at every layout
#: The least parameter tolerance. The layouts' parameters measured up to 1.1e-4 of the update
#: apart after 3 steps of 8 sequences at this lr (gamma_sandwich PP 2: near-zero gradients of
#: the post-norms' sublayers, where Adam's lr·sign(g) magnifies another summation order), up to
#: 2.2e-5 after these 2 steps of 4, where 2 micro-batches happened to add up closer; real errors
#: are far above it (a halved gradient: 0.1; validation left in MoE load counters: 2.6e-2).
PARAMS_FLOOR = 1e-3
DIAGNOSTICS = {True: ("--gamma.diagnostics.enable", "true"), False: ("--gamma.diagnostics.enable", "false")}
#: name: (degrees, live diagnostics). The diagnostics need the whole model on a rank:
#: pre-flight refuses them under PP.
LAYOUTS = {"one": ({}, True), "ga2": ({}, False), "fsdp2": ({"shard": 2}, True), "tp2": ({"tp": 2}, True),
           "tp2c": ({"tp": 2}, True), "pp2": ({"pp": 2}, False), "ddp2": ({"replicate": 2}, True),
           "ep2": ({"shard": 2, "ep": 2}, True), "one_forced": ({}, False), "fsdp2_forced": ({"shard": 2}, False)}
#: Routed experts route by their real top-k scores (and expert bias) at every layout; these
#: two layouts route round-robin instead (TorchTitan's debug.moe_force_load_balance), one
#: process against FSDP 2. A family without routed experts skips them and ep2.
FORCED = {"one_forced": ("--debug.moe_force_load_balance", "true"),
          "fsdp2_forced": ("--debug.moe_force_load_balance", "true")}
#: The run each layout is compared with.
REFERENCE = {"fsdp2_forced": "one_forced"}
#: Layouts trained with torch.compile (the eager backend: the module tree and the traced graph
#: of a GPU run, without Inductor's compile time), and the families they are for: those with
#: routed experts, whose router TorchTitan's apply_compile swaps for a compiled wrapper (a
#: family without them compiles its blocks whole, which tp2 already trains the math of).
COMPILED = {"tp2c": ("--compile.enable", "true", "--compile.backend", "eager")}


def family_argv(family: str) -> tuple[list[str], object]:
    """The family's run, and the layout rules pre-flight applies to it on this machine."""
    from gamma_titan.config import load_job_config
    from gamma_titan.training.layout import LayoutRules
    from gamma_titan.training.train_spec import resolve_model

    config, overrides = family_debug_config(family)
    argv = ["--job.config_file", str(config), *overrides, *RUN]
    _, args = resolve_model(load_job_config(argv))
    return argv, LayoutRules(args, family, cuda=False)


def cases(family: str) -> tuple[dict[int, list[dict]], dict[str, str]]:
    """The family's runs by world size, and the layouts pre-flight refuses on this machine
    (layout: its one-line reason; such a family's runs there are a GPU's: tools/gpu_check.sh)."""
    from gamma_titan.training.layout import Layout

    (argv, rules), out, refused = family_argv(family), {}, {}
    routed = rules.args.expert_parallel_divisor() > 1
    for name, (degrees, diagnostics) in LAYOUTS.items():
        layout = Layout(**degrees)
        problem = rules.problem(layout)
        if name in COMPILED and not routed:
            problem = ("no routed experts: compile wraps no router here",)
        if name in FORCED and not routed:
            problem = ("no routed experts: no routing to force",)
        if problem is not None:
            refused[name] = problem[0]
            continue
        local = GLOBAL_BATCH // layout.data_parallel // (2 if name == "ga2" else 1)
        saves = name in ("one", "one_forced")
        case = {"name": f"{family}-{name}", "save": saves,
                "reference": None if saves else f"{family}-{REFERENCE.get(name, 'one')}",
                "argv": [*argv, *layout.flags().split(), "--training.local_batch_size", str(local),
                         *DIAGNOSTICS[diagnostics], *COMPILED.get(name, ()), *FORCED.get(name, ())]}
        if name == "one":
            case["argv"] += ["--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS)]
        out.setdefault(layout.world, []).append(case)
    assert not refused.keys() & {"one", "ga2"}, refused  # every family trains on one process
    return out, refused


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory, builtin_assets) -> dict:
    """One family's matrix: its runs, after one launch of 1 process and one of 2."""
    name = request.param
    out = tmp_path_factory.mktemp(f"family-{name}")
    launches, refused = cases(name)
    for world, batch in sorted(launches.items()):
        launch_cases(out, world, batch, timeout=900)
    runs = {}
    argvs = {case["name"]: case["argv"] for batch in launches.values() for case in batch}
    for layout in LAYOUTS.keys() - refused.keys():
        dump = out / f"{name}-{layout}"
        params = dump / "params.json"
        runs[layout] = {"dir": dump, "records": read_metrics(dump), "argv": argvs[f"{name}-{layout}"],
                        "params": json.loads(params.read_text()) if params.exists() else None}
    ref = runs["one"]
    tolerance = {"loss": max(25 * relative(losses(runs["ga2"]), losses(ref)), 1e-6),
                 "params": max(25 * runs["ga2"]["params"][0]["update_rel_diff"], PARAMS_FLOOR)}
    for layout in sorted(runs.keys() - {"one", "ga2", "one_forced"}):
        worst = max(rank["update_rel_diff"] for rank in runs[layout]["params"])
        against = runs[REFERENCE.get(layout, "one")]
        print(f"{name} {layout}: loss {relative(losses(runs[layout]), losses(against)):.1e} "
              f"(allowed {tolerance['loss']:.1e}), parameters {worst:.1e} (allowed {tolerance['params']:.1e})")
    return {"name": name, "runs": runs, "tolerance": tolerance, "refused": refused}


def trained(family: dict, layout: str) -> dict:
    """The layout's run, or a skip naming why pre-flight refuses it here (or why it is not
    the family's)."""
    if layout in family["refused"]:
        pytest.skip(f"{family['name']} {layout}: not trained here: {family['refused'][layout]}")
    return family["runs"][layout]


def losses(run: dict) -> list[float]:
    return [r["loss"] for r in run["records"] if "loss" in r]


def loads(run: dict) -> list[float]:
    """Every logged busiest-expert load over the mean (MoE layers, every step)."""
    return [v for r in run["records"] for k, v in r.items() if k.startswith("moe/load_max_over_mean/")]


def val_losses(run: dict) -> list[tuple[int, float]]:
    return [(r["step"], r["val_loss"]) for r in run["records"] if "val_loss" in r]


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2c", "pp2", "ddp2", "ep2", "fsdp2_forced"])
def test_two_ranks_train_the_model_one_process_trains(family, layout):
    run, tol = trained(family, layout), family["tolerance"]
    ref = family["runs"][REFERENCE.get(layout, "one")]
    assert len(losses(ref)) == STEPS and losses(ref)[-1] < losses(ref)[0]
    assert relative(losses(run), losses(ref)) <= tol["loss"], (losses(run), losses(ref), tol)
    assert [s for s, _ in val_losses(run)] == [s for s, _ in val_losses(ref)] == [1, STEPS]
    assert relative([v for _, v in val_losses(run)], [v for _, v in val_losses(ref)]) <= tol["loss"]
    ranks = run["params"]
    assert len(ranks) == 2
    for rank, numbers in enumerate(ranks):  # each rank's own replica (its stage's, under PP)
        assert numbers["update_rel_diff"] <= tol["params"], (rank, numbers, tol)
    assert len({n for numbers in ranks for n in numbers["names"]}) == ranks[0]["reference_names"]
    # a weight held whole on both ranks (a replica's, a TP-replicated norm's) is the same on both:
    # a norm planned NoParallel inside attention drifts apart there while the losses agree
    held = json.loads((run["dir"] / "run.json").read_text())
    assert held["copies_differ"] == [], held["copies_differ"]
    if layout in ("tp2", "tp2c", "ddp2"):
        assert held["unsharded"] > 0
    if layout == "pp2":  # two stages, each a part of the model
        assert all(len(numbers["names"]) < ranks[0]["reference_names"] for numbers in ranks)
    if layout == "fsdp2_forced":  # round-robin: every expert as busy as the mean; real routing is not
        assert loads(run) and set(loads(run)) == set(loads(ref)) == {1.0}
        assert max(loads(family["runs"]["one"])) > 1.0
    if layout == "ddp2":  # replicas sum the gradient of the global mean, not average it again
        grad_norms = [[r["grad_norm"] for r in x["records"] if "grad_norm" in r] for x in (run, ref)]
        assert grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-4)


def test_every_key_is_read_by_the_runs_that_set_it(family):
    """Measured, not searched for in the sources: each run of the matrix recorded which
    config keys its trainer read, and who read them (tests/scripts/key_reads.py). Every key
    a run sets is read by code that acts on it, or before the trainer starts, or waits for
    a switch that is off (`checkpoint.enable = false`); every TorchTitan key is read by some
    run, or refused by pre-flight, or off in all of them (tests/helpers.py key_reads_of)."""
    ignored, never = key_reads_of([(run["argv"], run["dir"]) for run in family["runs"].values()])
    assert not ignored, f"set and never read: {ignored}"
    assert not never, f"{family['name']}: on and never read: {never}"


def test_the_tolerance_is_measured_and_tight(family):
    """2 micro-batches add the same numbers in another order: the bound is 25x that."""
    assert family["tolerance"]["loss"] < 1e-4 and family["tolerance"]["params"] < 1e-2, family["tolerance"]


def diagnostics(run: dict) -> dict[str, float]:
    return {f"{r['step']}:{k}": v for r in run["records"] for k, v in r.items()
            if k.startswith("gamma/") and k != "gamma/diagnostics_seconds"}


@pytest.mark.parametrize("layout", ["fsdp2", "tp2", "tp2c", "ddp2", "ep2"])
def test_the_live_diagnostics_match_one_process(family, layout):
    """At step 1: the sink score, the residual flow read at the blocks' boundaries and the
    ε-domination at every norm, wherever the block puts its norms."""
    single, other = diagnostics(family["runs"]["one"]), diagnostics(trained(family, layout))
    assert {k.split(":")[0] for k in single} == {"1"}
    assert "1:gamma/residual_flow_ratio" in single and "1:gamma/sink_score/mean" in single
    assert 0 < single["1:gamma/residual_flow_ratio"] < math.inf  # post-norms add unit-RMS terms: 170 for gamma_sandwich
    assert any("eps_dominated_fraction/layer_0/" in k for k in single), sorted(single)
    assert set(other) == set(single)
    for key, value in single.items():
        assert other[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def test_the_checkpoint_converts_to_hugging_face_and_back(family, tmp_path, capsys):
    """transformers gives our logits (its own class or our package's, with the family's
    block), and from-hf gives every tensor back bit for bit; a family whose adapter reads no
    Hugging Face folder (deepseek_v3: TorchTitan's initial_load_in_hf does) says so in one line."""
    transformers = pytest.importorskip("transformers")
    from gamma_titan.cli import main as cli_main
    from gamma_titan.convert.dcp_io import load_model_state
    from gamma_titan.reports.tokens import load_model

    step = family["runs"]["one"]["dir"] / "checkpoint" / f"step-{STEPS}"
    bias = [v for k, v in load_model_state(step).items() if k.endswith("expert_bias")]
    assert all(b.abs().sum() > 0 for b in bias)  # routed by top-k, the expert bias trained: converted too
    # transformers caches remote code by the folder's name: one name per family
    hf_dir = tmp_path / f"hf_{family['name']}"
    back = TRAIN_SPECS[family["name"]].state_dict_adapter.HF_MODEL_TYPES
    for argv in (["to-hf", step, hf_dir], ["from-hf", hf_dir, tmp_path / "back"]):
        with pytest.raises(SystemExit) as done:
            cli_main(["convert", *map(str, argv)])
        assert done.value.code == (0 if back or argv[0] == "to-hf" else 2)
    if not back:
        [line] = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        assert f"gamma_titan_model = '{family['name']}'" in line and not (tmp_path / "back").exists()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, trust_remote_code=True)
    model, _ = load_model(step, key="CHECKPOINT_DIR")
    tokens = torch.randint(0, hf.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        assert ours.abs().max() > 1e-3 and (ours - hf(tokens).logits).abs().max().item() <= 1e-4
    if back:
        original, returned = load_model_state(step), load_model_state(tmp_path / "back")
        assert original.keys() == returned.keys() and all(torch.equal(original[k], returned[k]) for k in original)
