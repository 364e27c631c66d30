"""The README's Layout section and the packages' own module lists match the tree: every
module or package at the top of gamma_titan/ (and every folder of models/) is listed, and
nothing listed is missing; the entries of the models/ folders that hold families are what
tools/readme_tables.py writes from the registry; data/ and training/ name each of their
modules in their docstrings. And README's "Adding a model family" lists what the code asks
of a family, and the one command that brings the README up to date."""

import ast
import inspect
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from helpers import REPO

sys.path.insert(0, str(REPO / "tools"))
import readme_tables  # noqa: E402  (tools/readme_tables.py: the README's generated sections)

PACKAGE = REPO / "gamma_titan"
README = REPO / "README.md"


def layout_block() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.split("\n## Layout\n", 1)[1]
    return section.split("```", 2)[1].splitlines()


def listed(lines: list[str], indent: int) -> set[str]:
    """The entries at exactly `indent` spaces: the first word of such a line."""
    return {line[indent:].split()[0] for line in lines
            if line.startswith(" " * indent) and line[indent:indent + 1] not in (" ", "")}


def entries(folder: Path) -> set[str]:
    return {p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
            if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py")}


def test_the_readme_layout_lists_the_package_as_it_is():
    lines = layout_block()
    start = lines.index("gamma_titan/")
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith(" "))
    package = lines[start + 1:end]
    assert listed(package, 2) == entries(PACKAGE)
    models = package[package.index(next(line for line in package if line.startswith("  models/"))) + 1:]
    models = models[:next(i for i, line in enumerate(models) if line.startswith("  ") and line[2] != " ")]
    folders = {e for e in entries(PACKAGE / "models") if e.endswith("/")}
    assert listed(models, 4) == folders, (
        f"README's Layout lists models/ {sorted(listed(models, 4))}, the tree holds {sorted(folders)}: a folder "
        f"that holds a family is written by `{readme_tables.COMMAND}`; write any other by hand")
    for line in lines[end:]:  # the top-level folders of the repository
        if not line.startswith(" "):
            assert (REPO / line.split()[0]).exists(), line
    tools = lines[lines.index(next(line for line in lines if line.startswith("tools/"))) + 1:]
    tools = tools[:next((i for i, line in enumerate(tools) if not line.startswith(" ")), len(tools))]
    assert listed(tools, 2) == {p.name + ("/" if p.is_dir() else "") for p in (REPO / "tools").iterdir()
                                if p.name != "__pycache__"}


def module_list(package: str) -> set[str]:
    """The module names a package's docstring lists, one per line: `  name   what it does`."""
    doc = ast.get_docstring(ast.parse((PACKAGE / package / "__init__.py").read_text(encoding="utf-8")), clean=False)
    return {m.group(1) for m in re.finditer(r"^  ([a-z_]+)\s+(?:--\s)?\S", doc, re.MULTILINE)}


def test_package_docstrings_list_every_module():
    for package in ("data", "training"):
        modules = {p.stem for p in (PACKAGE / package).glob("*.py") if p.stem != "__init__"}
        assert module_list(package) == modules, package


# --- the generated entries, and what adding a family asks ----------------------------------


def test_the_layout_entries_of_the_family_folders_are_the_generators():
    """The models/ folders that hold the package's own families are listed as
    tools/readme_tables.py writes them (their families, docstring, files); a stale entry
    fails with the command that rewrites it."""
    lines = README.read_text(encoding="utf-8").split("\n")
    written = readme_tables.write_layout(lines, readme_tables.own_families())
    assert written == lines, f"README.md's Layout is stale: run {readme_tables.COMMAND}\n" + \
        readme_tables.diff("\n".join(lines), "\n".join(written))


def test_the_generator_is_idempotent_and_writes_back_what_it_owns():
    """Run on its own output, the generator changes nothing; run on a README whose generated
    parts were dropped or edited by hand (a table's rows, a family folder's entry), it writes
    them back as they were, and leaves every other line alone."""
    text = README.read_text(encoding="utf-8")
    families = readme_tables.own_families()
    once = readme_tables.generate(text, families)
    assert readme_tables.generate(once, families) == once
    lines = text.split("\n")
    marker = next(i for i, line in enumerate(lines) if readme_tables.MARKER.match(line))
    damaged = lines[:marker] + ["<!-- flavors: gamma_dense -->", "| flavor | d |", "|---|---|", "| debug | 256 |"] + \
        [line for line in lines[marker + 1:] if not line.startswith("| tiny-")]
    start, end = readme_tables.models_span(damaged)
    dense = next(i for i in range(start, end) if damaged[i].startswith("    dense/"))
    del damaged[dense:next(i for i in range(dense + 1, end + 1) if i == end or damaged[i][4] != " ")]  # its lines
    assert readme_tables.generate("\n".join(damaged), families) == once
    # a marker with no table yet gets one, and the text after it stays a paragraph
    fresh = "\n".join(["## Layout", "```", "gamma_titan/", "  models/            the families",
                       "    common/          shared", "```", "", "<!-- flavors: gamma_dense -->", "Some text."])
    out = readme_tables.generate(fresh, families).split("\n")
    table = out.index(readme_tables.MARKER_LINE.format(name="gamma_dense"))
    rows = len(families["gamma_dense"].model_args)
    assert out[table + 1].startswith("| flavor |") and out[table + 3 + rows:] == ["", "Some text."]
    assert readme_tables.generate("\n".join(out), families).split("\n") == out


def test_the_generator_lists_only_the_packages_own_families():
    """A family installed by an entry point (the test session installs tests/families/ so)
    is never listed, even one whose model class is the package's; the package's own are."""
    from importlib.metadata import entry_points

    from gamma_titan.models import FAMILY_ENTRY_POINTS, TRAIN_SPECS

    own = readme_tables.own_families()
    assert {"gamma_dense", "gamma_moe"} <= set(own)
    installed = {entry.name for entry in entry_points(group=FAMILY_ENTRY_POINTS)}
    assert not installed & set(own)
    assert set(own) == {name for name, spec in TRAIN_SPECS.items()
                        if spec.model_cls.__module__.startswith("gamma_titan.models.") and name not in installed}
    dense = TRAIN_SPECS["gamma_dense"]
    reused = SimpleNamespace(model_cls=dense.model_cls, model_args=dense.model_args)
    outside = SimpleNamespace(model_cls=type("Outside", (), {"__module__": "my_package.model"}), model_args={})
    registry = {"gamma_dense": dense, "my_dense": reused, "my_family": outside}
    assert set(readme_tables.own_families(registry, installed={"my_dense", "my_family"})) == {"gamma_dense"}
    assert set(readme_tables.own_families(registry, installed=set())) == {"gamma_dense", "my_dense"}
    text = README.read_text(encoding="utf-8")
    for name in installed:  # nothing of theirs in the generated sections
        assert f"<!-- flavors: {name}" not in text


def test_a_new_family_folder_needs_the_one_command(tmp_path):
    """What "Adding a model family" promises of the README: a family in a new folder of
    models/ (models/sandwich/, in a copy of the tree) gets its Layout entry from
    the command, in order of name, with the first sentence of its docstring; no flavor
    table is asked of it; nothing else in the README changes."""
    from gamma_titan.models import TRAIN_SPECS

    models = tmp_path / "models"
    models.mkdir()
    for folder in PACKAGE.joinpath("models").iterdir():
        if folder.is_dir() and folder.name != "__pycache__":
            (models / folder.name).symlink_to(folder)
    (models / "sandwich").mkdir()
    (models / "sandwich" / "__init__.py").write_text(
        '"""A sandwich block (Ding et al. 2021, §3): a norm before and after each sublayer. More."""\n')
    for name in ("args.py", "model.py", "state_dict_adapter.py"):
        (models / "sandwich" / name).write_text("")
    model_cls = type("SandwichLM", (), {"__module__": "gamma_titan.models.sandwich.model"})
    families = {**readme_tables.own_families(), "gamma_sandwich": SimpleNamespace(model_cls=model_cls, model_args={})}
    text = README.read_text(encoding="utf-8")
    new = readme_tables.generate(text, families, models).split("\n")
    at = next(i for i, line in enumerate(new) if line.startswith("    sandwich/"))
    assert new[at:at + 3] == [
        "    sandwich/        gamma_sandwich: A sandwich block (Ding et al. 2021, §3): a norm before and",
        "                     after each sublayer",
        "                     __init__.py, args.py, model.py, state_dict_adapter.py"]
    assert new[:at] + new[at + 3:] == text.split("\n")  # nothing else changes
    start, end = readme_tables.models_span(new)
    assert [line.split()[0] for line in new[start:end] if line[4] != " "] == \
        ["common/", "dense/", "moe/", "sandwich/", "titan/"]


def adding_a_family() -> str:
    text = README.read_text(encoding="utf-8")
    return text.split("\n**Adding a model family**", 1)[1].split("\n## ", 1)[0]


def bullet_lists(section: str) -> list[list[str]]:
    """The section's bullet lists, each item's lines joined."""
    lists, items = [], None
    for line in section.split("\n"):
        if line.startswith("- "):
            if items is None:
                items = []
                lists.append(items)
            items.append(line[2:])
        elif line.startswith("  ") and items:
            items[-1] += " " + line.strip()
        else:
            items = None
    return lists


#: An item of what the folder provides: `name` (or `name()`), then its file in brackets.
PART = re.compile(r"`(\w+)(\(\))?`(?: \(`([\w.]+)`\))?:")


def test_adding_a_model_family_lists_what_the_code_requires():
    """"Adding a model family" lists, first, exactly the arguments `family_train_spec` needs
    (each a field of the TrainSpec it returns) and `get_train_spec()`, each with the file it
    lives in; every own family of ours keeps each there (checked on the objects its TrainSpec
    holds). Then, outside the folder, exactly three things: the TRAIN_SPECS line, the
    configs if any, and the generator's command, which is the one this checkout runs."""
    from gamma_titan.models import TRAIN_SPECS
    from gamma_titan.models.common.decoder import DecoderLM
    from gamma_titan.models.common.train_spec import family_train_spec

    section = adding_a_family()
    provides, outside = bullet_lists(section)[:2]
    parts = [PART.match(item) for item in provides]
    assert all(parts), [item[:60] for item, part in zip(provides, parts) if not part]
    files = {part[1]: part[3] for part in parts}
    required = [name for name, p in inspect.signature(family_train_spec).parameters.items()
                if p.default is inspect.Parameter.empty]
    assert [part[1] for part in parts if not part[2]] == required, "the list is family_train_spec's arguments"
    assert [(part[1], part[3]) for part in parts if part[2]] == [("get_train_spec", "__init__.py")]
    sentinels = {name: object() for name in required}
    spec = family_train_spec(**sentinels)
    field_of = {name: next(f for f, v in vars(spec).items() if v is sentinels[name]) for name in required}
    own = readme_tables.own_families()
    ours = {name: s for name, s in own.items() if issubclass(s.model_cls, DecoderLM)}
    assert "gamma_dense" in ours
    for name, family in ours.items():
        folder = readme_tables.family_folder(family)
        package = f"gamma_titan.models.{folder}"
        module = sys.modules[package]
        assert module.get_train_spec().model_cls is family.model_cls, name  # __init__.py: get_train_spec()
        for argument, file in files.items():
            if argument == "get_train_spec" or file is None:
                continue
            held = getattr(family, field_of[argument])
            assert (PACKAGE / "models" / folder / file).is_file(), (name, file)
            where = f"{package}.{file.removesuffix('.py')}"
            if argument == "flavors":  # the Flavors table and its args' class
                assert any(v is held for v in vars(sys.modules[where]).values()) and \
                    type(next(iter(held.values()))).__module__ == where, (name, argument, where)
            else:
                assert held.__module__ == where, (name, argument, held.__module__, where)
    assert "parallelize_decoder" in provides[[p[1] for p in parts].index("parallelize_fn")]
    assert TRAIN_SPECS["gamma_dense"].parallelize_fn.__name__ == "parallelize_decoder"
    # outside the folder
    assert len(outside) == 3, outside
    line, configs, command = outside
    assert "`TRAIN_SPECS` (`gamma_titan/models/__init__.py`)" in line
    registration = re.search(r'`"(\w+)": (\w+)\.get_train_spec\(\),`', line)
    assert registration and registration[1] in own
    assert f"{registration[2]}.get_train_spec()" in (PACKAGE / "models" / "__init__.py").read_text(encoding="utf-8")
    assert "`configs/<folder>/*.toml`" in configs and "if it ships any" in configs
    assert f"`{readme_tables.COMMAND}`" in command
    assert readme_tables.COMMAND.split()[1] == "tools/readme_tables.py" and (REPO / "tools/readme_tables.py").is_file()
    assert "Nothing else outside the folder is edited." in section


def test_the_generator_checks_and_writes_from_the_command_line(tmp_path, capsys):
    """`python tools/readme_tables.py` exits 1 on a stale README, naming the command;
    `--write` rewrites it; the check then passes."""
    readme = tmp_path / "README.md"
    text = README.read_text(encoding="utf-8")
    readme.write_text(text.replace("    dense/ ", "    dense/  hand-edited", 1), encoding="utf-8")
    assert readme_tables.main(["--readme", str(readme)]) == 1
    assert f"run: {readme_tables.COMMAND}" in capsys.readouterr().err
    assert readme_tables.main(["--readme", str(readme), "--write"]) == 0
    assert readme.read_text(encoding="utf-8") == text
    assert readme_tables.main(["--readme", str(readme)]) == 0
    readme.write_text(text.replace("<!-- flavors: gamma_dense", "<!-- flavors: gamma_nothing", 1), encoding="utf-8")
    assert readme_tables.main(["--readme", str(readme)]) == 2
    assert "gamma_nothing" in capsys.readouterr().err
