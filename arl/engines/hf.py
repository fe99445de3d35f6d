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

On CUDA the decode step is replayed from CUDA graphs, one per (batch bucket, KV-length bucket),
since per-step host overhead, not the GPU, bounds an eager decode step. Prefill stays eager, so
newcomers are admitted at most every ``prefill_interval`` decode steps while others run.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch

from arl.engines.base import FinishReason, GenerationResult, SamplingParams

if TYPE_CHECKING:
    from arl.engines.spec import EngineSpec

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MIN_SEQ_CAPACITY = 128  # first KV allocation; grows by doubling up to max_seq_len
_MIN_ROW_CAPACITY = 4


class HFEngineError(RuntimeError):
    """Base class of the errors the hf engine raises."""


class EngineClosedError(HFEngineError):
    """The engine was closed; create a new one to keep generating."""


class EngineNotPausedError(HFEngineError):
    """A weight update was attempted while generation may be running."""


class EngineStepError(HFEngineError):
    """A prefill or decode step failed; the requests in it were failed with this error."""


class UnknownWeightError(HFEngineError, KeyError):
    """A weight name given to `update_weights` is not a parameter or buffer of the model."""


def checksum_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) of each tensor, in sorted name order.

    Trainer and engine compute it the same way to check that they hold identical weights; the
    dtype is part of the hash, so cast both sides to the same dtype first.
    """
    items: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in items:
            raise ValueError(f"checksum_named_tensors: tensor name {name!r} appears twice")
        items[name] = tensor
    digest = hashlib.sha256()
    for name in sorted(items):
        t = items[name].detach()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        raw = t.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        digest.update(raw.numpy().data)
    return digest.hexdigest()


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _grouped_decode_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """SDPA that decodes grouped-query heads without copying the KV cache.

    transformers' sdpa path repeats every key/value head ``num_key_value_groups`` times before
    calling SDPA whenever a mask is given, which is every decode step of this engine: per layer a
    copy of the whole cache, three times its size for SmolLM2. With one query token per row the
    query heads sharing a KV head can instead stand in the query-length dimension, so SDPA reads
    each cached key and value once. Prefill (several query tokens) takes the stock path.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or dropout:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows, heads, _, dim = query.shape
    packed = query.reshape(rows, heads // groups, groups, dim)  # head h reads KV head h // groups
    out = torch.nn.functional.scaled_dot_product_attention(
        packed, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(rows, heads, 1, dim).transpose(1, 2), None


_ATTENTION = "arl_grouped_decode"


def _register_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(_ATTENTION, _grouped_decode_attention)
    return _ATTENTION


def _compile_blocks(model: Any) -> int:
    """``torch.compile`` the forward of every RMSNorm and MLP block of ``model`` in place.

    Each distinct block is run once on a dummy input here, so a machine where compilation
    cannot work (no Triton, no compiler) falls back to eager blocks now, with a warning, rather
    than failing a generation step later. Returns how many blocks were compiled.
    """
    blocks = [
        m
        for m in model.modules()
        if type(m).__name__.endswith(("RMSNorm", "MLP")) and "forward" not in vars(m)
    ]
    if not blocks:
        return 0
    for m in blocks:
        m.forward = torch.compile(m.forward, dynamic=True)
    try:
        hidden = model.config.hidden_size
        param = next(model.parameters())
        probe = torch.zeros(2, 3, hidden, dtype=param.dtype, device=param.device)
        with torch.no_grad():
            for kind in {type(m) for m in blocks}:
                next(m for m in blocks if type(m) is kind)(probe)
    except Exception as exc:  # noqa: BLE001 - any compiler failure: keep the eager blocks
        logger.warning("torch.compile of the norm/MLP blocks failed (%r); running eagerly", exc)
        for m in blocks:
            del m.forward
        return 0
    return len(blocks)


def _cache_kwarg(fn: Any) -> str:
    """transformers 5.24 renamed ``past_key_values`` to ``cache``; pass whichever fn takes."""
    params = inspect.signature(fn).parameters
    return "cache" if "cache" in params else "past_key_values"


def _eos_ids(model: Any) -> frozenset[int]:
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class _SlotKVCache:
    """KV cache of fixed rows: row i of each layer's buffer holds request i at its own length.

    The model calls `update` once per layer. In prefill mode the new rows' keys/values are
    written at positions 0..L-1 and returned as they are (a new prompt attends only to itself);
    in decode mode each row's single new key/value is written at that row's position and the
    first ``kv_len`` positions of all active rows are returned for the masked attention.
    """

    def __init__(self, max_rows: int, max_seq: int) -> None:
        self._max_rows, self._max_seq = max_rows, max_seq
        self._rows_cap, self._seq_cap = 0, 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._prefill: tuple[int, int, int] | None = None
        self._decode: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self._kv_len = 0
        self.generation = 0  # bumped when buffers are reallocated (captured graphs go stale)

    def reserve(self, rows: int, seq: int) -> None:
        """Make room for ``rows`` rows of ``seq`` positions (buffers grow by doubling)."""
        if rows > self._rows_cap:
            self._rows_cap = min(self._max_rows, max(rows, 2 * self._rows_cap, _MIN_ROW_CAPACITY))
        if seq > self._seq_cap:
            self._seq_cap = min(self._max_seq, max(seq, 2 * self._seq_cap, _MIN_SEQ_CAPACITY))

    def begin_prefill(self, row0: int, rows: int, length: int) -> None:
        """The next forward writes ``rows`` new rows from ``row0``, ``length`` tokens each."""
        self._prefill, self._decode, self._kv_len = (row0, rows, length), None, length

    def begin_decode(self, row_idx: torch.Tensor, positions: torch.Tensor, kv_len: int) -> None:
        """The next forward decodes one token for rows 0..n-1, written at ``positions``."""
        self._decode = (len(row_idx), kv_len, row_idx, positions)
        self._prefill, self._kv_len = None, kv_len

    def _buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.keys.get(layer)
        if k is None or k.shape[0] < self._rows_cap or k.shape[2] < self._seq_cap:
            shape = (self._rows_cap, like.shape[1], self._seq_cap, like.shape[3])
            # zeros, not empty: masked positions are multiplied by 0 in attention, and a NaN
            # left in uninitialised memory would survive that.
            new_k = torch.zeros(shape, dtype=like.dtype, device=like.device)
            new_v = torch.zeros(shape, dtype=like.dtype, device=like.device)
            if k is not None:
                v = self.values[layer]
                new_k[: k.shape[0], :, : k.shape[2]] = k
                new_v[: v.shape[0], :, : v.shape[2]] = v
            self.keys[layer], self.values[layer] = new_k, new_v
            self.generation += 1
        return self.keys[layer], self.values[layer]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values for ``layer_idx`` and return what attention reads."""
        k, v = self._buffers(layer_idx, key_states)
        if self._prefill is not None:
            row0, rows, length = self._prefill
            k[row0 : row0 + rows, :, :length] = key_states
            v[row0 : row0 + rows, :, :length] = value_states
            return key_states, value_states
        if self._decode is None:
            raise HFEngineError("_SlotKVCache.update called outside a prefill or decode step")
        n, kv_len, row_idx, positions = self._decode
        k[row_idx, :, positions] = key_states[:, :, 0]
        v[row_idx, :, positions] = value_states[:, :, 0]
        return k[:n, :, :kv_len], v[:n, :, :kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Longest length attended to in this step (asked for when position ids are absent)."""
        return self._kv_len

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, kv_len: int) -> None:
        """Copy rows ``src`` into rows ``dst`` (first ``kv_len`` positions): compaction."""
        for layer, k in self.keys.items():
            v = self.values[layer]
            k[dst, :, :kv_len] = k[src, :, :kv_len]
            v[dst, :, :kv_len] = v[src, :, :kv_len]

    def free(self) -> None:
        """Drop the buffers (the engine is closing)."""
        self.keys.clear()
        self.values.clear()
        self._rows_cap = self._seq_cap = 0
        self.generation += 1


def _bucket(n: int, floor: int, cap: int) -> int:
    """The power of two >= max(n, floor), at most ``cap`` (n <= cap)."""
    return min(cap, max(floor, 1 << (n - 1).bit_length()))


@attrs.define
class _DecodeGraph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [rows, vocab], written by each replay


@attrs.define(eq=False)
class _Request:
    prompt: list[int]
    max_new: int
    stop: frozenset[int]
    temperature: float  # the T of the returned log-probs (1 for greedy with temperature 0)
    top_p: float
    top_k: int
    greedy: bool
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    out: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    versions: list[int] = attrs.field(factory=list)
    pos: int = 0  # tokens held in this request's cache row
    cancelled: bool = False

    def result(self, reason: FinishReason) -> GenerationResult:
        return GenerationResult(self.out, self.logprobs, self.versions, reason)


def _settle(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller gave up (cancelled) meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _deliver(req: _Request, result: Any = None, error: BaseException | None = None) -> None:
    try:
        req.loop.call_soon_threadsafe(_settle, req.future, result, error)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting for this answer
        pass


def _on_future_done(req: _Request, fut: asyncio.Future) -> None:
    if fut.cancelled():
        req.cancelled = True  # read by the decode thread, which drops the row


class HFEngine:
    """A transformers causal LM serving many concurrent `agenerate` calls by continuous batching.

    Implements `arl.engines.base.Engine`. One decode thread batches all active requests; weight
    updates (`update_weights`, `update_weights_from_disk`) are allowed only while paused.
    """

    def __init__(
        self,
        model_path: str,
        *,
        device: str = "cpu",
        dtype: str = "auto",
        max_batch_size: int = 64,
        seed: int = 1,
        max_seq_len: int = 2048,
        max_prefill_tokens: int = 8192,
        cuda_graphs: bool | None = None,
        prefill_interval: int | None = None,
        compile_blocks: bool | None = None,
        grouped_attention: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        if max_batch_size < 1 or max_seq_len < 2 or max_prefill_tokens < 1:
            raise ValueError(
                f"need max_batch_size >= 1, max_seq_len >= 2, max_prefill_tokens >= 1; got "
                f"{max_batch_size}, {max_seq_len}, {max_prefill_tokens}"
            )
        if prefill_interval is not None and prefill_interval < 1:
            raise ValueError(f"prefill_interval must be >= 1, got {prefill_interval}")
        if not Path(model_path).is_dir():
            raise FileNotFoundError(
                f"model_path {model_path!r} is not a directory; resolve hub ids first with "
                "arl.engines.model.resolve_model"
            )
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # The decode thread selects this device by index (threads start on device 0).
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = _resolve_dtype(dtype, self.device)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.max_prefill_tokens = max_prefill_tokens
        self.version = 0
        on_cuda = self.device.type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ValueError(f"cuda_graphs=True needs a CUDA device, got device={device!r}")
        self.cuda_graphs = on_cuda if cuda_graphs is None else cuda_graphs
        # An eager prefill costs about one eager decode step of host time: with graphs, admitting
        # newcomers on every step would make every step that slow.
        self.prefill_interval = prefill_interval or (16 if self.cuda_graphs else 1)

        model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=self.dtype,
            attn_implementation=_register_attention() if grouped_attention else "sdpa",
        )
        self._model = model.to(self.device).eval().requires_grad_(False)
        self._cache_kw = _cache_kwarg(self._model.forward)
        # torch.compile of the norms and MLPs fuses their elementwise kernels (a decode step of a
        # small model is ~1,250 tiny kernels, each a few microseconds even inside a CUDA graph).
        # The whole model compiles too, but in minutes; these blocks compile in seconds.
        want = self.cuda_graphs if compile_blocks is None else compile_blocks
        self.compiled_blocks = _compile_blocks(self._model) if want and on_cuda else 0
        self._eos = _eos_ids(self._model)
        self._vocab_size = int(self._model.get_input_embeddings().weight.shape[0])
        # Some models pad the output layer past the input vocabulary: sample over the logits.
        head = self._model.get_output_embeddings()
        self._n_logits = int(head.weight.shape[0]) if head is not None else self._vocab_size
        # Parameters and buffers by every name a state dict may use (tied aliases included).
        self._weights: dict[str, torch.Tensor] = dict(self._model.state_dict(keep_vars=True))

        self._cache = _SlotKVCache(max_batch_size, max_seq_len)
        dev, b = self.device, max_batch_size
        self._row_idx = torch.arange(b, device=dev)
        self._kv_arange = torch.arange(max_seq_len, device=dev)
        self._vocab_arange = torch.arange(self._n_logits, device=dev)
        # Per-row sampling state, compacted together with the cache rows.
        self._next_tok = torch.zeros(b, dtype=torch.long, device=dev)
        self._pos = torch.zeros(b, dtype=torch.long, device=dev)
        self._temp = torch.ones(b, dtype=torch.float32, device=dev)
        self._top_p = torch.ones(b, dtype=torch.float32, device=dev)
        self._top_k = torch.zeros(b, dtype=torch.long, device=dev)
        self._greedy = torch.zeros(b, dtype=torch.bool, device=dev)
        self._row_state = (
            self._next_tok,
            self._pos,
            self._temp,
            self._top_p,
            self._top_k,
            self._greedy,
        )
        self._gen = torch.Generator(device=dev)
        self._gen.manual_seed(seed)

        self._cv = threading.Condition()  # guards the fields below; held only briefly
        self._model_lock = threading.Lock()  # held by a forward step or a weight update
        self._pending: deque[_Request] = deque()
        self._rows: list[_Request] = []  # owned by the decode thread
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._paused = False
        self._parked = False
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._last_error: str | None = None
        self._steps = 0
        self._generated_tokens = 0
        self._busy_s = 0.0
        self._prefills = 0
        self._prefill_tokens = 0
        self._last_admit_step = 0
        self._graphs: dict[tuple[int, int], _DecodeGraph] = {}
        self._graphs_generation = -1
        self._graph_pool: Any = None

    # ----------------------------------------------------------------- public API

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        """Generate a continuation of ``input_ids``; stops early with ``"abort"`` on pause."""
        loop = asyncio.get_running_loop()
        req = self._make_request(list(input_ids), sampling, loop)
        if req.max_new == 0:
            return req.result("length")
        req.future.add_done_callback(functools.partial(_on_future_done, req))
        with self._cv:
            self._raise_if_unusable_locked()
            self._pending.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="arl-hf-decode", daemon=True)
                self._thread.start()
            self._cv.notify()
        return await req.future

    async def pause(self) -> None:
        """Interrupt in-flight requests at their next step (they return ``"abort"``) and hold
        new ones; returns once no forward pass is running, so weights may then be updated."""
        with self._cv:
            self._paused = True
            if self._thread is None or not self._thread.is_alive() or self._parked:
                return
            fut = asyncio.get_running_loop().create_future()
            self._pause_waiters.append((asyncio.get_running_loop(), fut))
            self._cv.notify()
        await fut

    async def resume(self) -> None:
        """Let held and resubmitted requests run again."""
        with self._cv:
            self._paused = False
            self._release_pause_waiters_locked()
            self._cv.notify()

    def set_version(self, version: int) -> None:
        """Stamp ``version`` on every token generated from now on."""
        self.version = int(version)

    async def health(self) -> dict:
        """Running/waiting counts, version, device, steps; raises if the engine is unusable."""
        with self._cv:
            self._raise_if_unusable_locked()
            return {
                "engine": "hf",
                "running": len(self._rows),
                "waiting": len(self._pending),
                "paused": self._paused,
                "version": self.version,
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "steps": self._steps,
                "cuda_graphs": self.cuda_graphs,
                "compiled_blocks": self.compiled_blocks,
                "generated_tokens": self._generated_tokens,
                "busy_s": self._busy_s,
                "prefills": self._prefills,
                "prefill_tokens": self._prefill_tokens,
                "last_error": self._last_error,
            }

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy tensors into the model's parameters/buffers in place; only while paused.

        Returns how many tensors were copied. Call it off the event loop for large models.
        """
        with self._cv:
            if self._closed:
                raise EngineClosedError("update_weights on a closed HFEngine")
            if not self._paused:
                raise EngineNotPausedError(
                    "update_weights needs a paused engine: `await engine.pause()` first, "
                    "then `await engine.resume()` after the update"
                )
            if self._thread is not None and self._thread.is_alive() and not self._parked:
                raise EngineNotPausedError(
                    "pause() has not completed yet: await it before updating weights"
                )
        count = 0
        with self._model_lock, torch.no_grad():
            # Same device and dtype (the weight sync's usual case): one multi-tensor copy, a few
            # kernels for the whole model instead of one per tensor. In place, so the captured
            # CUDA graphs keep reading the right memory.
            dsts, srcs = [], []
            for name, tensor in named_tensors:
                target = self._weights.get(name)
                if target is None:
                    raise UnknownWeightError(
                        f"{name!r} is not a parameter or buffer of the model "
                        f"(e.g. {next(iter(self._weights))!r}); check the name prefixes"
                    )
                if tensor.shape != target.shape:
                    raise ValueError(
                        f"weight {name!r}: shape {tuple(tensor.shape)} does not match the "
                        f"model's {tuple(target.shape)}"
                    )
                src = tensor.detach()
                if src.device == target.device and src.dtype == target.dtype:
                    dsts.append(target.data)
                    srcs.append(src)
                else:
                    target.data.copy_(src.to(device=target.device, dtype=target.dtype))
                count += 1
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        return count

    def update_weights_from_disk(self, path: str | Path) -> int:
        """Load every ``*.safetensors`` file of an HF folder (or one file) into the model."""
        return self.update_weights(_iter_safetensors(Path(path)))

    def weights_checksum(self) -> str:
        """`checksum_named_tensors` over the model's state dict (tied aliases included, as the
        trainer's full state dict has them)."""
        with self._model_lock:
            return checksum_named_tensors(self._model.state_dict().items())

    def close(self) -> None:
        """End the decode thread (after its current step) and fail requests still queued."""
        with self._cv:
            if self._closed:
                return
            self._closed = self._stopping = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        with self._cv:
            leftovers = list(self._pending) + self._rows
            self._pending.clear()
            self._rows = []
            self._release_pause_waiters_locked()
        for req in leftovers:
            _deliver(req, error=EngineClosedError("the HFEngine was closed during this request"))
        self._graphs.clear()
        self._graph_pool = None
        self._cache.free()

    @classmethod
    def from_spec(cls, spec: EngineSpec, **options: Any) -> HFEngine:
        """The engine of a rollout node's `EngineSpec` (loads the model: seconds; run it off
        the event loop); ``options`` are further constructor arguments."""
        return cls(spec.model_path, device=spec.device, dtype=spec.dtype, seed=spec.seed, **options)

    def __enter__(self) -> HFEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- requests

    def _make_request(
        self, prompt: list[int], sp: SamplingParams, loop: asyncio.AbstractEventLoop
    ) -> _Request:
        if not prompt:
            raise ValueError("input_ids is empty: the engine needs at least one prompt token")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens leaves no room under max_seq_len="
                f"{self.max_seq_len}; raise max_seq_len or shorten the prompt"
            )
        lo, hi = min(prompt), max(prompt)
        if lo < 0 or hi >= self._vocab_size:
            raise ValueError(f"token ids must lie in [0, {self._vocab_size}); got {lo}..{hi}")
        if sp.max_new_tokens < 0 or sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k < 0:
            raise ValueError(
                "invalid SamplingParams: need max_new_tokens >= 0, temperature >= 0, "
                f"0 < top_p <= 1, top_k >= 0; got {sp}"
            )
        greedy = sp.greedy or sp.temperature == 0
        return _Request(
            prompt=prompt,
            max_new=sp.max_new_tokens,
            stop=self._eos | frozenset(sp.stop_token_ids),
            temperature=sp.temperature if sp.temperature > 0 else 1.0,
            top_p=sp.top_p,
            top_k=sp.top_k,
            greedy=greedy,
            loop=loop,
            future=loop.create_future(),
        )

    def _raise_if_unusable_locked(self) -> None:
        if self._closed:
            raise EngineClosedError("the HFEngine is closed; create a new one")
        if self._failure is not None:
            raise HFEngineError(f"the decode thread died: {self._failure!r}") from self._failure

    def _release_pause_waiters_locked(self) -> None:
        for loop, fut in self._pause_waiters:
            try:
                loop.call_soon_threadsafe(_settle, fut, None, None)
            except RuntimeError:
                pass
        self._pause_waiters.clear()

    # ----------------------------------------------------------------- decode thread

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            with torch.no_grad():
                self._serve()
        except BaseException as exc:  # a bug, not a failed step: fail everyone, keep the reason
            logger.exception("hf engine decode thread died")
            with self._cv:
                self._failure = exc
                leftovers = list(self._pending) + self._rows
                self._pending.clear()
                self._rows = []
                self._release_pause_waiters_locked()
            for req in leftovers:
                _deliver(req, error=HFEngineError(f"the decode thread died: {exc!r}"))

    def _serve(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._has_work_locked():
                    if self._paused and not self._parked:
                        self._parked = True
                        self._release_pause_waiters_locked()
                    self._cv.wait()
                if self._stopping:
                    return
                self._parked = False
                paused = self._paused
                newcomers = [] if paused else self._take_pending_locked()
            if paused:
                self._abort_rows()
                continue
            self._drop_cancelled()
            t0 = time.perf_counter()
            try:
                with self._model_lock:
                    if newcomers:
                        self._admit(newcomers)
                    if self._rows:
                        self._decode_step()
            except Exception as exc:
                self._fail_step(exc, newcomers)
            # Each decode step ends in a device-to-host copy, so this is GPU time plus the
            # host work around it: the share of wall time the engine was working.
            self._busy_s += time.perf_counter() - t0

    def _has_work_locked(self) -> bool:
        if self._paused:
            return bool(self._rows)
        return bool(self._pending or self._rows)

    def _take_pending_locked(self) -> list[_Request]:
        # Between intervals, admit only a crowd at least as large as the running batch: then the
        # prefill's cost is shared by as many requests as a decode step serves.
        waited = self._steps - self._last_admit_step
        if self._rows and waited < self.prefill_interval and len(self._pending) < len(self._rows):
            return []
        room = self.max_batch_size - len(self._rows)
        taken: list[_Request] = []
        while self._pending and len(taken) < room:
            req = self._pending.popleft()
            if not req.cancelled:
                taken.append(req)
        return taken

    def _abort_rows(self) -> None:
        rows, self._rows = self._rows, []
        for req in rows:
            _deliver(req, req.result("abort"))

    def _drop_cancelled(self) -> None:
        dead = [i for i, req in enumerate(self._rows) if req.cancelled]
        if dead:
            self._remove_rows(dead)

    def _fail_step(self, exc: Exception, newcomers: list[_Request]) -> None:
        logger.exception("hf engine step failed; failing the requests in it")
        self._last_error = repr(exc)
        failed = {id(r): r for r in self._rows + newcomers}
        self._rows = []  # the cache rows may be half-written: start from an empty batch
        err = EngineStepError(f"generation step failed: {exc!r}")
        err.__cause__ = exc
        for req in failed.values():
            _deliver(req, error=err)

    def _admit(self, newcomers: list[_Request]) -> None:
        """Prefill newcomers into rows after the active ones, in chunks of bounded tokens."""
        self._last_admit_step = self._steps
        chunk: list[_Request] = []
        longest = 0
        for req in newcomers:
            length = len(req.prompt) - 1
            if chunk and (len(chunk) + 1) * max(longest, length) > self.max_prefill_tokens:
                self._prefill(chunk)
                chunk, longest = [], 0
            chunk.append(req)
            longest = max(longest, length)
        if chunk:
            self._prefill(chunk)

    def _prefill(self, chunk: list[_Request]) -> None:
        # Prompts of one token need no prefill; put the others first so they form one block.
        chunk = sorted(chunk, key=lambda r: len(r.prompt) == 1)
        row0, dev = len(self._rows), self.device
        lengths = [len(r.prompt) - 1 for r in chunk]
        with_prefix = sum(1 for n in lengths if n > 0)
        self._prefills += 1
        self._prefill_tokens += sum(lengths)
        self._cache.reserve(row0 + len(chunk), max(lengths) + 1)
        if with_prefix:
            width = max(lengths)
            ids = torch.zeros((with_prefix, width), dtype=torch.long)
            for i, req in enumerate(chunk[:with_prefix]):
                ids[i, : lengths[i]] = torch.tensor(req.prompt[:-1])
            lens = torch.tensor(lengths[:with_prefix], device=dev)
            cols = self._kv_arange[:width]
            # Row r, query i may see key j when j <= i (causal) and j < len_r (not padding);
            # padded queries still see key 0, so no row of the mask is empty.
            allowed = (cols[None, None, :] <= cols[None, :, None]) & (
                cols[None, None, :] < lens[:, None, None]
            )
            mask = self._additive_mask(allowed)[:, None]
            self._cache.begin_prefill(row0, with_prefix, width)
            self._model(
                input_ids=ids.to(dev),
                attention_mask=mask,
                position_ids=cols[None, :].expand(with_prefix, width),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: self._cache},
            )
        sl = slice(row0, row0 + len(chunk))
        self._next_tok[sl] = torch.tensor([r.prompt[-1] for r in chunk], device=dev)
        self._pos[sl] = torch.tensor(lengths, device=dev)
        self._temp[sl] = torch.tensor([r.temperature for r in chunk], device=dev)
        # top_p >= 1 keeps every token: 2.0 guards against the cumulative sum rounding above 1.
        self._top_p[sl] = torch.tensor([r.top_p if r.top_p < 1 else 2.0 for r in chunk], device=dev)
        top_k = [r.top_k if 0 < r.top_k < self._n_logits else self._n_logits for r in chunk]
        self._top_k[sl] = torch.tensor(top_k, device=dev)
        self._greedy[sl] = torch.tensor([r.greedy for r in chunk], device=dev)
        for req, length in zip(chunk, lengths, strict=True):
            req.pos = length
        self._rows.extend(chunk)

    def _additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        # An additive float mask works with both the sdpa and the eager attention paths.
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return zero.masked_fill(~allowed, torch.finfo(self.dtype).min)

    def _decode_step(self) -> None:
        rows = self._rows
        n = len(rows)
        kv_len = max(r.pos for r in rows) + 1
        if self.cuda_graphs:
            logits = self._graph_logits(n, kv_len)
        else:
            self._cache.reserve(n, kv_len)
            logits = self._forward_decode(n, kv_len)
        tokens, logprobs = self._sample(logits, rows)
        self._next_tok[:n] = tokens
        self._pos[:n] += 1
        # One device-to-host transfer per step: the ids are exact in float64.
        host = torch.stack([tokens.double(), logprobs.double()]).cpu().tolist()
        version = self.version
        finished: list[tuple[int, FinishReason]] = []
        for i, (req, tok, lp) in enumerate(zip(rows, host[0], host[1], strict=True)):
            tok = int(tok)
            req.out.append(tok)
            req.logprobs.append(lp)
            req.versions.append(version)
            req.pos += 1
            if tok in req.stop:
                finished.append((i, "stop"))
            elif len(req.out) >= req.max_new or req.pos + 1 >= self.max_seq_len:
                finished.append((i, "length"))
        self._steps += 1
        self._generated_tokens += n
        if finished:
            done = [(rows[i], reason) for i, reason in finished]
            # Free the rows before answering, so a caller never sees its request still running.
            self._remove_rows([i for i, _ in finished])
            for req, reason in done:
                _deliver(req, req.result(reason))

    def _forward_decode(self, rows: int, kv_len: int) -> torch.Tensor:
        """One token for each of rows 0..rows-1, attending to ``kv_len`` positions: logits."""
        pos = self._pos[:rows]
        allowed = self._kv_arange[None, :kv_len] <= pos[:, None]
        self._cache.begin_decode(self._row_idx[:rows], pos, kv_len)
        out = self._model(
            input_ids=self._next_tok[:rows, None],
            attention_mask=self._additive_mask(allowed)[:, None, None, :],
            position_ids=pos[:, None],
            use_cache=True,
            **{self._cache_kw: self._cache},
        )
        return out.logits[:, -1, :]

    def _graph_logits(self, n: int, kv_len: int) -> torch.Tensor:
        """Replay (capturing on first use) the graph of the bucket holding ``n`` rows."""
        rows = _bucket(n, 1, self.max_batch_size)
        width = _bucket(kv_len, 64, self.max_seq_len)
        self._cache.reserve(rows, width)
        if rows > n:
            # Padding rows compute garbage into free cache rows; keep their writes in bounds.
            self._pos[n:rows] = 0
        graph = self._graphs.get((rows, width))
        if graph is None or self._graphs_generation != self._cache.generation:
            try:
                graph = self._capture(rows, width)
            except Exception as exc:
                # A model whose forward cannot be captured still works, only slower.
                logger.exception("CUDA graph capture failed; decoding eagerly from now on")
                self._last_error = f"CUDA graph capture failed: {exc!r}"
                self.cuda_graphs = False
                self._graphs.clear()
                self._graph_pool = None
                torch.cuda.synchronize(self.device)
                return self._forward_decode(n, kv_len)
        graph.graph.replay()
        return graph.logits[:n]

    def _capture(self, rows: int, width: int) -> _DecodeGraph:
        # Warm-up runs eagerly: it grows the cache if needed (which makes older graphs stale)
        # and writes exactly the keys/values this step's replay writes again.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward_decode(rows, width)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._graphs_generation != self._cache.generation:
            # Destroying the graphs releases their memory pool; its handle cannot be reused.
            self._graphs.clear()
            self._graph_pool = None
            self._graphs_generation = self._cache.generation
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            logits = self._forward_decode(rows, width)
        self._graphs[(rows, width)] = captured = _DecodeGraph(graph, logits)
        logger.debug("captured a decode graph for %d rows x %d positions", rows, width)
        return captured

    def _sample(self, logits: torch.Tensor, rows: list[_Request]) -> tuple[torch.Tensor, ...]:
        """Sample one token per row; return it and its log-prob under log_softmax(logits / T)."""
        n = len(rows)
        logp = torch.log_softmax(logits.float() / self._temp[:n, None], dim=-1)
        greedy_tok = logp.argmax(dim=-1)
        if all(r.greedy for r in rows):
            tokens = greedy_tok
        else:
            # Gumbel-max: argmax(logp + Gumbel noise) samples from softmax(logp).
            gumbel = -torch.empty_like(logp).exponential_(generator=self._gen).log_()
            if any(r.top_p < 1 or 0 < r.top_k < self._n_logits for r in rows):
                sorted_lp, order = logp.sort(dim=-1, descending=True)
                probs = sorted_lp.exp()
                keep = self._vocab_arange[None, :] < self._top_k[:n, None]
                # Keep the smallest prefix whose mass reaches top_p (the first token always).
                keep &= (probs.cumsum(dim=-1) - probs) < self._top_p[:n, None]
                choice = (sorted_lp.masked_fill(~keep, float("-inf")) + gumbel).argmax(dim=-1)
                sampled = order.gather(1, choice[:, None])[:, 0]
            else:
                sampled = (logp + gumbel).argmax(dim=-1)
            tokens = torch.where(self._greedy[:n], greedy_tok, sampled)
        return tokens, logp.gather(1, tokens[:, None])[:, 0]

    def _remove_rows(self, dead: list[int]) -> None:
        """Drop rows ``dead`` and move the last live rows into the holes, keeping 0..n-1 dense."""
        rows = self._rows
        dead_set = set(dead)
        keep = len(rows) - len(dead_set)
        holes = [i for i in sorted(dead_set) if i < keep]
        movers = [i for i in range(keep, len(rows)) if i not in dead_set]
        if holes:
            dst = torch.tensor(holes, device=self.device)
            src = torch.tensor(movers, device=self.device)
            self._cache.move_rows(dst, src, max(rows[i].pos for i in movers) + 1)
            for state in self._row_state:
                state[dst] = state[src]
            for h, m in zip(holes, movers, strict=True):
                rows[h] = rows[m]
        del rows[keep:]


def _iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files under {str(path)!r}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
