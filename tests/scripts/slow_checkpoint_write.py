"""Test machinery, loaded into a trainer with `--experimental.custom_import
slow_checkpoint_write` (tests/scripts on PYTHONPATH): every DCP save waits
GAMMA_TITAN_TEST_SAVE_DELAY seconds before writing its `.metadata` (the file that makes a
checkpoint complete), as a multi-GB save on a shared file system does."""

import os
import time

from torch.distributed.checkpoint.filesystem import FileSystemWriter

import gamma_titan  # noqa: F401  (what the configs' custom_import loads otherwise)

_finish = FileSystemWriter.finish
DELAY = float(os.environ.get("GAMMA_TITAN_TEST_SAVE_DELAY", "0"))


def _slow_finish(writer, metadata, results):
    print(f"slow_checkpoint_write: waiting {DELAY:g} s before .metadata", flush=True)
    time.sleep(DELAY)
    return _finish(writer, metadata, results)


FileSystemWriter.finish = _slow_finish
