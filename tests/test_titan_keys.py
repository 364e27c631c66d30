"""TorchTitan's own keys, checked like ours (gamma_titan/config/titan_keys.py): the rule
table covers TorchTitan's JobConfig field by field, every rule refuses the values it
exists to refuse with one line naming the key, and a TOML value of the wrong type is
refused as a CLI one is."""

import copy

import pytest

from gamma_titan.config import load_job_config
from gamma_titan.config.titan_keys import RULES, Lazy, check_titan_keys, resolve, titan_fields
from gamma_titan.errors import ConfigError
from helpers import REPO

DEBUG = str(REPO / "configs" / "dense" / "debug.toml")
FIELDS = titan_fields()


@pytest.fixture(scope="module")
def config():
    return load_job_config(["--job.config_file", DEBUG])


def set_key(config, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        config = getattr(config, part)
    setattr(config, last, value)


def test_the_table_is_torchtitans_job_config_field_by_field():
    assert set(RULES) == set(FIELDS)
    assert len(FIELDS) > 140  # torchtitan 0.2.2: 149


def test_torchtitans_defaults_pass(config):
    from torchtitan.config.job_config import JobConfig

    defaults = copy.deepcopy(config)
    for key, (_, default) in FIELDS.items():
        set_key(defaults, key, copy.deepcopy(default))
    defaults.validation.enable = False
    check_titan_keys(defaults)
    assert JobConfig().training.steps == defaults.training.steps


@pytest.mark.parametrize("key", sorted(FIELDS))
def test_each_key_refuses_what_it_cannot_mean(config, key):
    rule = resolve(key, *FIELDS[key])
    bad_values = ("nope", 7) if isinstance(rule, Lazy) else rule.bad
    assert bad_values, key
    for bad in bad_values:
        broken = copy.deepcopy(config)
        set_key(broken, key, bad)
        with pytest.raises(ConfigError) as err:
            check_titan_keys(broken)
        text = str(err.value)
        assert text.startswith(f"{key} = {bad!r}: ") and "\n" not in text, text


@pytest.mark.parametrize("table,key,value,message", [
    ("training", "steps", "ten", "training.steps = 'ten': must be an integer >= 1"),
    ("training", "steps", 10.5, "training.steps = 10.5: must be an integer >= 1"),
    ("optimizer", "lr", "3e-4", "optimizer.lr = '3e-4': must be a number > 0"),
    ("metrics", "enable_tensorboard", "yes", "metrics.enable_tensorboard = 'yes': must be true or false"),
    ("training", "dtype", "fp16", "training.dtype = 'fp16': allowed bfloat16, float32"),
    ("checkpoint", "keep_latest_k", 1, "checkpoint.keep_latest_k = 1: must be 0 (keep all) or an integer >= 2 "
                                       "(TorchTitan keeps a spare while the newest may still be being written)"),
])
def test_a_toml_value_is_checked_like_a_cli_one(tmp_path, table, key, value, message):
    import tomllib

    import tomli_w

    data = tomllib.loads((REPO / "configs" / "dense" / "debug.toml").read_text(encoding="utf-8"))
    data[table][key] = value
    toml = tmp_path / "c.toml"
    toml.write_text(tomli_w.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_job_config(["--job.config_file", str(toml), "--job.dump_folder", str(tmp_path / "run")])
    assert str(err.value) == message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("toml,extra", [("configs/dense/debug.toml", []), ("configs/moe/debug.toml", []),
                                        ("configs/moe/debug_mla.toml", [])], ids=["dense", "moe-mha", "moe-mla"])
def test_every_model_args_field_refuses_a_value_out_of_range(toml, extra):
    """Each [model_args] field of the family, set to a value it cannot mean (a negative
    count or coefficient, an unknown name), is refused by name before anything starts."""
    from gamma_titan.training.train_spec import resolve_model

    base = ["--job.config_file", str(REPO / toml), *extra]
    spec, args = resolve_model(load_job_config(base))
    names = type(args).model_args_fields()
    assert len(names) >= 8
    for name in names:
        current = getattr(args, name)
        bad = "nope" if isinstance(current, str) else None if isinstance(current, bool) else "-1"
        if bad is None:
            continue  # a bool: its type is the whole range (checked below through TOML)
        with pytest.raises(ConfigError) as err:
            resolve_model(load_job_config([*base, f"--model_args.{name}", bad]))
        assert f"model_args.{name}" in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("key,value,message", [
    ("route_norm", "yes", "model_args.route_norm = 'yes': must be true or false"),
    ("dim", "256", "model_args.dim = '256': must be an integer"),
    ("dim", 256.0, "model_args.dim = 256.0: must be an integer"),
    ("rope_theta", "1e4", "model_args.rope_theta = '1e4': must be a number"),
    ("attention", 1, "model_args.attention = 1: must be a string"),
])
def test_a_model_args_value_of_the_wrong_type_is_refused(tmp_path, key, value, message):
    import tomllib

    import tomli_w

    data = tomllib.loads((REPO / "configs" / "moe" / "debug.toml").read_text(encoding="utf-8"))
    data.setdefault("model_args", {})[key] = value
    toml = tmp_path / "c.toml"
    toml.write_text(tomli_w.dumps(data), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_job_config(["--job.config_file", str(toml)])
    assert str(err.value) == message
