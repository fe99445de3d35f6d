"""The launcher's GPU count and sizes without torch (`arl.control.gpus`): ``CUDA_VISIBLE_DEVICES``
applied as CUDA applies it where NVML's list can tell, and None (ask torch) where it cannot."""

import glob

import pytest
import torch

from arl.control import gpus
from arl.control.gpus import Gpu, visible

H200 = dict(name="NVIDIA H200", total_bytes=150_000_000_000)
HOST = [
    Gpu(index=0, uuid="GPU-0a1b2c3d-0000-0000-0000-000000000000", **H200),
    Gpu(index=1, uuid="GPU-0a1bffff-1111-1111-1111-111111111111", **H200),
    Gpu(index=2, uuid="GPU-9f000000-2222-2222-2222-222222222222", **H200),
]


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        (None, [0, 1, 2]),  # unset: every GPU
        ("", []),  # empty: none
        ("  ", []),
        ("2", [2]),
        ("2,0", [2, 0]),  # CUDA numbers them in the order given
        (" 1 , 2 ", [1, 2]),
        ("GPU-9f", [2]),  # a unique UUID prefix
        ("GPU-0a1b2c3d-0000-0000-0000-000000000000,1", [0, 1]),
    ],
)
def test_visible_devices_select_and_order_as_cuda_does(spec, want):
    env = {} if spec is None else {"CUDA_VISIBLE_DEVICES": spec}
    assert [g.index for g in visible(HOST, env)] == want


@pytest.mark.parametrize(
    "spec",
    [
        "3",  # past the last GPU: CUDA stops there
        "0,0",  # repeated
        "-1",
        "GPU-0a1b",  # a prefix of two UUIDs
        "GPU-ffff",  # no such UUID
        "MIG-1234",  # MIG instances are CUDA's numbering, not NVML's list
        "0,x",
    ],
)
def test_what_nvml_cannot_tell_is_left_to_torch(spec):
    assert visible(HOST, {"CUDA_VISIBLE_DEVICES": spec}) is None


def test_mig_and_mixed_gpus_in_fastest_first_order_are_left_to_torch():
    mig = [*HOST[:2], Gpu(index=2, uuid="GPU-9f", mig=True, **H200)]
    assert visible(mig, {}) is None
    mixed = [HOST[0], Gpu(index=1, uuid="GPU-1", name="NVIDIA H100", total_bytes=80 * 10**9)]
    assert visible(mixed, {}) is None  # CUDA's default order may not be NVML's PCI order
    assert [g.index for g in visible(mixed, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})] == [0, 1]
    assert [g.index for g in visible(mixed, {"CUDA_VISIBLE_DEVICES": "1"})] == [1]  # one kind


def test_a_missing_nvml_library_reads_as_none():
    assert gpus.nvml_gpus("libnvidia-ml-absent.so.1") is None


def test_the_count_and_sizes_are_torchs():
    """On this host, whatever it has: the same count torch gives, and the same bytes."""
    assert gpus.gpu_count() == torch.cuda.device_count()
    found = gpus.gpu_memory(0)
    if not torch.cuda.is_available():
        assert found is None
    else:
        props = torch.cuda.get_device_properties(0)
        assert found == (props.total_memory, props.name)


def test_a_host_without_nvml_or_gpu_device_files_has_no_gpu_without_asking_torch(monkeypatch):
    monkeypatch.setattr(gpus, "nvml_gpus", lambda library="": None)
    monkeypatch.setattr(glob, "glob", lambda pattern: [])
    gpus._host_gpus.cache_clear()
    assert gpus.visible_gpus() == []
    monkeypatch.setattr(glob, "glob", lambda pattern: ["/dev/kfd"] if "kfd" in pattern else [])
    assert gpus.visible_gpus() is None  # a ROCm host: torch counts its GPUs
    gpus._host_gpus.cache_clear()  # the next test reads this host again
