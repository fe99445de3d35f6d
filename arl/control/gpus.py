"""This host's GPUs as CUDA numbers them, read without importing torch (NVML through ctypes).

The launcher places nodes and fits the memory plan before any process starts; importing torch
for that costs it a second or more, on the path of every node's start. NVML (the driver's
management library, ``libnvidia-ml.so.1``) answers both questions, how many GPUs and how many
bytes each, without a CUDA context. It does not apply ``CUDA_VISIBLE_DEVICES``, so `visible`
applies it the way CUDA does for the cases read here: unset (every GPU), empty (none), and
distinct device indices or ``GPU-`` UUID prefixes. Every other case returns None, and so does a
host where NVML cannot tell what CUDA will see (MIG instances; GPUs of different models or
sizes numbered in CUDA's default fastest-first order, which NVML's PCI order need not follow);
the caller then asks torch, which is always right. A host without NVML and without an NVIDIA,
AMD or WSL GPU device file has no GPU to find: 0, without torch.

A GPU's bytes are what CUDA can allocate on it: NVML's total less what the driver reserves,
which is what ``torch.cuda.get_device_properties(i).total_memory`` reports.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
from collections.abc import Sequence

import attrs

_NVML_SUCCESS = 0
_NVML_FUNCTION_NOT_FOUND = 13
_NVML_NOT_SUPPORTED = 3
_NAME_LEN = 96
# Device files of a GPU that torch may see when NVML is missing (a container given the compute
# capability only, ROCm, WSL).
_GPU_DEVICE_FILES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dxg")


@attrs.frozen
class Gpu:
    """One GPU as NVML describes it (``index``: NVML's, in PCI bus order)."""

    index: int
    uuid: str
    name: str
    total_bytes: int  # what CUDA can allocate: NVML's total less the driver's reserve
    mig: bool = False


class _Memory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class _MemoryV2(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("total", ctypes.c_ulonglong),
        ("reserved", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class NvmlError(RuntimeError):
    """An NVML call failed; the caller falls back to torch."""


def _check(status: int, what: str) -> None:
    if status != _NVML_SUCCESS:
        raise NvmlError(f"{what} returned NVML status {status}")


def _total_bytes(lib: ctypes.CDLL, handle: ctypes.c_void_p) -> int:
    get_v2 = getattr(lib, "nvmlDeviceGetMemoryInfo_v2", None)
    if get_v2 is not None:
        mem = _MemoryV2(version=ctypes.sizeof(_MemoryV2) | (2 << 24))
        status = get_v2(handle, ctypes.byref(mem))
        if status == _NVML_SUCCESS:
            return int(mem.total - mem.reserved)
        if status not in (_NVML_NOT_SUPPORTED, _NVML_FUNCTION_NOT_FOUND):
            _check(status, "nvmlDeviceGetMemoryInfo_v2")
    mem1 = _Memory()
    _check(lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem1)), "nvmlDeviceGetMemoryInfo")
    return int(mem1.total)


def _mig_enabled(lib: ctypes.CDLL, handle: ctypes.c_void_p) -> bool:
    get = getattr(lib, "nvmlDeviceGetMigMode", None)
    if get is None:
        return False
    current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
    status = get(handle, ctypes.byref(current), ctypes.byref(pending))
    if status != _NVML_SUCCESS:  # not supported: a GPU without MIG
        return False
    return current.value == 1


def nvml_gpus(library: str = "libnvidia-ml.so.1") -> list[Gpu] | None:
    """Every GPU NVML sees on this host (all of them: no ``CUDA_VISIBLE_DEVICES``), or None
    where NVML cannot be loaded."""
    try:
        lib = ctypes.CDLL(library)
    except OSError:
        return None
    _check(lib.nvmlInit_v2(), "nvmlInit_v2")
    try:
        count = ctypes.c_uint(0)
        _check(lib.nvmlDeviceGetCount_v2(ctypes.byref(count)), "nvmlDeviceGetCount_v2")
        gpus = []
        for i in range(count.value):
            handle = ctypes.c_void_p()
            status = lib.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle))
            _check(status, "nvmlDeviceGetHandleByIndex_v2")
            uuid = ctypes.create_string_buffer(_NAME_LEN)
            _check(lib.nvmlDeviceGetUUID(handle, uuid, _NAME_LEN), "nvmlDeviceGetUUID")
            name = ctypes.create_string_buffer(_NAME_LEN)
            _check(lib.nvmlDeviceGetName(handle, name, _NAME_LEN), "nvmlDeviceGetName")
            gpus.append(
                Gpu(
                    index=i,
                    uuid=uuid.value.decode(),
                    name=name.value.decode(),
                    total_bytes=_total_bytes(lib, handle),
                    mig=_mig_enabled(lib, handle),
                )
            )
        return gpus
    finally:
        lib.nvmlShutdown()


def visible(gpus: Sequence[Gpu], env: dict[str, str] | os._Environ) -> list[Gpu] | None:
    """The GPUs CUDA will number 0, 1, ... under ``CUDA_VISIBLE_DEVICES`` (and
    ``CUDA_DEVICE_ORDER``) in ``env``, or None where that cannot be told from NVML's list."""
    if any(g.mig for g in gpus):
        return None  # CUDA numbers MIG instances, which NVML lists apart
    spec = env.get("CUDA_VISIBLE_DEVICES")
    if spec is None:
        chosen = list(gpus)
    elif not spec.strip():
        return []
    else:
        chosen = []
        for entry in (e.strip() for e in spec.split(",")):
            if entry.isdigit():
                index = int(entry)
                if index >= len(gpus):
                    return None  # CUDA stops at an index it does not have: leave it to torch
                gpu = gpus[index]
            elif entry.startswith("GPU-"):
                matches = [g for g in gpus if g.uuid.startswith(entry)]
                if len(matches) != 1:
                    return None
                gpu = matches[0]
            else:
                return None  # MIG-, negative or malformed entries: torch knows CUDA's rule
            if gpu in chosen:
                return None  # CUDA refuses a repeated device
            chosen.append(gpu)
    same = len({(g.name, g.total_bytes) for g in chosen}) <= 1
    if not same and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return None  # fastest-first order may differ from NVML's PCI order
    return chosen


def _has_gpu_device_file() -> bool:
    return any(glob.glob(pattern) for pattern in _GPU_DEVICE_FILES)


@functools.cache
def _host_gpus() -> list[Gpu] | None:
    """`nvml_gpus`, asked once per process (the launcher asks per GPU of its memory plan)."""
    return nvml_gpus()


def visible_gpus() -> list[Gpu] | None:
    """This process's GPUs as CUDA will number them, or None: ask torch instead."""
    try:
        gpus = _host_gpus()
    except NvmlError:
        return None
    if gpus is None:
        return None if _has_gpu_device_file() else []
    return visible(gpus, os.environ)


def gpu_count() -> int:
    """How many GPUs torch would see in this process (`visible_gpus`, else torch itself)."""
    gpus = visible_gpus()
    if gpus is not None:
        return len(gpus)
    import torch  # only where NVML cannot tell

    return torch.cuda.device_count()


def gpu_memory(index: int) -> tuple[int, str] | None:
    """(bytes CUDA can allocate, device name) of GPU ``index`` as torch numbers it (the first
    GPU where ``index`` is past the last), or None without a GPU."""
    gpus = visible_gpus()
    if gpus is not None:
        if not gpus:
            return None
        gpu = gpus[index] if index < len(gpus) else gpus[0]
        return gpu.total_bytes, gpu.name
    import torch  # only where NVML cannot tell

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index if index < torch.cuda.device_count() else 0)
    return int(props.total_memory), props.name
