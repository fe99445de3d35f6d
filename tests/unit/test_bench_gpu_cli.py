"""``python -m arl.bench gpu`` on a machine without a GPU: it imports, parses its command line
(the ``decode_flex`` section included) and says that it needs a CUDA device."""

from __future__ import annotations

import pytest
import torch

from arl.bench import gpu


def test_defaults_run_every_section_with_flex_beside_sdpa() -> None:
    args = gpu.parse_args([])
    assert args.only == list(gpu.SECTIONS) and "decode_flex" in args.only
    assert args.batches == [1, 64, 256] and args.mixed_max == 1300


def test_decode_flex_options_parse_and_bad_ones_are_refused(capsys) -> None:
    args = gpu.parse_args(["--only", "decode_flex", "--batches", "8", "--mixed-max", "700"])
    assert args.only == ["decode_flex"] and args.batches == [8] and args.mixed_max == 700
    with pytest.raises(SystemExit):
        gpu.parse_args(["--only", "decode_flash"])
    assert "invalid choice: 'decode_flash'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu.parse_args(["--new-tokens", "256", "--mixed-max", "300"])
    assert "--mixed-max must be at least --new-tokens + 64" in capsys.readouterr().err


def test_mixed_lengths_spread_over_the_range() -> None:
    assert gpu.mixed_lengths(4, 64, 1044) == [64, 390, 717, 1044]
    assert gpu.mixed_lengths(1, 64, 1044) == [1044]
    spread = gpu.mixed_lengths(256, 64, 1044)
    assert len(spread) == 256 and spread[0] == 64 and spread[-1] == 1044
    assert spread == sorted(spread)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path")
def test_without_a_gpu_it_says_so(capsys) -> None:
    assert gpu.main(["--only", "decode_flex"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_engine_bench_runs_a_real_engine_on_the_cpu(tmp_path, attention: str) -> None:
    """`bench_engine`, which the decode sections time on the GPU, runs end to end on a real hf
    engine here (without graphs, so without the forward/sampling breakdown)."""
    from tests.support.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny")
    out = gpu.bench_engine(path, 3, [5, 9, 17], 6, decode_attention=attention, device="cpu")
    assert out["wall"] > 0 and out["steps"] >= 6
    assert out["forward"] != out["forward"]  # nan: no graphs to replay alone off CUDA
