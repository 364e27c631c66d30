"""Make TorchTitan 0.2.x run on a machine without an accelerator.

TorchTitan decides its device at import time (`torchtitan.tools.utils.get_device_info`
falls back to "cuda" when no accelerator is found) and several of its modules bind
`device_type` / `device_module` when they are imported. So this module must run before
any `torchtitan` import; `gamma_titan/__init__.py` calls `apply()` first thing.

On a machine with CUDA nothing here changes anything: TorchTitan's normal path (NCCL,
CUDA memory stats, ...) is used as is. Without one:

* device detection answers "cpu", so the process group is gloo and tensors live on CPU;
* the device module is `torch.cpu` plus the few calls TorchTitan's trainer makes that
  `torch.cpu` lacks (device name and memory, peak-memory stats, `empty_cache`), with
  peak memory taken from the process's peak resident set size.
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import sys
import types

import torch

_applied = False


def accelerator_available() -> bool:
    """True when TorchTitan's own device detection would find a real device."""
    return torch._utils._get_available_device_type() is not None


class _CpuDeviceModule(types.ModuleType):
    """`torch.cpu` with the calls TorchTitan expects from `torch.cuda`.

    Everything not defined here is looked up on `torch.cpu`.
    """

    def __init__(self) -> None:
        super().__init__("gamma_titan.cpu_fallback.cpu")

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device=None) -> str:
        return platform.processor() or platform.machine() or "cpu"

    @staticmethod
    def get_device_properties(device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(total_memory=total, name="cpu")

    @staticmethod
    def current_device() -> int:
        # Used as `barrier(device_ids=[...])`; gloo ignores the index.
        return 0

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        # The kernel's peak RSS cannot be reset; the reported peak is per process.
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device=None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }


cpu_device_module = _CpuDeviceModule()


@contextlib.contextmanager
def _detect_cpu():
    """While TorchTitan's device detection runs, make it answer 'cpu'."""
    saved = torch._utils._get_available_device_type, torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = (
        lambda device_type=None: cpu_device_module
        if device_type in (None, "cpu")
        else saved[1](device_type)
    )
    try:
        yield
    finally:
        torch._utils._get_available_device_type, torch._utils._get_device_module = saved


def apply() -> None:
    """Idempotent. Must run before the first `import torchtitan`."""
    global _applied
    if _applied or accelerator_available():
        _applied = True
        return
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError(
            "gamma_titan must be imported before torchtitan on a machine without an "
            "accelerator (TorchTitan fixes its device type at import time)"
        )
    with _detect_cpu():
        import torchtitan.tools.utils as titan_utils  # noqa: F401  (binds device_type="cpu")
    assert titan_utils.device_type == "cpu"
    _applied = True
