"""LoRA under FSDP2 on two CUDA devices (NCCL, bf16 frozen base, fp32 adapters gathered in bf16
and reduced in fp32): the ranks of `tests/integration/test_lora_train.py` run on GPUs 0 and 1,
with the checks its CPU bf16 test makes (only the adapters train, the base stays, sync moves
the adapter, the export loads)."""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_lora_train import run_bf16_dp2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_lora_fsdp_on_two_gpus(tmp_path):
    run_bf16_dp2(tmp_path, cuda=True)
