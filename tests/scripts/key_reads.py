"""Test machinery: which keys of the JobConfig a real training run reads, and where from.

`record(job_config)` turns every section of a parsed config (nested ones too) into an
instance of a recording subclass: each read of a field notes the key and the reader (the
module and function of the first frame outside dataclasses' and copy's helpers);
`take()` returns `{key: [reader, ...]}` and starts afresh. tests/scripts/layout_matrix.py
records each case from the trainer's start to its close.

A single run loads it with `--experimental.custom_import key_reads` (tests/scripts on
PYTHONPATH) and `GAMMA_TITAN_TEST_KEY_READS=DIR`: TorchTitan's Trainer imports it at the top
of its `__init__`, before anything but `job.description` and `experimental.custom_import` was
read; it finds that `job_config` on the stack, records it, and as the process exits each rank
writes DIR/rank<RANK>.json.

What counts as taking effect is the test's to say (tests/test_key_support.py): a read by
code that only copies every field (the run record, TorchTitan's `maybe_log`) reads nothing.
"""

import atexit
import dataclasses
import json
import os
import sys
from pathlib import Path

#: Frames that are not a reader: they walk fields on behalf of their caller.
_PASS_THROUGH = ("dataclasses", "copy", __name__)

reads: dict[str, set[str]] = {}


def _reader() -> str:
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "") in _PASS_THROUGH:
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_globals.get('__name__', '?')}:{frame.f_code.co_name}"


_recording_classes: dict[type, type] = {}


def _recording(cls: type, prefix: str) -> type:
    """A subclass of the section's class whose field reads are noted under `prefix.field`."""
    if cls not in _recording_classes:
        names = {f.name for f in dataclasses.fields(cls)}

        def __getattribute__(self, name):
            if name in names:
                key = object.__getattribute__(self, "_key_reads_prefix") + name
                reads.setdefault(key, set()).add(_reader())
            return cls.__getattribute__(self, name)

        _recording_classes[cls] = type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                                               "__module__": cls.__module__})
    return _recording_classes[cls]


def record(section, prefix: str = "") -> None:
    """Turn `section` and the dataclasses inside it into recording ones, in place."""
    for field in dataclasses.fields(section):
        value = object.__getattribute__(section, field.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            record(value, f"{prefix}{field.name}.")
    if prefix:  # the JobConfig itself: reading a section is no key
        object.__setattr__(section, "_key_reads_prefix", prefix)
        section.__class__ = _recording(type(section), prefix)


def take() -> dict[str, list[str]]:
    out = {k: sorted(v) for k, v in sorted(reads.items())}
    reads.clear()
    return out


def _job_config():
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and "job_config" in frame.f_locals:
            return frame.f_locals["job_config"]
        frame = frame.f_back
    raise RuntimeError("key_reads: loaded outside a Trainer's __init__ (load it with --experimental.custom_import)")


def _write() -> None:
    folder = Path(os.environ["GAMMA_TITAN_TEST_KEY_READS"])
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps(take(), indent=0))


if os.environ.get("GAMMA_TITAN_TEST_KEY_READS"):
    import gamma_titan  # noqa: F401  (what the configs' custom_import loads otherwise)

    # Read before this module was imported (TorchTitan's Trainer.__init__, its first lines).
    reads["job.description"] = {"torchtitan.train:__init__"}
    reads["experimental.custom_import"] = {"torchtitan.train:__init__"}
    record(_job_config())
    atexit.register(_write)
