"""Model families that live outside gamma_titan/, as a user's own package would. Each
subfolder is a family's package (`families.<folder>`) whose `__init__.py` sets `NAME`, the
name its entry point registers (group `gamma_titan.families`). tests/conftest.py installs
them all for the session (`install`), so every registry-driven test (the family matrix of
tests/test_families.py included) takes them as it takes the package's own families."""

from __future__ import annotations

import ast
from pathlib import Path

HERE = Path(__file__).parent


def fixture_names() -> dict[str, str]:
    """{registered name: folder} of the fixture families, read from each `__init__.py`
    without importing it (importing it would import gamma_titan.models, whose registry
    reads the installed entry points once, before they are installed)."""
    names = {}
    for init in sorted(HERE.glob("*/__init__.py")):
        for node in ast.parse(init.read_text()).body:
            if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["NAME"]:
                names[ast.literal_eval(node.value)] = init.parent.name
    return names


def install(site: Path, group: str) -> dict[str, str]:
    """Write one dist-info folder into `site` (a folder on sys.path) whose entry points
    register every fixture family, as `pip install` of a package holding them would."""
    info = site / "gamma_titan_test_families-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gamma-titan-test-families\nVersion: 0\n")
    names = fixture_names()
    lines = "".join(f"{name} = families.{folder}:get_train_spec\n" for name, folder in names.items())
    (info / "entry_points.txt").write_text(f"[{group}]\n{lines}")
    return names
