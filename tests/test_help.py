"""`gamma-titan --help` and every subcommand's --help answer without importing torch or
torchtitan (building the parser asks nothing of the machine)."""

import subprocess
import sys

from helpers import REPO

PROBE = """
import sys, time
from gamma_titan.cli import build_parser
parser = build_parser()
for path in {paths!r}:
    try:
        parser.parse_args([*path, "--help"])
    except SystemExit as e:
        assert e.code == 0, (path, e.code)
print(sorted(m for m in ("torch", "torchtitan") if m in sys.modules))
"""

PATHS = [[], ["train"], ["inspect"], ["tokenizer", "train"], ["pretokenize"], ["convert", "to-hf"],
         ["convert", "from-hf"], ["eval"], ["report", "condensation"], ["report", "recipe"], ["report", "tokens"],
         ["recipe", "run"], ["recipe", "list"]]


def test_help_imports_neither_torch_nor_torchtitan():
    proc = subprocess.run([sys.executable, "-c", PROBE.format(paths=PATHS)], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    assert "usage: gamma-titan recipe run" in proc.stdout and "--nproc" in proc.stdout
