"""A decode step of the hf engine alone, and beside a training-like load on the same GPU.

    python docs/results/decode_h200/s17_contend.py [proc,thread,prio]

The step: SmolLM2-135M's shape with random weights, ROWS rows (default 320) at prompt lengths
64..1044, its CUDA graph replayed, sampled and copied back to the host. The load: the same
model's forward, backward and AdamW step on 16 x 1,024 tokens. Modes: ``proc`` runs the load in
another process (two CUDA contexts, as arl's train and rollout nodes); ``thread`` in a thread of
this process; ``prio`` the same with the load on a low-priority stream and decode on a
high-priority one. Session 17's output: s17_contend.log (and s17_contend_mps.log, the ``proc``
mode under an MPS control daemon started with its own CUDA_MPS_PIPE_DIRECTORY).
"""

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from arl.bench.gpu import mixed_lengths, prepare_model
from arl.engines.hf import HFEngine

LOAD = r"""
import sys, time, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16).cuda()
opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
ids = torch.randint(0, 1000, (16, 1024), device="cuda")
def it():
    loss = m(input_ids=ids).logits.float().logsumexp(-1).mean()
    loss.backward(); opt.step(); opt.zero_grad()
for _ in range(3): it()
torch.cuda.synchronize(); print("ready", flush=True)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < float(sys.argv[2]):
    it(); torch.cuda.synchronize(); n += 1
print(f"load {n / (time.perf_counter() - t0):.2f} it/s", flush=True)
"""


class Row:
    greedy, top_p, top_k = False, 1.0, 0


class TrainThread(threading.Thread):
    """The load in a thread of this process, on stream ``stream``; counts its iterations."""

    def __init__(self, path: str, stream: torch.cuda.Stream):
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-6)
        self.ids = torch.randint(0, 1000, (16, 1024), device="cuda")
        self.stream, self.stop, self.count = stream, threading.Event(), 0

    def run(self) -> None:
        with torch.enable_grad(), torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                loss = self.model(input_ids=self.ids).logits.float().logsumexp(-1).mean()
                loss.backward()
                self.opt.step()
                self.opt.zero_grad()
                torch.cuda.current_stream().synchronize()
                self.count += 1


def main() -> None:
    modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["proc", "thread", "prio"]
    rows = int(os.environ.get("ROWS", "320"))
    path = prepare_model("random", None, Path(tempfile.mkdtemp()))
    eng = HFEngine(
        path,
        device="cuda",
        dtype="bfloat16",
        max_batch_size=rows,
        max_seq_len=1400,
        decode_attention="flex",
    )
    lens = mixed_lengths(rows, 64, 1044)
    eng._cache.reserve(rows, max(lens) + 1)
    eng._pos[:rows] = torch.tensor(lens, device="cuda")
    width = eng._cache.seq_capacity
    graph = eng._graphs.get(rows, width, eng._cache, eng._forward_decode)
    reqs = [Row()] * rows

    def step() -> None:
        graph.graph.replay()
        tok, lp = eng._sample(graph.logits[:rows], reqs)
        torch.stack([tok.double(), lp.double()]).cpu()

    def time_steps(n: int = 300, stream: torch.cuda.Stream | None = None) -> tuple[float, float]:
        times = []
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            for _ in range(n):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
        return 1e3 * statistics.mean(times), 1e3 * statistics.median(times)

    def load_process(secs: float) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", LOAD, str(path), str(secs)], stdout=subprocess.PIPE, text=True
        )

    with torch.no_grad():
        print(f"rows {rows} width {width}")
        mean, median = time_steps()
        print(f"decode alone: mean {mean:.3f} ms median {median:.3f} ms")
        alone = load_process(4.0)
        print("load alone:", alone.communicate()[0].strip().splitlines()[-1])
        for mode in modes:
            if mode == "proc":
                p = load_process(8.0)
                assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                mean, median = time_steps()
                out = p.communicate()[0].strip()
                print(f"decode + load process: mean {mean:.3f} ms median {median:.3f} ms; {out}")
                continue
            load = TrainThread(path, torch.cuda.Stream(priority=0))
            high = torch.cuda.Stream(priority=-5) if mode == "prio" else None
            load.start()
            time.sleep(3.0)
            c0, t0 = load.count, time.perf_counter()
            mean, median = time_steps(stream=high)
            rate = (load.count - c0) / (time.perf_counter() - t0)
            load.stop.set()
            load.join()
            print(
                f"decode + load thread ({mode}): mean {mean:.3f} ms median {median:.3f} ms; "
                f"load {rate:.2f} it/s"
            )
    eng.close()


if __name__ == "__main__":
    main()
