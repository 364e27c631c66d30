"""Test machinery: faults injected into a real training run. A trainer loads it with
`--experimental.custom_import fault_injection` (tests/scripts on PYTHONPATH, see
tests/helpers.py), and these environment variables say what to break:

  GAMMA_TITAN_TEST_NAN_AT_STEPS=3,5         the model's output is NaN at these steps (a poisoned batch)
  GAMMA_TITAN_TEST_SPIKE_AT_STEPS=5         the model's logits are 100x at these steps (a loss spike:
                                            about 25 against ln V = 8.3 at γ = 1)
  GAMMA_TITAN_TEST_KILL_AT_STEP=7           the last rank SIGKILLs itself as this step starts
  GAMMA_TITAN_TEST_KILL_IN_SAVE_AT_STEP=6   rank 0 SIGKILLs itself inside this step's checkpoint
                                            write, after the data and before the DCP .metadata
                                            (the file that makes a checkpoint complete)
  GAMMA_TITAN_TEST_SAVE_DELAY=40            every checkpoint write waits this many seconds
                                            before its .metadata (a multi-GB save on a shared
                                            file system)
  GAMMA_TITAN_TEST_DISK_FULL_AT_STEP=4      this step's checkpoint write fails as a full disk
                                            does (OSError ENOSPC), after its data files and
                                            before its .metadata
  GAMMA_TITAN_TEST_BLIND_RANK=1             this rank does not see the checkpoints in the run
                                            folder (another node's stale view of a shared
                                            filesystem): TorchTitan's search for the newest
                                            finds none there
  GAMMA_TITAN_TEST_STEP_SECONDS=0.2         every training step takes at least this long (a
                                            model whose steps are as slow as a real one's, so a
                                            test can act on a run mid-way)
  GAMMA_TITAN_TEST_ECHO_ENV=A,B             each rank prints `fault_injection: rank R env A=...`
                                            as it loads (what reached the training processes)
  GAMMA_TITAN_TEST_FAIL_IN_CLOSE_RANK=1     this rank raises as the trainer closes, after training
                                            (outside TorchTitan's recorded Trainer methods)
  GAMMA_TITAN_TEST_FAIL_STARTS=N:PATH       the first N starts of each rank (counted in PATH.<rank>)
                                            exit 1 as the trainer loads this, before any step (a
                                            start that could not reach its rendezvous store)
"""

import errno
import os
import re
import signal
import time

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torchtitan.tools.logging import logger

import gamma_titan  # noqa: F401  (what the configs' custom_import loads otherwise)
from gamma_titan.training.trainer import GammaTrainer


def _steps(name: str) -> set[int]:
    return {int(s) for s in os.environ.get(name, "").split(",") if s.strip()}


NAN_AT = _steps("GAMMA_TITAN_TEST_NAN_AT_STEPS")
SPIKE_AT = _steps("GAMMA_TITAN_TEST_SPIKE_AT_STEPS")
KILL_AT = _steps("GAMMA_TITAN_TEST_KILL_AT_STEP")
KILL_IN_SAVE_AT = _steps("GAMMA_TITAN_TEST_KILL_IN_SAVE_AT_STEP")
SAVE_DELAY = float(os.environ.get("GAMMA_TITAN_TEST_SAVE_DELAY", "0"))
DISK_FULL_AT = _steps("GAMMA_TITAN_TEST_DISK_FULL_AT_STEP")
STEP_SECONDS = float(os.environ.get("GAMMA_TITAN_TEST_STEP_SECONDS", "0"))
current_step = [0]

BLIND_RANK = os.environ.get("GAMMA_TITAN_TEST_BLIND_RANK")

if os.environ.get("GAMMA_TITAN_TEST_FAIL_STARTS"):
    _times, _path = os.environ["GAMMA_TITAN_TEST_FAIL_STARTS"].split(":", 1)
    _counter = f"{_path}.{os.environ.get('RANK', '0')}"
    _failed = len(open(_counter).read()) if os.path.exists(_counter) else 0
    if _failed < int(_times):
        with open(_counter, "a") as _f:
            _f.write("x")
        print(f"fault_injection: failing start {_failed + 1} of rank {os.environ.get('RANK')}", flush=True)
        os._exit(1)

for _name in filter(None, os.environ.get("GAMMA_TITAN_TEST_ECHO_ENV", "").split(",")):
    print(f"fault_injection: rank {os.environ.get('RANK')} env {_name}={os.environ.get(_name)}", flush=True)

_train_step = GammaTrainer.train_step
_finish = FileSystemWriter.finish


def train_step(trainer, data_iterator):
    current_step[0] = trainer.step
    if (NAN_AT or SPIKE_AT) and not getattr(trainer, "_poisoned", False):
        trainer._poisoned = True

        def poison(module, inputs, output):
            if trainer.step in NAN_AT and module.training:
                logger.warning(f"step {trainer.step}: injecting NaN (fault_injection)")
                return output * float("nan")
            if trainer.step in SPIKE_AT and module.training:
                logger.warning(f"step {trainer.step}: injecting a loss spike (fault_injection)")
                return output * 100.0
            return output

        trainer.model_parts[-1].register_forward_hook(poison)
    if trainer.step in KILL_AT and dist.get_rank() == dist.get_world_size() - 1:
        logger.warning(f"step {trainer.step}: killing the last rank (fault_injection)")
        os.kill(os.getpid(), signal.SIGKILL)
    if STEP_SECONDS:
        time.sleep(STEP_SECONDS)
    return _train_step(trainer, data_iterator)


def finish(writer, metadata, results):
    if SAVE_DELAY:
        print(f"fault_injection: waiting {SAVE_DELAY:g} s before .metadata", flush=True)
        time.sleep(SAVE_DELAY)
    # the step this save is of, from its folder (an asynchronous save finishes steps later)
    saving = re.search(r"step-(\d+)", str(writer.path))
    if saving and int(saving.group(1)) in DISK_FULL_AT:
        raise OSError(errno.ENOSPC, "No space left on device (fault_injection)")
    if current_step[0] in KILL_IN_SAVE_AT and dist.get_rank() == 0:
        logger.warning(f"step {current_step[0]}: killing rank 0 inside the checkpoint write (fault_injection)")
        os.kill(os.getpid(), signal.SIGKILL)
    return _finish(writer, metadata, results)


GammaTrainer.train_step = train_step
FileSystemWriter.finish = finish

if os.environ.get("GAMMA_TITAN_TEST_FAIL_IN_CLOSE_RANK") == os.environ.get("RANK", "0"):
    _close = GammaTrainer.close

    def close(trainer):
        _close(trainer)
        raise RuntimeError(f"fault_injection: rank {os.environ.get('RANK')} fails as the trainer closes")

    GammaTrainer.close = close


if BLIND_RANK is not None and os.environ.get("RANK") == BLIND_RANK:
    from torchtitan.components.checkpoint import CheckpointManager

    CheckpointManager._find_load_step = lambda self, folder="": -1
