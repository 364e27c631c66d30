"""The tuned ladder (gamma_titan/grid_search.py, recipes/tuned.py, reports/ladder.py): the search's
bracketing and grid extension, the choice of best, the rounds a rerun plans from the results
in OUT, and the effective-size gain and Δ slope against hand-computed cases. Seconds: no
training (results are written as a finished run's metrics.jsonl)."""

import json
import math
from pathlib import Path

import pytest

from gamma_titan.errors import ConfigError
from gamma_titan.recipes.execute import _same_runs
from gamma_titan.recipes.run import execute, plan_recipe
from gamma_titan.recipes.spec import load_recipe
from gamma_titan.grid_search import AT_HIGHEST, AT_LOWEST, BRACKETED, DIVERGED, FAILED, SEARCHING, Search, \
    parse_tune, wanted_runs
from gamma_titan.reports import ladder

TUNE = {"key": "optimizer.lr", "per_decade": 2, "start": 3.16228e-3, "stop": 3.16228e-2, "lowest": 1e-4,
        "highest": 0.316228}


def tune(**changes):
    return parse_tune({**TUNE, **changes}, "r.toml", set())


# --- the grid and its checks -------------------------------------------------------------


def test_the_grid_is_indices_of_a_log_scale():
    t = tune()
    assert (t.start, t.stop, t.lowest, t.highest) == (-5, -3, -8, -1)
    assert [t.value(i) for i in t.first_grid] == [0.00316228, 0.01, 0.0316228]
    assert t.index(0.01) == -4 and t.index(0.00316228) == -5
    assert type(t).from_json(t.to_json()) == t


@pytest.mark.parametrize("changes, message", [
    ({"start": 5e-3}, "[tune] start = 0.005: not on the grid of 2 values per decade (10^(i/2)); nearest 0.001, 0.00316228, 0.01"),
    ({"lowest": 1e-2}, "[tune]: needs lowest <= start < stop <= highest"),
    ({"stop": 3.16228e-3}, "[tune]: needs lowest <= start < stop <= highest"),
    ({"per_decade": 0}, "[tune] per_decade = 0: an integer from 1 to 10"),
    ({"step": 2}, "[tune]: unknown key 'step'; allowed highest, key, lowest, per_decade, start, stop"),
    ({"key": "lr"}, "[tune] key = 'lr': a config key such as \"optimizer.lr\""),
])
def test_a_bad_tune_table_is_one_line(changes, message):
    with pytest.raises(ConfigError) as e:
        tune(**changes)
    assert str(e.value) == f"r.toml {message}"


def test_the_tuned_key_cannot_also_be_set_by_the_recipe():
    with pytest.raises(ConfigError, match=r"key = 'optimizer.lr': the recipe also sets it"):
        parse_tune(TUNE, "r.toml", {"optimizer.lr"})


# --- one search --------------------------------------------------------------------------


@pytest.mark.parametrize("losses, expected", [
    ({-5: 3.0, -4: 2.5, -3: 2.7}, (BRACKETED, -4, {-5, -4, -3})),
    ({-5: 2.4, -4: 2.5, -3: 2.7}, (SEARCHING, None, {-6, -5, -4, -3})),  # best at the low edge: one more below
    ({-5: 3.0, -4: 2.9, -3: 2.7}, (SEARCHING, None, {-5, -4, -3, -2})),  # at the high edge: one more above
    ({-5: 3.0, -4: 2.5, -3: DIVERGED}, (BRACKETED, -4, {-5, -4, -3})),  # a diverged run is the worst
    ({-5: DIVERGED, -4: DIVERGED, -3: DIVERGED}, (SEARCHING, None, {-6, -5, -4, -3})),  # all diverged: go lower
    ({-5: 2.5, -4: 2.5, -3: 2.7}, (SEARCHING, None, {-6, -5, -4, -3})),  # a tie goes to the lower value
    ({-5: 3.0, -4: None, -3: 2.7}, (SEARCHING, None, {-5, -4, -3})),  # a result missing: wait for it
    ({-8: 2.0, -7: 2.1, -6: 2.2, -5: 2.3, -4: 2.5, -3: 2.7}, (AT_LOWEST, -8, {-8, -7, -6, -5, -4, -3})),
    ({-5: 3.0, -4: 2.9, -3: 2.8, -2: 2.7, -1: 2.6}, (AT_HIGHEST, -1, {-5, -4, -3, -2, -1})),
])
def test_a_search_brackets_its_best_or_extends_by_one_value(losses, expected):
    assert Search("m", "a", dict(losses)).state(tune()) == expected


def test_a_failed_run_stops_its_search():
    search = Search("m", "a", {-5: 3.0, -4: None, -3: 2.7}, failed={-4})
    assert search.state(tune())[0] == FAILED


def parabola(centre: dict, curvature: float = 0.1):
    """Loss of (model, arm, index, seed): a parabola in the grid index around the search's
    own best, plus a small seed offset."""
    def loss(model, arm, index, seed):
        return 2.0 + curvature * (index - centre[(model, arm)]) ** 2 + 0.001 * seed
    return loss


def rounds(t, centre, seeds=(0, 1)):
    """Run the searches to the end against `parabola`, a round at a time, as the driver does:
    each round trains every wanted run without a result. Returns (runs, states, rounds)."""
    models, arms = sorted({m for m, _ in centre}), sorted({a for _, a in centre})
    loss, done, n = parabola(centre), set(), 0
    while True:
        runs, states = wanted_runs(t, models, arms, seeds, lambda *k: loss(*k) if k in done else None, done)
        todo = [k for k in runs if k not in done]
        if not todo:
            return runs, states, n
        done |= set(todo)
        n += 1


def test_the_searches_find_each_best_and_train_it_with_every_seed():
    centre = {("w32", "small"): -2, ("w32", "standard"): -3, ("w64", "small"): -4, ("w64", "standard"): -7}
    runs, states, n = rounds(tune(), centre)
    assert {(s.model, s.arm): (status, best) for s, status, best in states} == {
        ("w32", "small"): (BRACKETED, -2), ("w32", "standard"): (BRACKETED, -3),
        ("w64", "small"): (BRACKETED, -4), ("w64", "standard"): (BRACKETED, -7)}
    per = {key: sorted(i for m, a, i, s in runs if (m, a) == key and s == 0) for key in centre}
    assert per == {("w32", "small"): [-5, -4, -3, -2, -1], ("w32", "standard"): [-5, -4, -3, -2],
                   ("w64", "small"): [-5, -4, -3], ("w64", "standard"): [-8, -7, -6, -5, -4, -3]}
    assert sorted((m, a, i) for m, a, i, s in runs if s == 1) == sorted((m, a, c) for (m, a), c in centre.items())
    assert n == 5  # the first grid; -6, -7, -8 for w64 standard, one a round; then its seed 1
    assert len(runs) == len(set(runs))


def test_a_best_at_the_limit_stops_the_search_and_still_gets_its_seeds():
    runs, states, _ = rounds(tune(), {("w", "a"): -12})
    assert [(status, best) for _, status, best in states] == [(AT_LOWEST, -8)]
    assert sorted(i for *_, i, s in runs if s == 0) == [-8, -7, -6, -5, -4, -3] and (("w", "a", -8, 1) in runs)


def test_results_already_there_settle_several_rounds_at_once():
    """A rerun whose OUT already has results past the first round plans straight to what is
    missing (the searches replay their rounds on what is there)."""
    centre = {("w", "a"): -7}
    loss = parabola(centre)
    have = {("w", "a", i, 0) for i in (-7, -6, -5, -4, -3)}
    runs, states = wanted_runs(tune(), ["w"], ["a"], (0, 1), lambda *k: loss(*k) if k in have else None)
    assert [k for k in runs if k not in have] == [("w", "a", -8, 0)]


def test_runs_planned_before_are_kept():
    known = {("w", "a", 0, 0), ("w", "a", -3, 5)}  # a value far above the grid; a seed no longer asked for
    runs, _ = wanted_runs(tune(), ["w"], ["a"], (0, 1), lambda *k: None, known)
    assert ("w", "a", 0, 0) in runs and ("w", "a", -3, 5) in runs


# --- the rounds in OUT -------------------------------------------------------------------

RECIPE = """
[recipe]
title = "t"
[arms.standard]
"gamma.init_rate" = 0.5
"gamma.attention_gate" = "none"
[arms.small]
"gamma.init_rate" = 1.0
[tune]
key = "optimizer.lr"
per_decade = 2
start = 3.16228e-3
stop = 3.16228e-2
lowest = 1e-3
highest = 0.1
[scale.tiny]
tokens_per_param = 20
seeds = [0, 1]
models = [{ config = "configs/dense/tiny.toml", flavor = "tiny-32" }, { config = "configs/dense/tiny.toml", flavor = "tiny-48" }]
"""


def finish(out: Path, run, loss: float) -> None:
    """What a finished run leaves for the planner: metrics.jsonl reaching its last step."""
    (out / run.name).mkdir(parents=True, exist_ok=True)
    lines = [{"step": 1, "loss": loss + 1}, {"step": run.steps, "loss": loss, "val_loss": loss}]
    (out / run.name / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def test_each_call_plans_the_next_round_from_the_results_in_out(builtin_assets, tmp_path, capsys):
    recipe = tmp_path / "ladder.toml"
    recipe.write_text(RECIPE)
    out = tmp_path / "out"
    planned = plan_recipe(str(recipe), "tiny", out=str(out))
    assert len(planned.runs) == 2 * 2 * 3 and {r.seed for r in planned.runs} == {0}
    assert {r.name for r in planned.runs} >= {"tiny-32_standard_lr0.00316228_s0", "tiny-48_small_lr0.0316228_s0"}
    assert all(r.overrides["debug.seed"] == 0 and r.overrides["gamma.data.seed"] == 0 for r in planned.runs)
    for label in ("tiny-32", "tiny-48"):  # one step count per model, whatever the gate adds
        assert len({r.steps for r in planned.runs if r.model_label == label}) == 1
    assert execute(planned, launcher="slurm", dry_run=True) == 0  # writes recipe.json and round 1's scripts
    printed = capsys.readouterr().out
    assert "round 1: 12 of 12 runs to train" in printed and "tiny-48 small: searching; 0.00316228 (to train)" in printed
    assert len(list((out / "slurm").glob("*.sbatch"))) == 12
    # the results: standard best at the high edge (0.0316) at tiny-32, every other search bracketed at 0.01
    best = {("tiny-32", "standard"): 0.0316228}
    for r in planned.runs:
        centre = math.log10(best.get((r.model_label, r.arm), 0.01))
        finish(out, r, 2.0 + (math.log10(r.values["optimizer.lr"]) - centre) ** 2)
    second = plan_recipe(str(recipe), "tiny", out=str(out))
    new = sorted(r.name for r in second.runs if r.name not in {p.name for p in planned.runs})
    assert new == ["tiny-32_small_lr0.01_s1", "tiny-32_standard_lr0.1_s0", "tiny-48_small_lr0.01_s1",
                   "tiny-48_standard_lr0.01_s1"]
    assert sorted(r.name for r in second.tuner.todo(second.runs)) == new
    # a diverged run (the trainer's non-finite stop) at 0.1: the search brackets at 0.0316 and adds its seed
    (out / "status.json").write_text(json.dumps({"tiny-32_standard_lr0.1_s0": {"status": "failed (exit 3)"}}))
    third = plan_recipe(str(recipe), "tiny", out=str(out))
    assert "tiny-32_standard_lr0.0316228_s1" in [r.name for r in third.tuner.todo(third.runs)]
    states = {(s.model, s.arm): (status, best) for s, status, best in third.tuner.states}
    assert states[("tiny-32", "standard")] == (BRACKETED, -3)
    # a recipe edited between calls (a width dropped) would lose runs: refused, nothing written
    recipe.write_text(RECIPE.replace(', { config = "configs/dense/tiny.toml", flavor = "tiny-48" }', ""))
    (out / "recipe.json").write_text(json.dumps(third.record))
    with pytest.raises(ConfigError, match=r"holds recipe ladder at scale tiny with other runs"):
        plan_recipe(str(recipe), "tiny", out=str(out))


def test_the_ladder_recipe_plans_at_every_scale(builtin_assets, tmp_path, capsys):
    """tiny: four widths or more, ≤ 1 epoch, ≥ 20 tokens per parameter, its CPU estimate printed;
    gpu: GPU-hours; paper: SLURM scripts of the first round (dry run)."""
    recipe = load_recipe("lr_ladder")
    tiny = plan_recipe("lr_ladder", "tiny", out=str(tmp_path / "tiny"))
    assert execute(tiny, dry_run=True) == 0
    printed = capsys.readouterr().out
    assert len({r.width for r in tiny.runs}) >= 4 and all(r.epochs <= 1 for r in tiny.runs)
    assert all(20 <= r.tokens_per_param < 23 for r in tiny.runs)  # the same budget at every width (step_multiple 20)
    assert "CPU-hours" in printed and "round 1: 30 of 30 runs to train" in printed  # 5 widths x 2 arms x 3 rates
    assert not (tmp_path / "tiny").exists()
    gpu = plan_recipe("lr_ladder", "gpu", out=str(tmp_path / "gpu"), allow_epochs=1e9)
    assert execute(gpu, dry_run=True) == 0
    printed = capsys.readouterr().out
    assert "GPU-hours" in printed and {r.values["optimizer.lr"] for r in gpu.runs} == {0.001, 0.00316228, 0.01}
    assert recipe.tune_for("gpu").start == -6
    paper = plan_recipe("lr_ladder", "paper", out=str(tmp_path / "paper"), allow_epochs=1e9)
    assert execute(paper, launcher="slurm", dry_run=True) == 0
    assert sorted(p.stem for p in (tmp_path / "paper" / "slurm").glob("*.sbatch")) == sorted(r.name for r in paper.runs)
    assert all(20 <= r.tokens_per_param < 24 for r in paper.runs)  # steps rounded up to 1000s


def test_check_out_lets_a_tuned_plan_grow_only():
    old = {"recipe": "x", "scale": "tiny", "tune": {}, "runs": [{"name": "a", "config": "c", "overrides": {}}]}
    grown = {**old, "runs": old["runs"] + [{"name": "b", "config": "c", "overrides": {}}]}
    assert _same_runs(old, grown, grows=True) and not _same_runs(grown, old, grows=True)
    assert not _same_runs(old, grown)  # a recipe without [tune]: exactly the same runs


# --- the analysis ------------------------------------------------------------------------

STD, SMALL = (2.0, 10.0, 0.5), (2.0, 8.0, 0.5)  # (E, A, α): hand-computed gain (10/8)^2 = 1.5625


def law(p, n):
    e, a, alpha = p
    return e + a * n ** -alpha


def fake_runs(widths, losses, seeds=(0, 1), spread=0.0, tried=None):
    """Runs of a finished ladder: per width and arm, the search's values (best 0.01) and the
    best's seeds; losses(width, arm) is the best value's mean loss."""
    runs = []
    for w in widths:
        for arm in ("standard", "small"):
            params = 12 * w * w + (2 * w * w if arm == "small" else 0)
            for lr, extra in (tried or {0.00316228: 0.3, 0.01: 0.0, 0.0316228: 0.2}).items():
                for seed in (seeds if extra == 0.0 else seeds[:1]):
                    loss = losses(w, arm, params) + extra + (spread if seed else -spread)
                    runs.append({"name": f"{w}_{arm}_{lr}_{seed}", "model_label": f"tiny-{w}", "arm": arm,
                                 "seed": seed, "width": w, "params_non_embedding": params,
                                 "values": {"optimizer.lr": lr}, "finished": True, "status": "finished",
                                 "final": {"val_loss": loss}})
    return runs


PLAN = {"tune": {"key": "optimizer.lr", "per_decade": 2, "start": 0.00316228, "stop": 0.0316228,
                 "lowest": 1e-4, "highest": 0.316228}, "arms": ["standard", "small"], "seeds": [0, 1]}


def test_the_effective_size_gain_matches_a_hand_computed_case():
    runs = fake_runs([32, 48, 64, 96], lambda w, arm, n: law(STD if arm == "standard" else SMALL, n))
    result = ladder.analyse(PLAN, runs, resamples=50)
    assert [(a.best, b.best, a.status, b.status) for a, b in result.rows] == [(0.01, 0.01, BRACKETED, BRACKETED)] * 4
    for name, p in (("standard", STD), ("small", SMALL)):
        f = result.fits[name]
        assert (f.E, f.A, f.alpha) == pytest.approx(p, rel=1e-4)
    assert result.gains == pytest.approx([1.5625] * 4, rel=1e-4)
    assert all(lo == pytest.approx(1.5625, rel=1e-4) and hi == pytest.approx(1.5625, rel=1e-4)
               for lo, hi in result.gain_intervals)  # no seed spread: nothing to resample
    rows = ladder.claims(result)
    assert [r.verdict for r in rows if r.where == "width 96 (the largest)"] == ["agrees"]


def test_the_slope_of_delta_per_doubling_and_its_verdict():
    delta = {32: -0.20, 64: -0.15, 128: -0.10, 256: -0.05}  # +0.05 per doubling of the width
    runs = fake_runs(list(delta), lambda w, arm, n: 3.0 + (delta[w] if arm == "small" else 0.0), spread=0.002)
    result = ladder.analyse(PLAN, runs, resamples=200)
    assert result.slope == pytest.approx(0.05, abs=1e-9)
    lo, hi = result.slope_interval
    assert 0 < lo <= 0.05 <= hi < 0.1
    verdicts = {r.claim: r.verdict for r in ladder.claims(result)}
    assert verdicts["the gain holds as the model grows"] == "disagrees"
    deltas = [d.delta for d in result.deltas]
    assert deltas == pytest.approx(list(delta.values()), abs=1e-9)


def test_a_best_at_a_limit_makes_the_verdicts_inconclusive():
    tried = {1e-4: 0.0, 0.000316228: 0.1, 0.001: 0.2, 0.00316228: 0.3, 0.01: 0.4, 0.0316228: 0.5}  # best at `lowest`
    runs = fake_runs([32, 64], lambda w, arm, n: 3.0 - (0.1 if arm == "small" else 0.0), spread=0.001, tried=tried)
    result = ladder.analyse(PLAN, runs, resamples=20)
    assert {a.status for pair in result.rows for a in pair} == {AT_LOWEST}
    assert {r.verdict for r in ladder.claims(result)} == {"inconclusive"}


def test_the_report_has_the_ladder_section_and_plot(tmp_path):
    from gamma_titan.reports.recipe import write_report

    runs = fake_runs([32, 48, 64, 96], lambda w, arm, n: law(STD if arm == "standard" else SMALL, n), spread=0.001)
    plan = {**PLAN, "recipe": "lr_ladder", "title": "t", "figure": "f", "expect": "e", "scale": "tiny",
            "report": {}, "grid": {"optimizer.lr": [0.00316228, 0.01, 0.0316228]}, "claims": [], "runs": []}
    for r in runs:
        plan["runs"].append({k: r[k] for k in ("name", "model_label", "arm", "seed", "width", "params_non_embedding",
                                               "values")} | {"cell": r["name"].rsplit("_", 1)[0], "params": 1000,
                                                             "tokens": 20000, "tokens_per_param": 20.0,
                                                             "steps": 10, "global_batch": 1, "seq_len": 8,
                                                             "corpus_tokens": None, "overrides": {}})
        (tmp_path / r["name"]).mkdir()
        (tmp_path / r["name"] / "metrics.jsonl").write_text(
            json.dumps({"step": 10, "loss": r["final"]["val_loss"], "val_loss": r["final"]["val_loss"]}) + "\n")
    (tmp_path / "recipe.json").write_text(json.dumps(plan))
    text = write_report(tmp_path).read_text()
    assert "## Tuned ladder: each arm at its best optimizer.lr" in text and (tmp_path / "report" / "ladder.png").is_file()
    assert "| tiny-96 | 96 |" in text and "**Effective model-size gain**" in text
    assert "| small beats standard, each at its best optimizer.lr | Fig. 2a (tuned rates) | width 32 |" in text
