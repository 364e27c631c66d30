"""Our command-line flags: every count and number is checked over its whole range, zero
included, and refused in one line with exit code 2 (gamma_titan/config/flags.py)."""

import argparse
import ast
import math

import pytest

from gamma_titan.cli import build_parser, main
from gamma_titan.config.flags import count, number, seed_list
from helpers import REPO

#: The numeric flags for which 0 is a meant value.
ZERO_IS_MEANT = {("eval", "--num-fewshot"), ("pretokenize", "--val-fraction"), ("report condensation", "--steps"),
                 ("recipe run", "--seeds"), ("submit", "--gpus-per-node")}  # 0 GPUs: CPU nodes


def flags(parser: argparse.ArgumentParser, which, path: str = "") -> dict:
    """{(subcommand path, flag): action} for every flag `which(action)` picks, in every subparser."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= flags(sub, which, f"{path} {name}".strip())
        elif action.option_strings and which(action):
            found[(path, action.option_strings[0])] = action
    return found


FLAGS = flags(build_parser(), lambda action: action.type is not None)  # those with a value type


def test_every_numeric_flag_has_a_checked_type():
    assert {("train", "--nproc"), ("recipe run", "--jobs"), ("recipe run", "--steps"), ("recipe run", "--seeds"),
            ("inspect", "--gpus"), ("report tokens", "--seq-len")} <= set(FLAGS)
    for key, action in FLAGS.items():
        assert action.type not in (int, float), key
    # and the tools' parsers: no bare int or float type in any of our argparse calls
    for path in [*REPO.glob("gamma_titan/**/*.py"), *REPO.glob("tools/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                for kw in node.keywords:
                    assert not (kw.arg == "type" and isinstance(kw.value, ast.Name) and kw.value.id in ("int", "float")), \
                        f"{path.relative_to(REPO)}:{node.lineno}"


@pytest.mark.parametrize("key", sorted(FLAGS), ids=lambda k: f"{k[0]} {k[1]}")
def test_zero_negative_and_garbage_are_refused(key):
    parse = FLAGS[key].type
    for text in ("-1", "x", "nan", "inf", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)
    if key in ZERO_IS_MEANT:
        assert parse("0") in (0, [0])
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            parse("0")


def test_the_checked_types_accept_their_range():
    assert count(1)("3") == 3 and count(0)("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match="'2.5': must be an integer >= 1"):
        count(1)("2.5")
    assert number(0)("1e-3") == 1e-3 and number(0, 1, low_open=False, high_open=True)("0") == 0
    for bad in ("1", "-0.5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            number(0, 1, low_open=False, high_open=True)(bad)
    assert seed_list("0") == [0] and seed_list("3,0,7") == [3, 0, 7]
    for bad in ("", "1,1", "0,-1", "0,x", "0,,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            seed_list(bad)
    assert math.isinf(float("inf"))  # number() refuses it although float() parses it
    with pytest.raises(argparse.ArgumentTypeError):
        number(0)("inf")


@pytest.mark.parametrize("argv,message", [
    (["train", "configs/dense/debug.toml", "--nproc", "0"], "error: argument --nproc: 0: must be an integer >= 1"),
    (["inspect", "configs/dense/debug.toml", "--gpu-memory", "0"],
     "error: argument --gpu-memory: 0: must be a number > 0"),
    (["tokenizer", "train", "--vocab-size", "10"], "error: argument --vocab-size: 10: must be an integer >= 259"),
    (["report", "tokens", "a", "b", "--seq-len", "0"], "error: argument --seq-len: 0: must be an integer >= 1"),
])
def test_a_bad_count_ends_the_command_in_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == message + "\n"


SINGLE = flags(build_parser(), lambda action: isinstance(action, argparse._StoreAction) and action.nargs is None)


def accepts(action, text: str) -> bool:
    try:
        action.type(text) if action.type else text
    except (argparse.ArgumentTypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("key", sorted(SINGLE), ids=lambda k: f"{k[0]} {k[1]}")
def test_a_single_valued_flag_given_twice_is_refused(key, capsys):
    """argparse keeps the last of two values silently (`tokenizer train --input a --input b`
    trained on b alone): every command refuses the second in one line."""
    path, flag = key
    action = SINGLE[key]
    assert type(action).__name__ == "StoreOnce"
    value = str(action.choices[0]) if action.choices else next(v for v in ("1", "0.5", "0", "1:00:00", "4096")
                                                                if accepts(action, v))
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_known_args([*path.split(), flag, value, flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: argument {'/'.join(action.option_strings)}: given twice ({flag} {action.type(value) if action.type else value}, then {flag} {action.type(value) if action.type else value}): give it once\n"


def test_the_first_single_valued_flags_of_each_command():
    assert {("tokenizer train", "--input"), ("train", "--nproc"), ("recipe run", "--jobs"), ("submit", "--time")} <= set(SINGLE)
    # once is fine, and a fresh parse forgets the last one's flags
    parser = build_parser()
    for _ in range(2):
        ns, _ = parser.parse_known_args(["tokenizer", "train", "--input", "a.jsonl"])
        assert ns.input == "a.jsonl"


@pytest.mark.parametrize("flags, message", [
    (["--training.steps", "3", "--training.steps", "5"], "--training.steps given twice (3, then 5): give it once"),
    (["--training.steps=3", "--training.steps", "5"], "--training.steps given twice (3, then 5): give it once"),
    (["--compile.enable", "true", "--compile.no-enable"], "--compile.enable given twice (true, then false): give it once"),
    (["--gamma.init-rate", "1", "--gamma.init_rate", "0.5"], "--gamma.init_rate given twice (1, then 0.5): give it once"),
])
@pytest.mark.parametrize("command", ["train", "inspect", "recipe run gamma_sweep --scale tiny"])
def test_a_config_key_given_twice_on_the_command_line_is_refused(command, flags, message, capsys, tmp_path):
    """tyro keeps the last of two `--section.key` values silently: every command that takes
    them refuses the second, before anything is written."""
    config = [] if command.startswith("recipe") else [str(REPO / "configs/dense/debug.toml")]
    with pytest.raises(SystemExit) as exit_:
        main([*command.split(), *config, *flags, "--job.dump_folder", str(tmp_path / "run")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert not any(tmp_path.iterdir())
