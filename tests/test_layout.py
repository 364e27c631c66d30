"""The README's Layout section and the packages' own module lists match the tree: every
module or package at the top of gamma_titan/ (and every folder of models/) is listed, and
nothing listed is missing; data/ and training/ name each of their modules in their
docstrings."""

import ast
import re
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "gamma_titan"


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
    assert listed(models, 4) == {e for e in entries(PACKAGE / "models") if e.endswith("/")}
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
