"""Session fixtures, the order the test files run in, and the fixture model families
(tests/families/) installed by entry points for this process and every process it starts."""

import atexit
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import gamma_titan  # noqa: F401  (first: TorchTitan's device detection answers "cpu" here)
from families import install

TESTS = Path(__file__).parent
#: A site folder holding the fixture families' entry points, on sys.path before anything
#: imports gamma_titan.models (its registry reads the entry points once), and on PYTHONPATH
#: (with tests/, where their packages are) for the trainers and tools the tests start.
_SITE = Path(tempfile.mkdtemp(prefix="gamma-titan-families-"))
atexit.register(shutil.rmtree, _SITE, ignore_errors=True)
# the group is gamma_titan.models.FAMILY_ENTRY_POINTS, which cannot be imported yet (test_new_family.py
# checks the families registered)
FIXTURE_FAMILIES = install(_SITE, group="gamma_titan.families")
sys.path.insert(0, str(_SITE))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_SITE), str(TESTS), os.environ.get("PYTHONPATH")]))

#: The slowest files, longest first (seconds measured on 2 cores, 2026-12-03: 324, 258, 229,
#: 175, 174, 171, 133, 132, 102, 95, 76, 76, 75, 74, 66, 56; test_slurm.py 300 on 2026-12-07).
#: pytest-xdist's loadfile hands files to its workers in collection order: the long ones go
#: out first and the many short files fill in at the end, so neither worker waits alone
#: behind a long file.
SLOWEST_FIRST = ("test_layouts.py", "test_slurm.py", "test_families.py", "test_titan_runs.py", "test_gpu_check.py", "test_moe_runs.py",
                 "test_estimate.py", "test_faults.py", "test_recipe_runs.py", "test_training.py",
                 "test_titan_bitwise.py", "test_parallel.py", "test_reliability.py", "test_faults_distributed.py",
                 "test_bench_gpu_dry_run.py", "test_bench_quick.py", "test_compile_sac.py", "test_resume.py",
                 "test_moe_training.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its order


@pytest.fixture(autouse=True)
def _environment_as_it_was():
    """Each test leaves os.environ as it found it. A command run in this process (cli_main)
    sets what its process would keep (a world of one's RANK and MASTER_PORT, the launch
    command): left behind, every trainer a later test starts inherits them, and two of them
    running at once then share a port."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


_ROOT = logging.getLogger()
_ROOT_AT_START = list(_ROOT.handlers), list(_ROOT.filters), _ROOT.level


@pytest.fixture(autouse=True)
def _root_logger_as_it_was():
    """Each test leaves the root logger (TorchTitan's) as the session found it. A trainer run in
    this process (init_logger, the run's log file, the CPU's filter; a module fixture's too) leaves
    a handler on the stream pytest captured for that test, closed once the test ends: a later
    test's logging then prints "--- Logging error ---" into the stderr it checks. pytest's own
    capture handlers come and go with each phase and are left to it."""
    yield
    handlers, filters, level = _ROOT_AT_START
    for handler in list(_ROOT.handlers):
        if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
            _ROOT.removeHandler(handler)
            handler.close()
    _ROOT.filters[:] = filters
    _ROOT.setLevel(level)


@pytest.fixture(scope="session")
def builtin_assets():
    """Build the built-in corpus and tokenizer once per session (cached across runs)."""
    from gamma_titan.data.builtin_corpus import ensure_builtin_corpus
    from gamma_titan.data.tokenizer import ensure_builtin_tokenizer

    return ensure_builtin_corpus(), ensure_builtin_tokenizer()
