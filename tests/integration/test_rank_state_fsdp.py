"""The data-only rank state on two FSDP2 ranks (gloo): each saves and loads its own shards.

Two real rank processes of `FSDPEngine` take an AdamW step, save (`save_rank_state`), have
their parameters and optimizer state overwritten in place, load, and must then hold the saved
values again in the same (sharded) parameter tensors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

_RANK = """
import json, sys
from pathlib import Path
import torch
from arl.ckpt.rank_state import load_rank_state, save_rank_state
from arl.config import ActorConfig
from arl.train.fsdp import FSDPEngine
from arl.train.sharding import local_tensor

torch.set_num_threads(1)
rank, init, model, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4])
eng = FSDPEngine(ActorConfig(path=model), rank=rank, world_size=2, init_method=init)
g = torch.Generator().manual_seed(5 + rank)
for p in eng.model.parameters():
    p.grad = p.detach().clone()
    local_tensor(p.grad).copy_(torch.randn(local_tensor(p).shape, generator=g))
eng.optimizer.step()
eng.optimizer.zero_grad()
save_rank_state(out, rank, 2, eng.model, eng.optimizer)
params = dict(eng.model.named_parameters())
want = {n: local_tensor(p).detach().clone() for n, p in params.items()}
want_opt = {
    n: {k: local_tensor(v).clone() for k, v in eng.optimizer.state[p].items()}
    for n, p in params.items()
}
ptrs = {n: local_tensor(p).data_ptr() for n, p in params.items()}
with torch.no_grad():
    for p in params.values():
        local_tensor(p).add_(1.0)
        for v in eng.optimizer.state[p].values():
            local_tensor(v).add_(1.0)
load_rank_state(out, rank, 2, eng.model, eng.optimizer)
ok = {
    "sharded": all(type(p).__name__ == "DTensor" for p in params.values()),
    "same_tensors": all(
        dict(eng.model.named_parameters())[n] is p and local_tensor(p).data_ptr() == ptrs[n]
        for n, p in params.items()
    ),
    "params": all(torch.equal(local_tensor(p), want[n]) for n, p in params.items()),
    "optim": all(
        torch.equal(local_tensor(eng.optimizer.state[p][k]).cpu(), v.cpu())
        for n, p in params.items()
        for k, v in want_opt[n].items()
    ),
}
(out / f"result{rank}.json").write_text(json.dumps(ok))
eng.destroy()
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_save_and_load_their_own_shards_in_place(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    model = tmp_path / "model"
    LlamaForCausalLM(cfg).save_pretrained(model)
    (model / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "state"
    out.mkdir()
    init = f"tcp://127.0.0.1:{_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), init, str(model), str(out)],
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    for r in range(2):
        result = json.loads((out / f"result{r}.json").read_text())
        assert result == {"sharded": True, "same_tensors": True, "params": True, "optim": True}
        meta = json.loads((out / f"rank{r}.json").read_text())
        assert meta["world_size"] == 2 and meta["rank"] == r
    # Each rank saved half of each sharded parameter, not the whole.
    full = dict(LlamaForCausalLM(cfg).named_parameters())
    shard = json.loads((out / "rank0.json").read_text())["params"]
    name = "model.embed_tokens.weight"
    assert shard[name][0][0] * 2 == full[name].shape[0], shard[name]
