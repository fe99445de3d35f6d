"""The memory plan on a CUDA machine: a GPU's capacity is the bytes CUDA can allocate on it, as
torch reports them (read through NVML, `arl.control.gpus`, where it can tell)."""

from __future__ import annotations

import pytest
import torch

from arl.config import Config, apply_overrides
from arl.control.memory import gpu_capacity, plan_memory
from arl.control.placement import plan_placement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_capacity_is_the_devices_total_unless_set():
    cfg = Config()
    capacity, note = gpu_capacity(cfg, 0)
    props = torch.cuda.get_device_properties(0)
    assert capacity == props.total_memory and note == f"{props.name}, as the driver reports it"
    cfg = apply_overrides(cfg, ["cluster.gpu_memory_gb=40"])
    assert gpu_capacity(cfg, 0) == (40 * 10**9, "cluster.gpu_memory_gb")


def test_the_default_model_fits_one_gpu_beside_its_engine():
    cfg = Config()  # SmolLM2-135M, from the HF cache or arl's converted copy
    mem = plan_memory(cfg, plan_placement(cfg, 1))
    if not mem.gpus:
        pytest.skip(mem.source)  # the default model is not on this machine
    assert mem.fits and "as the driver reports it): fits" in mem.format()
