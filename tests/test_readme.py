"""What the README says, against the program: its links and section references lead to its
sections, every command in its code blocks parses (the configs it names load with the
overrides it gives them, and the scripts it names exist), every key of ours is documented,
its table of the paper's settings is what the configs and models hold, the differences from
TorchTitan it states hold in TorchTitan, and its residual-flow numbers are inspect's.

Elsewhere: the flavor tables (test_configs), the cluster table (test_estimate), the Layout
and "Adding a model family" (test_layout), the recipe dry runs, executed (test_recipes), the
run folder and metrics.jsonl (test_training)."""

from __future__ import annotations

import re
import shlex
import unicodedata

import pytest

from helpers import REPO, readme_code_blocks, readme_commands

README = (REPO / "README.md").read_text(encoding="utf-8")

#: The paper's sizes: the configs the paper-settings table speaks of.
PAPER_CONFIGS = [f"dense/{size}.toml" for size in ("0.1B", "0.3B", "0.7B", "1.5B", "7B")] + \
                [f"moe/{size}.toml" for size in ("1.5B-A0.25B", "3B-A0.5B", "16B-A2.4B")]


def code_blocks(language: str) -> list[str]:
    return readme_code_blocks(README, language)


def commands() -> list[list[str]]:
    return readme_commands(README)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in heading.strip().lower()
                   if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def subcommand(parser, words: list[str]):
    """The (sub)parser that `gamma-titan words...` reaches: `recipe run` -> recipe run's."""
    import argparse

    for word in words:
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
        if word not in choices:
            break
        parser = choices[word]
    return parser


def test_the_commands_are_found():
    """The parser below sees the README's commands: the ones these tests rely on are there."""
    lines = [" ".join(argv) for argv in commands()]
    assert "bash tools/quickstart.sh" in lines and "bash tools/test.sh" in lines
    assert any(line.startswith("gamma-titan pretokenize --input data/raw/$src") for line in lines)
    assert any(line.startswith("gamma-titan eval hf/g1 --paper-suite") for line in lines)  # after &&
    assert any(line.startswith("python -m gamma_titan.training.torchrun --nnodes 4") for line in lines)
    assert len(lines) > 30


def test_every_link_leads_to_a_section():
    anchors = {slug(h) for h in re.findall(r"^#{1,4} (.+)$", README, flags=re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", README)
    assert links
    assert [link for link in links if link not in anchors] == []
    assert slug("Recipes: the paper's experiments") == "recipes-the-papers-experiments"


def test_every_section_a_reference_names_exists():
    """*Section* references in the text, and `README "Section"` in the configs and recipes,
    name a heading (after a move, a stale one fails)."""
    headings = {h.strip() for h in re.findall(r"^#{1,4} (.+)$", README, flags=re.M)}
    headings |= {h.split(":")[0] for h in headings}  # "Diagnostics: the paper's ..." -> "Diagnostics"
    named = set(re.findall(r"(?:see|\() ?\*([A-Z][^*\n]+)\*", README))  # (see *Reliability*), (*Your data*)
    named |= set(re.findall(r'see "([A-Z][^"\n]+)"', README))  # see "Data"
    layout = README.split("\n## Layout\n", 1)[1].split("```", 2)[1]
    named |= set(re.findall(r"\(see ([A-Z][^)\n]+)\)", layout))  # (see Performance), in the tree's notes
    assert len(named) >= 8
    assert sorted(n for n in named if n.replace("\n", " ") not in headings) == []
    cited = {(path.relative_to(REPO), name) for path in [*REPO.glob("configs/*/*.toml"), *REPO.glob("recipes/*.toml")]
             for name in re.findall(r'README "([^"]+)"', path.read_text(encoding="utf-8"))}
    assert cited  # the configs and recipes that send a reader to a section name one that is there
    assert sorted((str(path), name) for path, name in cited if name not in headings) == []


def test_the_quick_start_is_two_commands():
    section = README.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S)[1]
    assert [shlex.split(line, comments=True) for line in block.splitlines()] == [
        ["bash", "tools/quickstart.sh"], ["bash", "tools/test.sh"]]


def test_every_script_a_command_runs_exists():
    import importlib.util

    for argv in commands():
        if argv[0] in ("python", ".venv/bin/python") and argv[1] == "-m":
            assert importlib.util.find_spec(argv[2]) is not None, argv
        elif argv[0] in ("bash", "python", ".venv/bin/python"):
            assert (REPO / argv[1]).is_file(), argv


def test_every_gamma_titan_command_parses_and_its_config_loads(builtin_assets):
    """Each `gamma-titan ...` line as written: the subcommand and every flag exist (a command
    that takes no overrides gets none), and a config it trains or inspects loads with the
    overrides the line gives it: every key and value checked, as `train` does first."""
    from gamma_titan.cli import build_parser
    from gamma_titan.config import load_job_config

    checked = synopses = 0
    for argv in commands():
        if not argv[0].endswith("gamma-titan"):
            continue
        if any(word.startswith("[") for word in argv):  # the synopsis: its flags exist
            parser = subcommand(build_parser(), argv[1:])
            flags = {f for word in argv for f in re.findall(r"--[a-z][\w-]*", word)} - {"--section"}
            assert flags <= set(parser._option_string_actions), (argv, flags - set(parser._option_string_actions))
            synopses += 1
            continue
        try:
            ns, rest = build_parser().parse_known_args(argv[1:])
        except SystemExit:
            pytest.fail(f"README: `{' '.join(argv)}` does not parse")
        takes_overrides = ns.command in ("train", "inspect", "submit") or (ns.command, getattr(ns, "action", None)) \
            == ("recipe", "run")
        if ns.command == "eval" and ns.hf_dir == "compare":  # its two files come through the rest
            assert len(rest) == 2, argv
            rest = []
        assert takes_overrides or rest == [], (argv, rest)
        if ns.command in ("train", "inspect", "submit"):
            assert (REPO / ns.config).is_file(), argv
            load_job_config(["--job.config_file", str(REPO / ns.config), *rest])
            checked += 1
        if ns.command == "recipe" and ns.action == "run":
            assert (REPO / "recipes" / f"{ns.name}.toml").is_file(), argv
    assert checked >= 6 and synopses >= 10


def test_the_torchrun_command_loads(builtin_assets):
    """The multi-node torchrun line (the project's torchrun, whose arguments torch's own
    parses): what follows `-m gamma_titan.train` is a config that loads."""
    from torch.distributed.run import parse_args

    from gamma_titan.config import load_job_config
    from gamma_titan.training.launch import TORCHRUN

    lines = [argv for argv in commands() if argv[:3] == ["python", "-m", TORCHRUN]]
    assert lines
    for argv in lines:
        module = argv.index("-m", 3)
        assert argv[module + 1] == "gamma_titan.train" and parse_args(argv[3:]).nnodes == "4"
        args = argv[module + 2:]
        i = args.index("--job.config_file") + 1
        assert (REPO / args[i]).is_file()
        load_job_config([*args[:i], str(REPO / args[i]), *args[i + 1:]])


def paper_settings_table() -> dict[str, str]:
    """The table under **The paper's trainer.**: setting -> our column."""
    section = README.split("**The paper's trainer.**", 1)[1]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| setting"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[2]
        elif rows and not line.startswith("|"):
            break
    return rows


@pytest.mark.parametrize("config", PAPER_CONFIGS)
def test_the_paper_settings_table_is_what_the_paper_configs_hold(config, builtin_assets):
    from gamma_titan.config import load_job_config

    ours = paper_settings_table()
    assert set(ours) == {"initialisation", "Adam β2", "weight decay", "learning-rate schedule",
                         "position encoding", "embedding and output head", "biases in linear layers"}
    job = load_job_config(["--job.config_file", str(REPO / "configs" / config)])
    o, s, t = job.optimizer, job.lr_scheduler, job.training
    assert float(ours["Adam β2"]) == o.beta2 and float(ours["weight decay"]) == o.weight_decay
    warmup, floor = re.fullmatch(r"(\d+) warm-up steps, cosine decay to ([\d.]+) × lr",
                                 ours["learning-rate schedule"]).groups()
    assert (s.warmup_steps, s.decay_type, s.min_lr_factor) == (int(warmup), "cosine", float(floor))
    # The settings the text says are Megatron-LM's, kept.
    assert (o.name, o.beta1, o.eps, t.max_norm, o.weight_decay_policy) == ("AdamW", 0.9, 1e-8, 1.0, "megatron")
    assert (t.mixed_precision_param, t.mixed_precision_reduce) == ("bfloat16", "float32")
    assert job.gamma.init_rate == 1.0


@pytest.mark.parametrize("model, flavor", [("gamma_dense", "0.1B"), ("gamma_dense", "7B"),
                                           ("gamma_moe", "1.5B-A0.25B-mla")])
def test_the_paper_models_have_the_tables_architecture(model, flavor):
    """RoPE at the table's θ, a head of its own, no bias anywhere (built on the meta device)."""
    import torch

    from gamma_titan.models import TRAIN_SPECS

    spec = TRAIN_SPECS[model]
    args = spec.model_args[flavor]
    theta = re.fullmatch(r"RoPE, θ = (\d+) \(7B, not a paper size: (\d+)\)", paper_settings_table()["position encoding"])
    assert args.rope_theta == float(theta[2] if flavor == "7B" else theta[1])
    with torch.device("meta"):
        model_ = spec.model_cls(args)
    names = dict(model_.named_parameters())
    assert not [n for n in names if n.endswith(".bias")]
    assert names["output.weight"] is not names["tok_embeddings.weight"]
    assert not any("pos_emb" in n or "position" in n for n in names)


def test_the_differences_from_torchtitan_that_a_test_can_hold():
    """*Differences from plain TorchTitan*, against TorchTitan itself: it takes -1 for the
    shard degree only, and its last save holds the model only, where our configs' is full."""
    import dataclasses
    import tomllib

    from torchtitan.config import job_config
    from torchtitan.distributed.parallel_dims import ParallelDims

    section = README.split("\n### Differences from plain TorchTitan\n", 1)[1].split("\n## ", 1)[0]
    assert "TorchTitan takes -1 for the shard degree only" in section
    degrees = dict(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=8)
    ParallelDims(**degrees)
    for derived in ("dp_replicate", "ep"):
        with pytest.raises(AssertionError, match="except for dp_shard"):
            ParallelDims(**degrees | {derived: -1})
    assert "TorchTitan's default saves the model only" in section
    defaults = {f.name: f.default for f in dataclasses.fields(job_config.Checkpoint)}
    assert defaults["last_save_model_only"] is True
    for config in sorted((REPO / "configs").glob("*/*.toml")):
        if config.parent.name != "titan":
            assert tomllib.loads(config.read_text())["checkpoint"]["last_save_model_only"] is False, config


def documented_families() -> list[str]:
    """The families the README documents: those with a flavor table (a line `<!-- flavors:
    NAME -->`, tools/readme_tables.py's); a new family needs none ("Adding a model family")."""
    return [m[1] for line in README.splitlines() if (m := re.match(r"<!-- flavors: ([\w.-]+)", line))]


def test_every_key_of_ours_is_in_the_readme():
    """Each key gamma-titan adds to a config is documented: every [gamma] key and sub-table
    (with each key of [gamma.data], [gamma.diagnostics], [gamma.reliability]) and
    [optimizer] weight_decay_policy appear as `key =` in a TOML block, every γ group in the
    init_rate_overrides line, and every [model_args] field of a family the README documents
    (one with a flavor table) in a TOML block or in backticks."""
    import dataclasses

    from gamma_titan.config.schema import Gamma, ModelArgsOverrides, Optimizer
    from gamma_titan.init import GROUPS
    from gamma_titan.models import TRAIN_SPECS

    toml = "\n".join(code_blocks("toml"))

    def in_toml(key: str) -> bool:
        return re.search(rf"^{key}\s*=", toml, flags=re.M) is not None

    missing = [f"optimizer.{f.name}" for f in dataclasses.fields(Optimizer) if not in_toml(f.name)]
    for f in dataclasses.fields(Gamma):
        table = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if not dataclasses.is_dataclass(table):
            missing += [] if in_toml(f.name) else [f"gamma.{f.name}"]
        elif f.name == "init_rate_overrides":
            groups = re.search(r"^output = .*# (.*)$", toml, flags=re.M)[1]
            missing += [f"gamma.{f.name}.{g}" for g in GROUPS if g not in groups.split(" | ")]
        else:
            missing += [] if f"[gamma.{f.name}]" in toml else [f"[gamma.{f.name}]"]
            missing += [f"gamma.{f.name}.{k.name}" for k in dataclasses.fields(table) if not in_toml(k.name)]
    documented = {name for family in documented_families()
                  for name in type(next(iter(TRAIN_SPECS[family].model_args.values()))).model_args_fields()}
    assert {"dim", "n_routed_experts"} <= documented <= {f.name for f in dataclasses.fields(ModelArgsOverrides)}
    missing += [f"model_args.{name}" for name in sorted(documented) if not in_toml(name) and f"`{name}`" not in README]
    assert missing == []


def test_the_model_args_lists_are_the_families_fields():
    """The TOML reference's [model_args] block holds every field the families share (the
    common ones), and the MoE **Keys:** line names exactly gamma_moe's own fields (plus
    ffn_hidden_dim, which its dense layers use)."""
    from gamma_titan.models import TRAIN_SPECS

    def fields(family: str) -> set[str]:
        return set(type(next(iter(TRAIN_SPECS[family].model_args.values()))).model_args_fields())

    common, moe = fields("gamma_dense"), fields("gamma_moe")
    block = next(b for b in code_blocks("toml")  # the reference's, not an example setting one key
                 if "\n[model_args]" in b and re.search(r"^dim\s*=", b, flags=re.M))
    block = block.split("\n[model_args]", 1)[1].split("\n[", 1)[0]
    assert set(re.findall(r"^(\w+)\s*=", block, flags=re.M)) == common
    keys = README.split("- **Keys:** `[model_args]` takes", 1)[1].split("besides the common ones", 1)[0]
    assert set(re.findall(r"`(\w+)`", keys)) == (moe - common) | {"ffn_hidden_dim"}


def test_the_residual_flow_numbers_are_what_inspect_measures(builtin_assets):
    """The Diagnostics table's residual-flow numbers at init, recomputed by `inspect`'s
    report for each model and γ it names (to the README's rounding)."""
    from gamma_titan.config import load_job_config
    from gamma_titan.inspect_model import inspect_model
    from gamma_titan.training.train_spec import resolve_model

    row = next(line for line in README.splitlines() if line.startswith("| `gamma/residual_flow_ratio` |"))
    listed = re.search(r"debug \(d 256, 4 layers\) ([\d.]+) at γ = 1 and ([\d.]+) at γ = 0\.5; gpu-256 / gpu-768 "
                       r"\(8 layers\) ([\d.]+) / ([\d.]+) at γ = 1, and ([\d.]+) for gpu-768 at γ = 0\.5", row)
    cases = [("dense/debug.toml", [], 1.0), ("dense/debug.toml", [], 0.5),
             ("dense/gpu.toml", ["--model.flavor", "gpu-256"], 1.0), ("dense/gpu.toml", ["--model.flavor", "gpu-768"], 1.0),
             ("dense/gpu.toml", ["--model.flavor", "gpu-768"], 0.5)]
    for (config, flavor, gamma), text in zip(cases, listed.groups()):
        job = load_job_config(["--job.config_file", str(REPO / "configs" / config), *flavor,
                               "--gamma.init_rate", str(gamma)])
        spec, args = resolve_model(job)
        ratio = inspect_model(spec, args, job.training.seq_len)["residual_flow_ratio"]
        half_digit = 0.5 * 10 ** -len(text.partition(".")[2])
        assert abs(ratio - float(text)) <= half_digit + 1e-9, (config, flavor, gamma, ratio, text)
