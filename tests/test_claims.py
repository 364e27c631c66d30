"""The claims table and its noise statistics (gamma_titan/reports/claims.py): cell means and
standard deviations, the pooled standard error of a Δ and of a Δ of Δs, worked by hand,
and verdicts on synthetic runs whose answers are known."""

import json
import math

import pytest

from gamma_titan.errors import ConfigError
from gamma_titan.reports.claims import CellStats, check_claims, difference, evaluate, verdict


def test_cell_statistics_and_the_pooled_standard_error_by_hand():
    a = CellStats.of([2.0, 2.2, 2.4])  # mean 2.2, s = 0.2
    b = CellStats.of([1.9, 2.0, 2.1])  # mean 2.0, s = 0.1
    assert (a.n, a.mean, a.std) == (3, pytest.approx(2.2), pytest.approx(0.2))
    assert a.se == pytest.approx(0.2 / math.sqrt(3))
    d = difference(a, b)  # b − a = −0.2; SE = √(0.04/3 + 0.01/3) = √(0.05/3) = 0.12910
    assert d.delta == pytest.approx(-0.2) and d.se == pytest.approx(0.129099, rel=1e-5)
    assert not d.exceeds_noise  # 0.2 < 2 × 0.129
    assert d.text() == "-0.2000 ± 0.2582 (1.5 SE)"
    assert verdict(d, "<0") == ("inconclusive", "|Δ| within 2 SE")
    c = CellStats.of([1.5, 1.6, 1.7])  # mean 1.6, s = 0.1
    e = difference(a, c)  # −0.6, SE = √(0.04/3 + 0.01/3) = 0.1291: 4.6 SE
    assert e.exceeds_noise and verdict(e, "<0") == ("agrees", "") and verdict(e, ">0") == ("disagrees", "")
    inter = e - d  # −0.4, SE = √(2 · 0.05/3) = 0.18257
    assert inter.delta == pytest.approx(-0.4) and inter.se == pytest.approx(math.sqrt(0.1 / 3))
    assert inter.exceeds_noise  # 0.4 > 0.365
    one = difference(CellStats.of([2.0]), CellStats.of([1.0]))
    assert one.se is None and one.exceeds_noise is None and one.text() == "-1.0000"
    assert verdict(one, "<0") == ("inconclusive", "one seed: no noise estimate (the sign agrees)")


def runs_of(losses: dict[tuple, list[float]], keys: list[str]) -> list[dict]:
    """Synthetic finished runs: one per seed of each cell (a tuple of the keys' values)."""
    runs = []
    for cell, values in losses.items():
        settings = dict(zip(keys, cell))
        name = "_".join(map(str, cell))
        for seed, loss in enumerate(values):
            runs.append({"name": f"{name}_s{seed}", "cell": name, "seed": seed, "model_label": settings.pop("model", "m"),
                         "arm": settings.pop("arm", None), "values": settings, "overrides": {}, "finished": True,
                         "final": {"val_loss": loss, "sink_mean": 0.1 * loss}})
            settings = dict(zip(keys, cell))
    return runs


def value(run, key):
    return {"model": run["model_label"], "arm": run["arm"]}.get(key, run["values"].get(key))


CLAIMS = [
    {"claim": "ε helps at γ = 1", "paper": "−0.038", "vary": "gamma.norm_eps", "values": [1e-5, 1e-12],
     "at": {"gamma.init_rate": 1.0}, "expect": "<0"},
    {"claim": "more than at γ = 0.5", "vary": "gamma.norm_eps", "values": [1e-5, 1e-12],
     "at": {"gamma.init_rate": 1.0}, "minus_at": {"gamma.init_rate": 0.5}, "expect": "<0"},
    {"claim": "ε helps at γ = 0.5", "vary": "gamma.norm_eps", "values": [1e-5, 1e-12],
     "at": {"gamma.init_rate": 0.5}, "expect": "<0"},
    {"claim": "sink rises with γ", "metric": "sink_mean", "vary": "gamma.init_rate", "values": [0.5, 1.0],
     "at": {"gamma.norm_eps": 1e-12}, "expect": ">0"},
]


def test_verdicts_on_synthetic_runs_with_known_answers():
    keys = ["gamma.init_rate", "gamma.norm_eps"]
    losses = {
        (0.5, 1e-5): [3.00, 3.02, 3.04],
        (0.5, 1e-12): [3.01, 3.03, 2.99],  # Δ = −0.01 ± noise 0.02: inconclusive
        (1.0, 1e-5): [2.90, 2.91, 2.92],
        (1.0, 1e-12): [2.80, 2.81, 2.82],  # Δ = −0.10, SE 0.00816: agrees
    }
    rows = evaluate(CLAIMS, runs_of(losses, keys), value, keys)
    by_claim = {r.claim: r for r in rows}
    assert [r.claim for r in rows] == [c["claim"] for c in CLAIMS]  # every key fixed: one row each
    assert by_claim["ε helps at γ = 1"].verdict == "agrees"
    assert by_claim["ε helps at γ = 1"].ours == "-0.1000 ± 0.0163 (12.2 SE)"  # SE = √(2 · 0.0001 / 3)
    assert by_claim["ε helps at γ = 0.5"].verdict == "inconclusive"
    # (−0.10) − (−0.01) = −0.09 with SE √(0.0001/3·2 + 0.0004/3·2) = 0.01826: agrees
    assert by_claim["more than at γ = 0.5"].verdict == "agrees"
    assert by_claim["more than at γ = 0.5"].ours.startswith("-0.0900 ± 0.0365 ")
    # the sink (0.1 × loss) falls with γ here: the paper's sign is wrong for these runs
    assert by_claim["sink rises with γ"].verdict == "disagrees"


def test_free_keys_give_a_row_each_and_best_over_picks_each_sides_best():
    keys = ["model", "arm", "optimizer.lr"]
    losses = {}
    for model, shift in (("small", 0.0), ("big", -0.5)):
        for lr, standard, small in ((1e-3, 3.3, 3.1), (3e-3, 3.0, 2.9), (1e-2, 3.2, 2.7), (3e-2, 3.5, 2.8)):
            losses[(model, "standard", lr)] = [standard + shift + e for e in (-0.01, 0.0, 0.01)]
            losses[(model, "small", lr)] = [small + shift + e for e in (-0.01, 0.0, 0.01)]
    claims = [{"claim": "best vs best", "vary": "arm", "values": ["standard", "small"], "best_over": "optimizer.lr",
               "expect": "<0"},
              {"claim": "at the default", "vary": "arm", "values": ["standard", "small"],
               "at": {"optimizer.lr": 3e-3}, "expect": "<0"}]
    rows = evaluate(claims, runs_of(losses, keys), value, keys)
    assert [(r.claim, r.where) for r in rows] == [("best vs best", "model = big"), ("best vs best", "model = small"),
                                                  ("at the default", "model = big"),
                                                  ("at the default", "model = small")]
    best = rows[1]  # small: standard's best is 3.0 at 3e-3, small's 2.7 at 1e-2: Δ = −0.3, SE = 0.00816
    assert best.ours.startswith("-0.3000 ± ") and best.verdict == "agrees"
    assert best.why == "at its best optimizer.lr: standard 0.003, small 0.01"
    assert rows[3].ours.startswith("-0.1000 ± ") and rows[3].verdict == "agrees"
    # a best value at the grid's edge makes the verdict inconclusive: the optimum may lie outside it
    edge = {k: v for k, v in losses.items() if k[2] != 3e-2}
    edge[("small", "small", 3e-3)] = [2.6, 2.61, 2.62]
    edge[("small", "small", 1e-3)] = [2.5, 2.51, 2.52]
    rows = evaluate(claims[:1], runs_of(edge, keys), value, keys)
    assert rows[1].verdict == "inconclusive" and "best optimizer.lr = 0.001" in rows[1].why
    assert "lies at the grid's edge" in rows[1].why


def test_unfinished_cells_and_bad_claims():
    keys = ["gamma.init_rate", "gamma.norm_eps"]
    runs = runs_of({(1.0, 1e-5): [2.9, 2.91]}, keys)
    row = evaluate(CLAIMS[:1], runs, value, keys)[0]
    assert row.verdict == "inconclusive" and row.why == "no finished run with gamma.init_rate = 1, gamma.norm_eps = 1e-12"
    grid = {"gamma.init_rate", "gamma.norm_eps"}
    check_claims(CLAIMS, grid, "r.toml")
    for bad, message in (
        ([{"claim": "x"}], "claims[0]: needs 'vary'"),
        ([{**CLAIMS[0], "expect": "down"}], "claims[0].expect = 'down': allowed <0, >0"),
        ([{**CLAIMS[0], "metric": "ppl"}], "claims[0].metric = 'ppl': allowed val_loss, train_loss, sink_mean or "
                                            "val_loss/<source>"),
        ([{**CLAIMS[0], "metric": "val_loss/"}], "claims[0].metric = 'val_loss/': allowed"),
        ([{**CLAIMS[0], "values": [1e-5]}], "claims[0].values: a list of two values"),
        ([{**CLAIMS[0], "at": {"optimizer.lr": 1}}], "claims[0]: 'optimizer.lr' is not a key the recipe varies"),
        ([{**CLAIMS[1], "minus_at": {"gamma.norm_eps": 1}}], "claims[0].minus_at: must fix the same keys as at"),
        ([{**CLAIMS[0], "typo": 1}], "claims[0]: unknown key 'typo'"),
    ):
        with pytest.raises(ConfigError) as err:
            check_claims(bad, grid, "r.toml")
        assert message in str(err.value) and "\n" not in str(err.value)


def test_a_recipe_report_ends_with_its_claims(tmp_path):
    """Through write_report: the synthetic runs above as a recipe's output folder."""
    from gamma_titan.reports.recipe import write_report

    keys = ["gamma.init_rate", "gamma.norm_eps"]
    losses = {(0.5, 1e-5): [3.00, 3.02, 3.04], (0.5, 1e-12): [3.01, 3.03, 2.99],
              (1.0, 1e-5): [2.90, 2.91, 2.92], (1.0, 1e-12): [2.80, 2.81, 2.82]}
    runs = []
    for r in runs_of(losses, keys):
        (tmp_path / r["name"]).mkdir()
        (tmp_path / r["name"] / "metrics.jsonl").write_text(json.dumps(
            {"step": 4, "loss": r["final"]["val_loss"], "val_loss": r["final"]["val_loss"],
             "val_loss/code": r["final"]["val_loss"] - 1 + (r["values"]["gamma.norm_eps"] == 1e-12) * 0.3}) + "\n")
        runs.append({k: r[k] for k in ("name", "cell", "seed", "model_label", "arm", "values", "overrides")}
                    | {"params": 1000, "params_non_embedding": 800, "tokens": 20000, "tokens_per_param": 20.0,
                       "corpus_tokens": 40000, "steps": 4, "global_batch": 1, "seq_len": 8})
    plan = {"recipe": "eps", "title": "t", "figure": "f", "expect": "e", "scale": "tiny",
            "grid": {"gamma.init_rate": [0.5, 1.0], "gamma.norm_eps": [1e-5, 1e-12]}, "arms": [],
            "report": {"rows": "gamma.init_rate", "columns": "gamma.norm_eps"}, "runs": runs,
            "claims": [*CLAIMS, {**CLAIMS[0], "claim": "not on code", "metric": "val_loss/code", "expect": "<0"}]}
    (tmp_path / "recipe.json").write_text(json.dumps(plan))
    text = write_report(tmp_path).read_text()
    pivot = text.split("**final validation loss**")[1].split("\n\n**")[0]
    assert "| 1 | 2.9100 ± 0.0100 | 2.8100 ± 0.0100 | -0.1000 ± 0.0163 (12.2 SE) * |" in pivot
    assert "| 0.5 | 3.0200 ± 0.0200 | 3.0100 ± 0.0200 | -0.0100 ± 0.0327 (0.6 SE) |" in pivot
    claims = text.rstrip().split("## Claims")[1]
    assert text.rstrip().endswith(claims.rstrip()) and claims.count("\n| ") == 6  # header + 5 claims
    assert "| ε helps at γ = 1 | −0.038 | – | -0.1000 ± 0.0163 (12.2 SE) | **agrees** |" in claims
    # a mixture source's validation loss (val_loss/code: the total − 1, + 0.3 at ε = 1e-12)
    assert "| not on code | −0.038 | – | +0.2000 ± 0.0163 (24.5 SE) | **disagrees** |" in claims
