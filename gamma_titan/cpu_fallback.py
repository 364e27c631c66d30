"""Make TorchTitan 0.2.x run on a machine without an accelerator.

TorchTitan decides its device at import time (`torchtitan.tools.utils.get_device_info`
falls back to "cuda" when no accelerator is found) and several of its modules bind
`device_type` / `device_module` when they are imported. `gamma_titan/__init__.py` installs
an import hook (`install_import_hook`): when `torchtitan.tools.utils` is first imported,
from anywhere, its module body runs with detection answering "cpu" where no accelerator
is found. Nothing here imports torch before then.

On a machine with CUDA nothing here changes anything: TorchTitan's normal path (NCCL,
CUDA memory stats, ...) is used as is. Without one:

* device detection answers "cpu", so the process group is gloo and tensors live on CPU;
* the device module is `torch.cpu` plus the few calls TorchTitan's trainer makes that
  `torch.cpu` lacks (device name and memory, peak-memory stats, `empty_cache`), with
  peak memory taken from the process's peak resident set size.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import os
import platform
import resource
import sys
import types

#: The TorchTitan module whose import detects the device.
DEVICE_MODULE = "torchtitan.tools.utils"


def accelerator_available() -> bool:
    """True when TorchTitan's own device detection would find a real device."""
    import torch

    return torch._utils._get_available_device_type() is not None


def _torch_cpu():
    import torch

    return torch.cpu


class _CpuDeviceModule(types.ModuleType):
    """`torch.cpu` with the calls TorchTitan expects from `torch.cuda`.

    Everything not defined here is looked up on `torch.cpu`.
    """

    def __init__(self) -> None:
        super().__init__("gamma_titan.cpu_fallback.cpu")

    def __getattr__(self, name: str):
        return getattr(_torch_cpu(), name)

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
    import torch

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


class _CpuDetectingLoader(importlib.abc.Loader):
    """TorchTitan's device module's own loader, run inside `_detect_cpu`."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        with _detect_cpu():
            self.loader.exec_module(module)
        assert module.device_type == "cpu"


class _DeviceHook(importlib.abc.MetaPathFinder):
    """Finds DEVICE_MODULE as the path finder does, with its loader wrapped, once, on a
    machine without an accelerator."""

    def find_spec(self, name, path, target=None):
        if name != DEVICE_MODULE:
            return None
        sys.meta_path.remove(self)  # once: later imports are TorchTitan's as they are
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and not accelerator_available():
            spec.loader = _CpuDetectingLoader(spec.loader)
        return spec


def install_import_hook() -> None:
    """Idempotent. Raises if TorchTitan's device was detected already, without us, on a
    machine without an accelerator."""
    if any(isinstance(f, _DeviceHook) for f in sys.meta_path):
        return
    if DEVICE_MODULE in sys.modules:
        if sys.modules[DEVICE_MODULE].device_type != "cpu" and not accelerator_available():
            raise RuntimeError("gamma_titan must be imported before torchtitan on a machine without an "
                               "accelerator (TorchTitan fixes its device type at import time)")
        return
    sys.meta_path.insert(0, _DeviceHook())
