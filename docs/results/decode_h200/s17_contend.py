"""Decode graph replay alone and beside a training-like load on the same GPU.

modes: proc (load in another process), thread (load in a thread, same process, default
stream priority), prio (load thread on a low-priority stream, decode on a high-priority one).
"""
import os, sys, time, threading, subprocess, statistics, tempfile
from pathlib import Path
import torch
from arl.bench.gpu import prepare_model, mixed_lengths
from arl.engines.hf import HFEngine

modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["proc", "thread", "prio"]
ROWS = int(os.environ.get("ROWS", "320"))
tmp = Path(tempfile.mkdtemp())
path = prepare_model("random", None, tmp)

LOAD = r'''
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
'''

def load_alone(secs=4.0):
    r = subprocess.run([sys.executable, "-c", LOAD, str(path), str(secs)], capture_output=True, text=True)
    print("load alone:", r.stdout.strip().splitlines()[-1], r.stderr[-300:] if r.returncode else "")

eng = HFEngine(path, device="cuda", dtype="bfloat16", max_batch_size=ROWS, max_seq_len=1400,
               decode_attention="flex")
lens = mixed_lengths(ROWS, 64, 1044)
eng._cache.reserve(ROWS, max(lens) + 1)
eng._pos[:ROWS] = torch.tensor(lens, device="cuda")
width = eng._cache.seq_capacity
g = eng._graphs.get(ROWS, width, eng._cache, eng._forward_decode)
class R: greedy=False; top_p=1.0; top_k=0
reqs = [R()] * ROWS

def step():
    g.graph.replay()
    tok, lp = eng._sample(g.logits[:ROWS], reqs)
    torch.stack([tok.double(), lp.double()]).cpu()

def time_steps(n=300, stream=None):
    ts = []
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
    with ctx:
        for _ in range(20): step()
        torch.cuda.synchronize()
        for _ in range(n):
            t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    return 1e3 * statistics.mean(ts), 1e3 * statistics.median(ts)

with torch.no_grad():
    print(f"rows {ROWS} width {width}")
    print("decode alone: mean %.3f ms median %.3f ms" % time_steps())
    load_alone()
    for mode in modes:
        if mode == "proc":
            p = subprocess.Popen([sys.executable, "-c", LOAD, str(path), "8"], stdout=subprocess.PIPE, text=True)
            assert p.stdout.readline().strip() == "ready"
            r = time_steps()
            out = p.communicate()[0].strip()
            print(f"decode + load process: mean {r[0]:.3f} ms median {r[1]:.3f} ms; {out}")
        else:
            from transformers import AutoModelForCausalLM
            m = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).cuda()
            opt = torch.optim.AdamW(m.parameters(), lr=1e-6)
            ids = torch.randint(0, 1000, (16, 1024), device="cuda")
            lo = torch.cuda.Stream(priority=0)
            hi = torch.cuda.Stream(priority=-5) if mode == "prio" else None
            stop, count = threading.Event(), [0]
            def run():
                with torch.enable_grad(), torch.cuda.stream(lo):
                    while not stop.is_set():
                        loss = m(input_ids=ids).logits.float().logsumexp(-1).mean()
                        loss.backward(); opt.step(); opt.zero_grad()
                        torch.cuda.current_stream().synchronize(); count[0] += 1
            th = threading.Thread(target=run); th.start(); time.sleep(3.0)
            c0, t0 = count[0], time.perf_counter()
            r = time_steps(stream=hi)
            rate = (count[0] - c0) / (time.perf_counter() - t0)
            stop.set(); th.join()
            print(f"decode + load thread ({mode}): mean {r[0]:.3f} ms median {r[1]:.3f} ms; load {rate:.2f} it/s")
            del m, opt
eng.close()
