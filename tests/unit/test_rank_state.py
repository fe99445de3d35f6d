"""A train rank's recovery state is data (safetensors, JSON, raw bytes) and loads in place.

Real `TrainWorker`s on the tiny model (one CPU rank, gloo): one takes an optimizer step and
saves; a fresh one loads and then holds the same trainable weights, optimizer state, step and
RNG state, in the same parameter tensors it had (CUDA graphs and views hold them). A checkpoint
in the old torch.distributed.checkpoint format, whose ``.metadata`` is a pickle, is refused
without reading it: a payload that would write a file never runs.
"""

from __future__ import annotations

import json
import pickle
import socket

import attrs
import pytest
import torch

from arl.ckpt.rank_state import RankStateError, check_format
from arl.config import ActorConfig
from arl.node.train import TrainWorker
from tests.support.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(model_dir: str, dtype: str, device: str = "cpu") -> TrainWorker:
    actor = attrs.asdict(ActorConfig(path=model_dir, dtype=dtype))
    url = f"tcp://127.0.0.1:{_port()}"
    return TrainWorker(actor, rank=0, world_size=1, init_method=url, device=device)


def _step(w: TrainWorker) -> None:
    """One real AdamW step of the engine on fixed gradients."""
    g = torch.Generator().manual_seed(3)
    for p in w.engine.model.parameters():
        p.grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
    w.engine.optimizer.step()
    w.engine.optimizer.zero_grad()
    w.engine.sync_forward_weights()


_CUDA = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize(
    ("dtype", "device"),
    [
        ("float32", "cpu"),
        ("bfloat16", "cpu"),
        # fused AdamW (its step on the device), CUDA graphs holding the parameters, CUDA RNG
        pytest.param("bfloat16", "cuda", marks=_CUDA),
    ],
)
def test_state_round_trips_in_place(tmp_path, model_dir, dtype, device):
    a = _worker(model_dir, dtype, device)
    try:
        _step(a)
        assert a.save_state(str(tmp_path / "model")) > 0
        want = {n: p.detach().clone() for n, p in a.engine.model.named_parameters()}
        want_opt = {
            n: {k: v.clone() for k, v in a.engine.optimizer.state[p].items()}
            for n, p in a.engine.model.named_parameters()
        }
        want_rng = torch.get_rng_state()
        want_cuda_rng = torch.cuda.get_rng_state() if device == "cuda" else None
    finally:
        a.close()
    torch.manual_seed(99)  # a different RNG state (CUDA's too), to be restored
    b = _worker(model_dir, dtype, device)
    try:
        params = dict(b.engine.model.named_parameters())
        ptrs = {n: p.data_ptr() for n, p in params.items()}
        assert any(not torch.equal(params[n], want[n]) for n in want)
        b.load_state(str(tmp_path / "model"), step=1)
        for n, p in b.engine.model.named_parameters():
            assert p is params[n] and p.data_ptr() == ptrs[n], n  # in place
            assert torch.equal(p, want[n]), n
            state = b.engine.optimizer.state[p]
            assert set(state) == set(want_opt[n]), n
            for k, v in want_opt[n].items():
                assert torch.equal(state[k].cpu(), v.cpu()), (n, k)
        assert torch.equal(torch.get_rng_state(), want_rng)
        if want_cuda_rng is not None:
            assert torch.equal(torch.cuda.get_rng_state(), want_cuda_rng)
        assert b.get_step() == 1
        # The forward copy (bf16 on one rank) was refreshed from the loaded masters.
        fwd = dict(b.engine.forward_model.named_parameters())
        for n, p in b.engine.model.named_parameters():
            assert torch.equal(fwd[n], p.to(fwd[n].dtype)), n
    finally:
        b.close()
    files = sorted(p.name for p in (tmp_path / "model").iterdir())
    cuda = ["rng-cuda-rank0.bin"] if device == "cuda" else []
    assert files == [
        "optim-rank0.safetensors",
        "params-rank0.safetensors",
        "rank0.json",
        *cuda,
        "rng-rank0.bin",
    ]
    meta = json.loads((tmp_path / "model" / "rank0.json").read_text())
    assert meta["world_size"] == 1 and meta["param_groups"][0]["lr"] > 0


def test_another_world_size_is_refused(tmp_path, model_dir):
    a = _worker(model_dir, "float32")
    try:
        a.save_state(str(tmp_path / "model"))
    finally:
        a.close()
    with pytest.raises(RankStateError, match="holds the state of 1 train ranks, this run has 2"):
        check_format(tmp_path / "model", world_size=2)


class _Payload:
    """Unpickling this writes ``path``: what a tampered checkpoint would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickled_dcp_checkpoint_is_refused_and_never_unpickled(tmp_path, model_dir):
    marker = tmp_path / "pwned"
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    (folder / "__0_0.distcp").write_bytes(b"\0" * 64)
    (folder / "rng-0.pt").write_bytes(pickle.dumps(_Payload(str(marker))))
    w = _worker(model_dir, "float32")
    try:
        with pytest.raises(Exception, match="torch.distributed.checkpoint.*not read"):
            w.load_state(str(folder), step=2)
    finally:
        w.close()
    assert not marker.exists()
