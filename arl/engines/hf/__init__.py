"""The embedded ``hf`` inference engine: a transformers causal LM with continuous batching.

One background thread (owned by the engine, started on the first request, ended by `close()`)
runs the decode loop over every active request. New requests join between decode steps: their
prompts (all but the last token) are prefilled straight into free rows of a slot KV cache, and
the last prompt token is fed by the next decode step, which therefore also samples their first
output token. Each cache row holds one request at its own length; a per-row additive attention
mask and per-row position ids keep requests of different lengths apart in one batch. Results
reach the caller's event loop with ``loop.call_soon_threadsafe``; the loop is never blocked.

Log-probs: each returned log-prob is ``log_softmax(logits / T)`` of the sampled token, taken
after temperature and *before* top-p/top-k truncation, which is what the trainer recomputes.
Greedy requests use ``T = temperature`` if it is positive, else 1.

Decode attention (``decode_attention``): ``"sdpa"`` reads every row's KV cache up to the batch's
longest row, bucketed, under the additive mask; ``"flex"`` (flex.py) runs torch's compiled
``flex_attention`` with a block mask built from each row's own length, so a step reads about the
rows' own lengths; ``"triton"`` (split_decode.py) reads the same positions with one split-KV
Triton kernel, compiled once for every batch bucket where flex compiles once per bucket;
``"auto"`` (the default) is triton on CUDA and sdpa elsewhere. Prefill takes SDPA either way.

Decode step (fused.py): for the Llama family (llama, mistral, qwen2, qwen3) a decode step runs as
three fused functions per layer (``torch.compile``d on CUDA, with the batch dimension dynamic)
instead of through transformers' modules, about half the kernels; the q/k/v and gate/up
Parameters are views of one buffer each, and all layers' keys and values share one buffer, so
compaction is one copy. Other models, and ``fused_decode=False``, decode through the modules.

On CUDA the decode step is replayed from CUDA graphs, one per (batch bucket, KV-length bucket),
or with flex one per batch bucket at the cache's whole width (blocks past a row's length cost
nothing), since per-step host overhead, not the GPU, bounds an eager decode step. A fused
prefill is replayed from a graph of its (rows, width) bucket too (graphs.py `PrefillGraphs`:
captured on a bucket's first prefill, which runs eagerly); newcomers are admitted at most every
``prefill_interval`` decode steps while others run. With ``warm_up_len`` (the trainer passes
prompt + new tokens) every decode graph up to that length is captured when the engine is built,
as a server does before it serves.

Pausing for a weight sync: `pause()` ends every running request with ``"abort"`` at its next
step boundary (the caller resubmits it, so its prompt and tokens so far are prefilled again).
`pause(in_place=True)` instead parks the decode thread at the step boundary with the rows still
in the batch; after `resume()` they decode on under the new weights, attending to the keys and
values cached under the old ones (PipelineRL's in-flight update). Each token keeps the log-prob
it was sampled with and its version, which is what the decoupled PPO loss needs.

LoRA (engine option ``lora``, the ``actor.lora`` dict): the trainer's peft adapters are injected
into the loaded model before the blocks are compiled and graphs captured, so the engine computes
base + adapter exactly as the trainer's forward does; a sync copies the adapter's tensors in place
(or loads a peft adapter folder), and `weights_checksum` covers the adapter only.

Sleeping (``rollout.gpu_sharing=sleep``): `sleep(drop_weights)` pauses in abort mode and frees
the decode and prefill graphs and the KV cache, and with ``drop_weights`` the storage of the
weights a sync rewrites (the Parameters stay, empty); `wake()` reallocates them, and the next
sync fills them.
Requests submitted meanwhile wait until `resume()`.
"""

from arl.engines.hf.engine import HFEngine
from arl.engines.hf.errors import (
    EngineAsleepError,
    EngineClosedError,
    EngineNotPausedError,
    EngineStepError,
    HFEngineError,
    UnknownWeightError,
)
from arl.engines.hf.weights import checksum_named_tensors

__all__ = [
    "EngineAsleepError",
    "EngineClosedError",
    "EngineNotPausedError",
    "EngineStepError",
    "HFEngine",
    "HFEngineError",
    "UnknownWeightError",
    "checksum_named_tensors",
]
