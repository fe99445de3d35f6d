"""Compilations of the hf engine's fused decode functions over an engine's warm-up (a decode
step at every row bucket) and five prefills of different shapes, counted per function by a
backend that runs the traced graph: dynamo decides what compiles, on a CPU, in seconds.

    PYTHONPATH=TREE python3 s21_count_compiles.py smollm2 384   # arith's rows on one engine
    PYTHONPATH=TREE python3 s21_count_compiles.py qwen 256      # Qwen2.5-1.5B's shape

The model is the named architecture cut to two layers, random weights (sizes, not depth, decide
what compiles).
"""

import collections
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arl.bench.gpu import QWEN25_1P5B, SMOLLM2_135M

counts: collections.Counter = collections.Counter()
_compile = torch.compile


def counting_compile(fn, **kwargs):
    name = getattr(fn, "__name__", "?")

    def backend(gm, example_inputs):
        counts[name] += 1
        return gm.forward

    return _compile(fn, **{**kwargs, "backend": backend})


def main() -> None:
    torch.compile = counting_compile  # before the engine's modules bind it
    from arl.engines.hf import HFEngine
    from arl.engines.hf.fused import FusedDecoder
    from arl.engines.hf.graphs import buckets, row_bucket

    which, max_rows = sys.argv[1], int(sys.argv[2])
    if which == "smollm2":
        cls, cfg = LlamaForCausalLM, LlamaConfig(**SMOLLM2_135M)
    else:
        cls, cfg = Qwen2ForCausalLM, Qwen2Config(**QWEN25_1P5B)
    cfg.num_hidden_layers, cfg.vocab_size = 2, 512
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:2]
    path = tempfile.mkdtemp()
    torch.manual_seed(0)
    cls(cfg).save_pretrained(path)
    (Path(path) / "tokenizer_config.json").write_text("{}")
    torch.set_num_threads(2)
    with HFEngine(path, max_batch_size=max_rows, max_seq_len=64, decode_attention="sdpa") as e:
        e._fused = FusedDecoder(e._model, compiled=True)
        e._cache.reserve(max_rows, 64)
        with torch.no_grad():
            for n in buckets(max_rows, row_bucket):
                e._pos[:n] = 0
                e._fused_decode(n, 64)
            decode = dict(counts)
            for shape in ((1, 1), (1, 9), (5, 7), (16, 33), (3, 60)):
                e._fused_prefill(0, torch.randint(0, 200, shape))
    print(f"{which}: row buckets {buckets(max_rows, row_bucket)}")
    print(f"  compilations after the decode warm-up: {decode}")
    print(f"  after five prefills: {dict(counts)}, total {sum(counts.values())}")


if __name__ == "__main__":
    main()
