"""`HFEngine`: the hf engine's public API and its decode (scheduler) thread; see the package
docstring for the design."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from arl.compile_cache import use_compile_cache
from arl.engines.base import (
    FinishReason,
    GenerationResult,
    SamplingParams,
    WeightCheck,
    WeightTarget,
)
from arl.engines.hf.attention import cache_kwarg, compile_norm_and_mlp, register_attention
from arl.engines.hf.errors import (
    EngineAsleepError,
    EngineClosedError,
    EngineNotPausedError,
    EngineStepError,
    HFEngineError,
    UnknownWeightError,
)
from arl.engines.hf.flex import (
    DECODE_ATTENTIONS,
    KV_BLOCK,
    SplitAttend,
    compiled_flex_function,
    flex_decode,
    register_flex_attention,
    warm_up_width,
)
from arl.engines.hf.fused import FusedDecoder, unsupported_reason
from arl.engines.hf.graphs import (
    DecodeGraphs,
    PrefillGraphs,
    row_bucket,
    warm_up_shapes,
    warm_up_widths,
    width_bucket,
)
from arl.engines.hf.kv_cache import SlotKVCache
from arl.engines.hf.request import Request, deliver, settle
from arl.engines.hf.sampling import sample_rows
from arl.engines.hf.split_decode import available as split_decode_available
from arl.engines.hf.steps import Launched, StepOutputs, upload
from arl.engines.hf.weights import checksum_named_tensors, is_adapter_folder, iter_weights_folder
from arl.engines.lora import add_lora, is_lora_name, lora_enabled, lora_tensors
from arl.engines.spec import TRAITS
from arl.precompile import kept_counts, kept_note
from arl.transformers_imports import prepare_transformers_import

if TYPE_CHECKING:
    from arl.engines.spec import EngineSpec

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Padding a prefill chunk may carry before the chunk is split (see `HFEngine._admit`): fewer
# wasted tokens cost less than another prefill's launches.
_PAD_TOKENS = 1024
# The decode thread drops the GIL at each blocking call of a step (a graph replay, the step's
# device-to-host copy) and then has to win it back from the process's other threads (reward
# functions, the event loop). Under CPython's default 5 ms switch interval a busy neighbour
# keeps it up to that long each time: a 3 ms step can take 15. Measured on CPU: a step of three
# 0.2 ms blocking calls beside a busy thread took 16.2 ms at 5 ms, 1.9 ms at 0.25 ms.
SWITCH_INTERVAL_S = 0.00025


def _resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def _eos_ids(model: Any) -> frozenset[int]:
    gen_cfg = getattr(model, "generation_config", None)
    eos = getattr(gen_cfg, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)


class HFEngine:
    """A transformers causal LM serving many concurrent `agenerate` calls by continuous batching.

    Implements `arl.engines.base.Engine`. One decode thread batches all active requests; weight
    updates (`update_weights`, `update_weights_from_disk`) are allowed only while paused.
    """

    name: ClassVar[str] = "hf"
    # Declared in `arl.engines.spec.TRAITS`, which the launcher reads without importing this.
    weight_targets: ClassVar[frozenset[WeightTarget]] = TRAITS["hf"].weight_targets
    pause_in_place: ClassVar[bool] = TRAITS["hf"].pause_in_place
    can_sleep: ClassVar[bool] = TRAITS["hf"].can_sleep
    serves_lora: ClassVar[bool] = TRAITS["hf"].serves_lora
    weight_check: ClassVar[WeightCheck] = TRAITS["hf"].weight_check
    version: int

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
        warm_up_len: int = 0,
        decode_attention: str = "auto",
        lora: dict | None = None,
        fused_decode: bool | None = None,
        overlap: bool | None = None,
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 2 or max_prefill_tokens < 1:
            raise ValueError(
                f"need max_batch_size >= 1, max_seq_len >= 2, max_prefill_tokens >= 1; got "
                f"{max_batch_size}, {max_seq_len}, {max_prefill_tokens}"
            )
        if decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(
                "decode_attention must be 'sdpa' (the additive mask over the batch's longest row),"
                " 'flex' (each row's own length; compiled on CUDA), 'triton' (each row's own"
                " length, one Triton kernel; CUDA only) or 'auto' (triton on CUDA, sdpa"
                f" elsewhere), got {decode_attention!r}"
            )
        if warm_up_len < 0:
            raise ValueError(f"warm_up_len must be >= 0, got {warm_up_len}")
        if prefill_interval is not None and prefill_interval < 1:
            raise ValueError(f"prefill_interval must be >= 1, got {prefill_interval}")
        if not Path(model_path).is_dir():
            raise FileNotFoundError(
                f"model_path {model_path!r} is not a directory; resolve hub ids first with "
                "arl.engines.model.resolve_model"
            )
        use_compile_cache()  # before the blocks and the decode attention compile
        t_start = time.perf_counter()
        prepare_transformers_import()  # before transformers' first import
        from transformers import AutoModelForCausalLM

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
        # Launch each decode step before reading the previous one back (steps.py); on by
        # default where the device runs asynchronously to the host (CUDA).
        self.overlap = on_cuda if overlap is None else overlap

        # Flex is compiled on CUDA unless compile_blocks=False, and on CPU with compile_blocks=True
        # (its C++ kernel skips blocks too); else it runs torch's unfused reference. The Triton
        # kernel (split_decode.py) needs CUDA and compiles once, not per row bucket. ``auto``
        # takes it where flex would be compiled on CUDA (flex where Triton is off): uncompiled
        # flex and CPU flex are slower than SDPA.
        flex_compiled = on_cuda if compile_blocks is None else compile_blocks
        if decode_attention == "triton" and not split_decode_available(self.device):
            raise ValueError(
                f"decode_attention='triton' needs a CUDA device with Triton (device={device!r}"
                f"{', ARL_SPLIT_DECODE=0' if on_cuda else ''}); use 'auto', 'flex' or 'sdpa'"
            )
        if decode_attention == "auto":
            if on_cuda and flex_compiled:
                decode_attention = "triton" if split_decode_available(self.device) else "flex"
            else:
                decode_attention = "sdpa"
        length_aware = decode_attention in ("flex", "triton")
        if length_aware:  # prefill still takes SDPA through it
            attention = register_flex_attention()
        else:
            attention = register_attention() if grouped_attention else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=self.dtype, attn_implementation=attention
        )
        # LoRA (``lora``: ``actor.lora`` as a dict): the trainer's adapters, injected before the
        # blocks are compiled and graphs captured, so both see the peft layers; a sync then
        # copies the adapter's tensors in place like any other weight.
        self.lora = dict(lora) if lora_enabled(lora) else None
        if self.lora is not None:
            model = add_lora(model, self.lora)
        self._model = model.to(self.device).eval().requires_grad_(False)
        # Start-up phases (seconds), for `health` and the log line that ends the constructor.
        self.load_s = time.perf_counter() - t_start  # transformers' import included
        t_compile = time.perf_counter()
        self._cache_kw = cache_kwarg(self._model.forward)
        # torch.compile of the norms and MLPs fuses their elementwise kernels (a decode step of a
        # small model is ~1,250 tiny kernels, each a few microseconds even inside a CUDA graph).
        # The whole model compiles too, but in minutes; these blocks compile in seconds.
        want = self.cuda_graphs if compile_blocks is None else compile_blocks
        self.compiled_blocks = compile_norm_and_mlp(self._model) if want and on_cuda else 0
        # (mask, attend) of the length-aware attentions; None where flex failed to compile
        # (warned): the engine decodes with SDPA.
        self._flex = None
        if length_aware:
            # The probe compiles the shape the warm-up's first graph runs (the smallest row
            # bucket at the whole width), which that graph then reuses, rather than a shape no
            # step runs.
            width = KV_BLOCK
            if warm_up_len and self.cuda_graphs:
                width = warm_up_width(max_batch_size, max_seq_len, warm_up_len)
            self._flex = flex_decode(
                self._model, self.device, max_batch_size, flex_compiled, width, decode_attention
            )
        self.decode_attention = "sdpa"
        if self._flex is not None:
            self.decode_attention = "triton" if isinstance(self._flex[1], SplitAttend) else "flex"
        # Decode steps through fused per-layer functions (fused.py) where the model's family
        # allows; ``fused_decode=None`` takes them where it does, False keeps the model's modules.
        self._fused: FusedDecoder | None = None
        self._fused_ok = False  # a fused step has run: later failures are real errors
        if fused_decode is not False:
            reason = unsupported_reason(self._model)
            if reason is None:
                self._fused = FusedDecoder(self._model, compiled=bool(want and on_cuda))
            elif fused_decode:
                raise ValueError(f"fused_decode=True, but {reason}")
            else:
                logger.info("hf engine decodes through the model's modules: %s", reason)
        self.compile_s = time.perf_counter() - t_compile
        self._eos = _eos_ids(self._model)
        self._vocab_size = int(self._model.get_input_embeddings().weight.shape[0])
        # Some models pad the output layer past the input vocabulary: sample over the logits.
        head = self._model.get_output_embeddings()
        self._n_logits = int(head.weight.shape[0]) if head is not None else self._vocab_size
        # Parameters and buffers by every name a state dict may use (tied aliases included).
        self._weights: dict[str, torch.Tensor] = dict(self._model.state_dict(keep_vars=True))

        align = 1 if self._flex is None else KV_BLOCK
        # The fused families share one KV shape across layers: one buffer for all of them.
        layers = len(self._fused.layers) if self._fused is not None else None
        self._cache = SlotKVCache(max_batch_size, max_seq_len, align, layers)
        dev, b = self.device, max_batch_size
        self._row_idx = torch.arange(b, device=dev)
        self._kv_arange = torch.arange(max_seq_len, device=dev)
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
        self._outputs = StepOutputs(dev, b)
        self._inflight: Launched | None = None  # with overlap: the step not yet read back

        self._cv = threading.Condition()  # guards the fields below; held only briefly
        self._model_lock = threading.Lock()  # held by a forward step or a weight update
        self._pending: deque[Request] = deque()
        self._rows: list[Request] = []  # owned by the decode thread
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._paused = False
        self._in_place = False  # while paused: keep the running rows instead of aborting them
        self._parked = False
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None
        self._failure_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._last_error: str | None = None
        self._steps = 0
        self._generated_tokens = 0
        self._busy_s = 0.0
        self._prefill_s = 0.0  # of busy_s: admitting newcomers (their prefill)
        self._sync_s = 0.0  # of busy_s: each decode step's wait for its tokens on the host
        self._prefills = 0
        self._prefill_tokens = 0
        self._last_admit_step = 0
        self._graphs = DecodeGraphs(self.device)
        # Prefills replayed from CUDA graphs: with the compiled fused functions, as decode.
        self._prefill_graphs: PrefillGraphs | None = None
        if self.cuda_graphs and self._fused is not None and self._fused.compiled:
            self._prefill_graphs = PrefillGraphs.for_model(
                self.device, self._model.config, self.dtype, max_prefill_tokens
            )
        self._warm_up_len = min(warm_up_len, max_seq_len)
        self._asleep = False
        self._dropped: list[tuple[torch.nn.Parameter, torch.Size]] = []  # weights a sleep freed
        self._sleep_freed_bytes = 0
        self.warm_up_s = 0.0
        if warm_up_len and self.cuda_graphs:
            self._warm_up(min(warm_up_len, max_seq_len))
        # One line that `python -m arl.bench startup` reads back from the run's log.
        logger.info(
            "hf engine ready in %.1f s (load %.1f s, compile %.1f s, graphs %.1f s)%s",
            time.perf_counter() - t_start,
            self.load_s,
            self.compile_s,
            self.warm_up_s,
            kept_note(self.kept_functions()),
        )

    def kept_functions(self) -> tuple[int, int]:
        """Compiled functions of this engine kept under ``ARL_CACHE`` (`arl.precompile`): how
        many were loaded from it and how many compiled into it, in this process so far."""
        fns = [compiled_flex_function() if self._flex is not None else None]
        fns += list(self._fused.functions) if self._fused is not None else []
        return kept_counts(fns)

    # ----------------------------------------------------------------- public API

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        """Generate a continuation of ``input_ids``; stops early with ``"abort"`` on a pause
        that does not keep it in place."""
        loop = asyncio.get_running_loop()
        req = self._make_request(list(input_ids), sampling, loop)
        if req.max_new == 0:
            return req.result("length")
        req.future.add_done_callback(functools.partial(self._on_request_done, req))
        with self._cv:
            self._raise_if_unusable_locked()
            self._pending.append(req)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="arl-hf-decode", daemon=True)
                self._thread.start()
            self._cv.notify()
        return await req.future

    async def pause(self, in_place: bool = False) -> None:
        """Stop in-flight requests at their next step and hold new ones: they return
        ``"abort"``, or with ``in_place`` keep their rows and KV cache and continue on `resume`;
        returns once no forward pass is running, so weights may then be updated."""
        with self._cv:
            self._paused, self._in_place = True, in_place
            alive = self._thread is not None and self._thread.is_alive()
            # Parked with rows kept in place, an abort-mode pause still has rows to abort.
            if not alive or (self._parked and not self._has_work_locked()):
                return
            fut = asyncio.get_running_loop().create_future()
            self._pause_waiters.append((asyncio.get_running_loop(), fut))
            self._cv.notify()
        await fut

    async def resume(self) -> None:
        """Let held, kept (in place) and resubmitted requests run again."""
        with self._cv:
            if self._asleep:
                raise EngineAsleepError(
                    "resume() on a sleeping hf engine: `await engine.wake()` first (and, after "
                    "a sleep that dropped the weights, load new ones)"
                )
            self._paused = self._in_place = False
            self._release_pause_waiters_locked()
            self._cv.notify()

    def set_version(self, version: int) -> None:
        """Stamp ``version`` on every token generated from now on."""
        self.version = int(version)

    async def health(self) -> dict:
        """Running/waiting counts, pause mode and rows held by it, version, device, steps,
        prefills; raises if the engine is unusable."""
        with self._cv:
            self._raise_if_unusable_locked()
            mode = ("in_place" if self._in_place else "abort") if self._paused else None
            prefill = self._prefill_graphs
            return {
                "engine": self.name,
                "running": len(self._rows),
                "waiting": len(self._pending),
                "paused": self._paused,
                "pause_mode": mode,
                "held": len(self._rows) if self._in_place else 0,
                "version": self.version,
                "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."),
                "steps": self._steps,
                "cuda_graphs": self.cuda_graphs,
                "compiled_blocks": self.compiled_blocks,
                "fused_decode": self._fused is not None,
                "decode_attention": self.decode_attention,
                "decode_graphs": len(self._graphs),
                "prefill_graphs": len(prefill) if prefill is not None else 0,
                "prefill_replays": prefill.replays if prefill is not None else 0,
                "load_s": self.load_s,
                "compile_s": self.compile_s,
                "warm_up_s": self.warm_up_s,
                "generated_tokens": self._generated_tokens,
                "busy_s": self._busy_s,
                "prefill_s": self._prefill_s,
                "sync_s": self._sync_s,
                "prefills": self._prefills,
                "prefill_tokens": self._prefill_tokens,
                "last_error": self._last_error,
                "lora_rank": int(self.lora["rank"]) if self.lora else 0,
                "asleep": self._asleep,
                "sleep_freed_bytes": self._sleep_freed_bytes,
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
            if self._asleep and self._dropped:
                raise EngineAsleepError(
                    "update_weights on an engine asleep without its weights: `await "
                    "engine.wake()` first (it reallocates them)"
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

    async def update_weights_from_disk(self, path: str) -> None:
        """Load every ``*.safetensors`` file of an HF folder (or one file), or a peft adapter
        folder (``adapter_config.json``: an engine built with ``lora``), into the model
        (paused; the reading and copying run off the event loop)."""
        folder = Path(path)
        if is_adapter_folder(folder) and self.lora is None:
            raise UnknownWeightError(
                f"{path!r} is a peft adapter folder, but this hf engine serves no adapter; "
                "build it with the engine option lora (actor.lora.rank > 0)"
            )
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: self.update_weights(iter_weights_folder(folder)))

    @property
    def weights_device(self) -> torch.device:
        """The device `update_weights` copies onto: the model's."""
        return self.device

    async def weights_checksum(self) -> str:
        """`checksum_named_tensors` over the model's state dict (tied aliases included, as the
        trainer's full state dict has them), or with LoRA over the adapter's tensors only (what
        the trainer syncs and checksums); computed off the event loop."""

        def checksum() -> str:
            with self._model_lock:
                if self._dropped:
                    raise EngineAsleepError(
                        "weights_checksum on an engine asleep without its weights: wake it and "
                        "sync weights first"
                    )
                if self.lora is not None:
                    return checksum_named_tensors(lora_tensors(self._model))
                return checksum_named_tensors(self._model.state_dict().items())

        return await asyncio.get_running_loop().run_in_executor(None, checksum)

    async def score(self, token_ids: list[int]) -> list[float]:
        """Log-probs (temperature 1) of ``token_ids[1:]``, each given the tokens before it, from
        one causal forward between decode steps (off the event loop)."""
        ids = [int(t) for t in token_ids]
        if len(ids) < 2:
            raise ValueError(f"score needs at least two token ids, got {len(ids)}")

        def forward() -> list[float]:
            tokens = torch.tensor([ids], device=self.device)
            with self._model_lock, torch.no_grad():
                logits = self._model(input_ids=tokens, use_cache=False).logits[0, :-1]
            logp = torch.log_softmax(logits.float(), dim=-1)
            return logp.gather(1, tokens[0, 1:, None])[:, 0].cpu().tolist()

        with self._cv:
            self._raise_if_unusable_locked()
            if self._asleep:
                raise EngineAsleepError("score() on a sleeping hf engine: `await engine.wake()`")
        return await asyncio.get_running_loop().run_in_executor(None, forward)

    async def sleep(self, drop_weights: bool = False) -> int:
        """Free the GPU for a train phase: pause in abort mode (running requests return
        ``"abort"``; new ones wait until `wake` and `resume`), drop the decode graphs and the
        KV cache, and with ``drop_weights`` the storage of every weight a sync rewrites (all
        parameters; with LoRA the adapter's only, the base stays). Returns the bytes freed
        (measured on CUDA), which `health` reports; `wake` undoes it."""
        await self.pause(in_place=False)
        with self._cv:
            self._raise_if_unusable_locked()
            if self._asleep:
                return self._sleep_freed_bytes

        def free() -> int:
            with self._model_lock, torch.no_grad():
                on_cuda = self.device.type == "cuda"
                if on_cuda:
                    torch.cuda.synchronize(self.device)
                    before = torch.cuda.memory_allocated(self.device)
                host = sum(
                    t.nbytes for t in (*self._cache.keys.values(), *self._cache.values.values())
                )
                self._clear_graphs()
                self._cache.free()
                if drop_weights:
                    if self._fused is not None:
                        self._fused.release()  # its buffers hold the q/k/v and gate/up storage
                    for name, p in self._model.named_parameters():
                        if self.lora is None or is_lora_name(name):
                            self._dropped.append((p, p.shape))
                            host += p.nbytes
                            # The same Parameter object stays (compiled blocks and `_weights`
                            # hold it); only its storage goes, until `wake`.
                            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
                if not on_cuda:
                    return host
                torch.cuda.synchronize(self.device)
                freed = before - torch.cuda.memory_allocated(self.device)
                torch.cuda.empty_cache()
                return freed

        freed = await asyncio.get_running_loop().run_in_executor(None, free)
        with self._cv:
            self._asleep, self._sleep_freed_bytes = True, freed
        return freed

    async def wake(self) -> None:
        """Undo `sleep`: reallocate dropped weights (uninitialised: load new ones before
        `resume`) and size the KV cache for the warm-up length again; decode graphs are
        re-captured on first use. The engine stays paused until `resume`."""
        with self._cv:
            self._raise_if_unusable_locked()
            if not self._asleep:
                return

        def allocate() -> None:
            with self._model_lock:
                for p, shape in self._dropped:
                    p.data = torch.empty(shape, dtype=p.dtype, device=p.device)
                self._dropped.clear()
                if self._fused is not None and not self._fused.bound:
                    self._fused.bind()
                if self._warm_up_len and self.cuda_graphs:
                    # The size the warm-up gave it: grown on demand, every graph goes stale.
                    self._cache.reserve(self.max_batch_size, self._warm_up_len)

        await asyncio.get_running_loop().run_in_executor(None, allocate)
        with self._cv:
            self._asleep = False

    async def start(self) -> None:
        """Nothing to start: the model loaded in the constructor and the decode thread starts
        with the first request. Raises if the engine is closed or its thread died."""
        with self._cv:
            self._raise_if_unusable_locked()

    async def wait_failed(self) -> BaseException:
        """Wait until the decode thread dies of a bug and return why (a failed step fails only
        its requests; never returns after `close`)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._failure is not None:
                return self._failure
            self._failure_waiters.append((loop, fut))
        return await fut

    async def aclose(self) -> None:
        """`close` off the event loop (it waits for the current decode step)."""
        await asyncio.get_running_loop().run_in_executor(None, self.close)

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
            deliver(req, error=EngineClosedError("the HFEngine was closed during this request"))
        self._clear_graphs()
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
    ) -> Request:
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
        return Request(
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

    def _on_request_done(self, req: Request, fut: asyncio.Future) -> None:
        if fut.cancelled():
            req.cancelled = True  # read by the decode thread, which drops the row
            with self._cv:
                self._cv.notify()  # a thread parked with rows kept in place drops it now

    def _raise_if_unusable_locked(self) -> None:
        if self._closed:
            raise EngineClosedError("the HFEngine is closed; create a new one")
        if self._failure is not None:
            raise HFEngineError(f"the decode thread died: {self._failure!r}") from self._failure

    def _release_pause_waiters_locked(self) -> None:
        for loop, fut in self._pause_waiters:
            try:
                loop.call_soon_threadsafe(settle, fut, None, None)
            except RuntimeError:
                pass
        self._pause_waiters.clear()

    # ----------------------------------------------------------------- decode thread

    def _warm_up(self, length: int) -> None:
        """Capture the decode graph of every row bucket for every KV width up to ``length``
        (the blocks compile on the way), as a server does before it serves: the first
        generations then replay graphs instead of capturing them, and the cache holds its
        size from the start instead of growing (which makes every captured graph stale)."""
        t0 = time.perf_counter()
        if self._flex is None:
            widths = warm_up_widths(length, self.max_seq_len)
            self._cache.reserve(self.max_batch_size, widths[-1])
        else:  # one width: see _decode_shape
            self._cache.reserve(self.max_batch_size, length)
            widths = [self._cache.seq_capacity]
        with self._model_lock, torch.no_grad(), torch.cuda.device(self.device):
            try:
                for rows, width in warm_up_shapes(self.max_batch_size, widths):
                    # Free rows: the garbage these passes write is overwritten by a prefill.
                    self._pos[:rows] = 0
                    self._graphs.get(rows, width, self._cache, self._forward_decode)
                torch.cuda.synchronize(self.device)
            except torch.cuda.OutOfMemoryError as exc:
                # The full-size cache does not fit next to what else holds this GPU now: start
                # small and grow on demand, as without a warm-up.
                logger.warning("hf engine warm-up ran out of memory (%s); capturing lazily", exc)
                self._last_error = f"warm-up ran out of memory: {exc}"
                self._clear_graphs()
                self._cache.free()
                torch.cuda.empty_cache()
            except Exception as exc:
                # A model whose forward cannot be captured still works, only slower.
                logger.exception("CUDA graph capture failed in warm-up; decoding eagerly")
                self._last_error = f"CUDA graph capture failed: {exc!r}"
                self.cuda_graphs = False
                self._clear_graphs()
                self._cache.free()
        self.warm_up_s = time.perf_counter() - t0
        if not self._graphs:
            return  # fell back above, and said so
        logger.info(
            "hf engine: %d decode graphs (rows up to %d, KV widths up to %d) in %.1f s",
            len(self._graphs),
            self.max_batch_size,
            widths[-1],
            self.warm_up_s,
        )

    def _run(self) -> None:
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            logger.info(
                "hf engine: Python's thread switch interval %.2f ms -> %.2f ms, so the decode "
                "thread gets the GIL back promptly after each step's blocking calls",
                1e3 * sys.getswitchinterval(),
                1e3 * SWITCH_INTERVAL_S,
            )
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        try:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            with torch.no_grad():
                self._serve()
        except BaseException as exc:  # a bug, not a failed step: fail everyone, keep the reason
            logger.exception("hf engine decode thread died")
            with self._cv:
                self._failure = exc
                for loop, fut in self._failure_waiters:
                    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                        loop.call_soon_threadsafe(settle, fut, exc, None)
                self._failure_waiters.clear()
                leftovers = list(self._pending) + self._rows
                self._pending.clear()
                self._rows = []
                self._release_pause_waiters_locked()
            for req in leftovers:
                deliver(req, error=HFEngineError(f"the decode thread died: {exc!r}"))

    def _serve(self) -> None:
        while True:
            with self._cv:
                # A step in flight is read back before the thread waits, parks, aborts or
                # stops: a paused engine has no forward running and every token delivered.
                drain = self._inflight is not None and (
                    self._stopping or self._paused or not self._has_work_locked()
                )
                while not drain and not self._stopping and not self._has_work_locked():
                    if self._paused:
                        # Parked, no forward runs: rows kept in place are freed here when their
                        # callers cancel, without unparking (a weight update may be running).
                        # Outside the lock: the event loop takes it (health, agenerate) and
                        # must not wait for the row copies behind a weight update on the device.
                        if any(req.cancelled for req in self._rows):
                            self._cv.release()
                            try:
                                self._drop_cancelled()
                            finally:
                                self._cv.acquire()
                            continue  # the state may have moved meanwhile: look again
                        if not self._parked:
                            self._parked = True
                            self._release_pause_waiters_locked()
                    self._cv.wait()
                if not drain:
                    if self._stopping:
                        return
                    self._parked = False
                    paused = self._paused
                    newcomers = [] if paused else self._take_pending_locked()
            if drain:
                t0 = time.perf_counter()
                try:
                    with self._model_lock:
                        self._finish_step(self._take_inflight())
                except Exception as exc:
                    self._fail_step(exc, [])
                self._busy_s += time.perf_counter() - t0
                continue
            if paused:
                self._abort_rows()
                continue
            self._drop_cancelled()
            t0 = time.perf_counter()
            try:
                with self._model_lock:
                    if newcomers:
                        self._admit(newcomers)
                        self._prefill_s += time.perf_counter() - t0
                    if self._rows:
                        self._decode_step()
            except Exception as exc:
                self._fail_step(exc, newcomers)
            # Each decode step ends in a device-to-host copy, so this is GPU time plus the
            # host work around it: the share of wall time the engine was working.
            self._busy_s += time.perf_counter() - t0

    def _has_work_locked(self) -> bool:
        if self._paused:
            return bool(self._rows) and not self._in_place  # rows to abort
        return bool(self._pending or self._rows)

    def _take_pending_locked(self) -> list[Request]:
        # Between intervals, admit only a crowd at least as large as the running batch: then the
        # prefill's cost is shared by as many requests as a decode step serves.
        waited = self._steps - self._last_admit_step
        if self._rows and waited < self.prefill_interval and len(self._pending) < len(self._rows):
            return []
        room = self.max_batch_size - len(self._rows)
        taken: list[Request] = []
        while self._pending and len(taken) < room:
            req = self._pending.popleft()
            if not req.cancelled:
                taken.append(req)
        return taken

    def _abort_rows(self) -> None:
        rows, self._rows = self._rows, []
        for req in rows:
            deliver(req, req.result("abort"))

    def _drop_cancelled(self) -> None:
        dead = [i for i, req in enumerate(self._rows) if req.cancelled]
        if dead:
            self._remove_rows(dead)

    def _fail_step(self, exc: Exception, newcomers: list[Request]) -> None:
        logger.exception("hf engine step failed; failing the requests in it")
        self._last_error = repr(exc)
        inflight = self._take_inflight()
        stepping = [r for r in inflight.rows if not r.done] if inflight is not None else []
        failed = {id(r): r for r in self._rows + newcomers + stepping}
        self._rows = []  # the cache rows may be half-written: start from an empty batch
        err = EngineStepError(f"generation step failed: {exc!r}")
        err.__cause__ = exc
        for req in failed.values():
            deliver(req, error=err)

    def _admit(self, newcomers: list[Request]) -> None:
        """Prefill newcomers into rows after the active ones, shortest prompts first, in chunks
        of bounded tokens. A chunk pads its prompts to its longest, so a chunk also ends where
        its padding would pass a fifth of what it computes (and `_PAD_TOKENS`): prompts of 64
        to 1,044 tokens in one chunk were half padding."""
        self._last_admit_step = self._steps
        chunk: list[Request] = []
        seen: set[tuple[int, ...]] = set()  # prompts the chunk prefills; repeats cost nothing
        longest = real = 0
        for req in sorted(newcomers, key=lambda r: len(r.prompt)):
            key = tuple(req.prompt[:-1])
            if key in seen or not key:
                chunk.append(req)
                continue
            length = len(key)
            padded = (len(seen) + 1) * max(longest, length)
            waste = padded - real - length
            too_padded = waste > _PAD_TOKENS and waste > padded // 5
            if seen and (padded > self.max_prefill_tokens or too_padded):
                self._prefill(chunk)
                chunk, seen, longest, real = [], set(), 0, 0
            chunk.append(req)
            seen.add(key)
            longest = max(longest, length)
            real += length
        if chunk:
            self._prefill(chunk)

    def _prefill(self, chunk: list[Request]) -> None:
        # Rows in three blocks: prompts prefilled here, prompts equal to one of those (a GRPO
        # group's samples share their prompt), whose cache rows are copies, then prompts of
        # one token, which need no prefill.
        first: dict[tuple[int, ...], int] = {}
        unique, copies, single = [], [], []
        for req in chunk:
            key = tuple(req.prompt[:-1])
            if not key:
                single.append(req)
            elif key in first:
                copies.append((req, first[key]))
            else:
                first[key] = len(unique)
                unique.append(req)
        chunk = unique + [req for req, _ in copies] + single
        row0, dev = len(self._rows), self.device
        lengths = [len(r.prompt) - 1 for r in chunk]
        with_prefix = len(unique)
        self._prefills += 1
        self._prefill_tokens += sum(lengths[:with_prefix])
        self._cache.reserve(row0 + len(chunk), max(lengths) + 1)
        if with_prefix:
            width = max(lengths)
            ids = torch.zeros((with_prefix, width), dtype=torch.long)
            for i, req in enumerate(chunk[:with_prefix]):
                ids[i, : lengths[i]] = torch.tensor(req.prompt[:-1])
            ids = upload(ids, torch.long, dev)
        if with_prefix and not (self._fused is not None and self._fused_prefill(row0, ids)):
            lens = upload(lengths[:with_prefix], torch.long, dev)
            cols = self._kv_arange[:width]
            # Row r, query i may see key j when j <= i (causal) and j < len_r (not padding);
            # padded queries still see key 0, so no row of the mask is empty.
            allowed = (cols[None, None, :] <= cols[None, :, None]) & (
                cols[None, None, :] < lens[:, None, None]
            )
            mask = self._additive_mask(allowed)[:, None]
            self._cache.begin_prefill(row0, with_prefix, width)
            self._model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=cols[None, :].expand(with_prefix, width),
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: self._cache},
            )
        if copies:
            dst = torch.arange(len(copies), device=dev) + row0 + with_prefix
            src = upload([row0 + i for _, i in copies], torch.long, dev)
            self._cache.move_rows(dst, src, max(len(r.prompt) - 1 for r, _ in copies))
        sl = slice(row0, row0 + len(chunk))
        self._next_tok[sl] = upload([r.prompt[-1] for r in chunk], torch.long, dev)
        self._pos[sl] = upload(lengths, torch.long, dev)
        self._temp[sl] = upload([r.temperature for r in chunk], torch.float32, dev)
        # top_p >= 1 keeps every token: 2.0 guards against the cumulative sum rounding above 1.
        top_p = [r.top_p if r.top_p < 1 else 2.0 for r in chunk]
        self._top_p[sl] = upload(top_p, torch.float32, dev)
        top_k = [r.top_k if 0 < r.top_k < self._n_logits else self._n_logits for r in chunk]
        self._top_k[sl] = upload(top_k, torch.long, dev)
        self._greedy[sl] = upload([r.greedy for r in chunk], torch.bool, dev)
        for req, length in zip(chunk, lengths, strict=True):
            req.pos = length
        self._rows.extend(chunk)

    def _graph_prefill(self, ids: torch.Tensor, row0: int) -> bool:
        """`_fused_prefill` through a CUDA graph of its shape's bucket; False where none fits
        the cache (the caller prefills eagerly). A capture that fails turns them off."""
        graphs = self._prefill_graphs
        assert graphs is not None and self._fused is not None
        fused, kv_of = self._fused, self._layer_kv
        try:
            return graphs.run(ids, row0, self._cache, lambda i, at: fused.prefill(i, at, kv_of))
        except Exception as exc:  # noqa: BLE001 - an eager prefill still works
            logger.warning("prefill graph capture failed (%s); prefilling eagerly", exc)
            self._last_error = f"prefill graph capture failed: {exc!r}"
            self._prefill_graphs = None
            graphs.clear()
            torch.cuda.synchronize(self.device)
            return False

    def _fused_prefill(self, row0: int, ids: torch.Tensor) -> bool:
        """Prefill ``ids`` [rows, width] into the cache rows from ``row0`` through the fused
        functions; False where they cannot run here (as `_forward_decode` falls back)."""
        fused = self._fused
        assert fused is not None
        if ids.numel() == 1:
            # A one-token prefill runs as two (the pad's key and value land where the row's
            # first decode step writes): compiled code specialises a size of 1.
            ids = torch.nn.functional.pad(ids, (0, 1))
        try:
            replayable = self._prefill_graphs is not None and self._fused_ok
            if not (replayable and self._graph_prefill(ids, row0)):
                rows_at = torch.arange(row0, row0 + ids.shape[0], device=ids.device)
                fused.prefill(ids, rows_at, self._layer_kv)
        except Exception as exc:
            if self._fused_ok:
                raise
            # The first fused call compiles: a machine where that fails runs the modules.
            logger.warning("fused prefill failed (%r); running the modules", exc)
            self._last_error = f"fused prefill failed: {exc!r}"
            self._fused = None
            return False
        self._fused_ok = True
        return True

    def _additive_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        # An additive float mask works with both the sdpa and the eager attention paths.
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return zero.masked_fill(~allowed, torch.finfo(self.dtype).min)

    def _decode_step(self) -> None:
        """Launch a step for the running rows; read back the step before it (with overlap) or
        this one (without)."""
        launched = self._launch_step()
        if self.overlap:
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                self._finish_step(previous)
        else:
            self._finish_step(launched)

    def _take_inflight(self) -> Launched | None:
        inflight, self._inflight = self._inflight, None
        return inflight

    def _launch_step(self) -> Launched:
        rows = list(self._rows)  # this step's rows in their order now; compaction moves them
        n = len(rows)
        kv_len = max(r.pos for r in rows) + 1
        if self.cuda_graphs:
            logits = self._graph_logits(n, kv_len)
        elif self._flex is not None:
            logits = self._forward_decode(*self._decode_shape(n, kv_len))[:n]
        else:
            self._cache.reserve(n, kv_len)
            logits = self._forward_decode(n, kv_len)
        tokens, logprobs = self._sample(logits, rows)
        self._next_tok[:n] = tokens
        self._pos[:n] += 1
        for req in rows:
            req.pos += 1
        return self._outputs.launch(rows, tokens, logprobs, self.version)

    def _finish_step(self, step: Launched | None) -> None:
        """Append a launched step's tokens to its requests; answer and free the finished."""
        if step is None:
            return
        host, waited = self._outputs.wait(step)
        self._sync_s += waited
        finished: list[tuple[Request, FinishReason]] = []
        generated = 0
        for req, tok, lp in zip(step.rows, host[0], host[1], strict=True):
            if req.done or req.cancelled:  # answered or dropped after this step was launched
                continue
            tok = int(tok)
            req.out.append(tok)
            req.logprobs.append(lp)
            req.versions.append(step.version)
            generated += 1
            if tok in req.stop:
                finished.append((req, "stop"))
            elif len(req.out) >= req.max_new or len(req.prompt) + len(req.out) >= self.max_seq_len:
                finished.append((req, "length"))
        self._steps += 1
        self._generated_tokens += generated
        if finished:
            where = {id(req): i for i, req in enumerate(self._rows)}
            for req, _ in finished:
                req.done = True
            # Free the rows before answering, so a caller never sees its request still running.
            self._remove_rows([where[id(req)] for req, _ in finished])
            for req, reason in finished:
                deliver(req, req.result(reason))

    def _forward_decode(self, rows: int, kv_len: int) -> torch.Tensor:
        """One token for each of rows 0..rows-1, attending to ``kv_len`` positions: logits."""
        if self._fused is not None:
            try:
                return self._fused_decode(rows, kv_len)
            except Exception as exc:
                if self._fused_ok:
                    raise
                # The first fused step compiles: a machine where that fails decodes on
                # through the model's modules (same arithmetic, more kernels).
                logger.warning("fused decode failed (%r); decoding through the modules", exc)
                self._last_error = f"fused decode failed: {exc!r}"
                self._fused = None
        pos = self._pos[:rows]
        self._cache.begin_decode(self._row_idx[:rows], pos, kv_len)
        if self._flex is None:
            allowed = self._kv_arange[None, :kv_len] <= pos[:, None]
            attend = {"attention_mask": self._additive_mask(allowed)[:, None, None, :]}
        else:
            mask, flex_attend = self._flex
            mask.update(pos)  # inside the step, so a graph replay updates it too
            attend = {"attention_mask": mask.block_mask(rows, kv_len), "flex_attend": flex_attend}
        out = self._model(
            input_ids=self._next_tok[:rows, None],
            position_ids=pos[:, None],
            use_cache=True,
            **attend,
            **{self._cache_kw: self._cache},
        )
        return out.logits[:, -1, :]

    def _layer_kv(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s keys and values in the cache, one block the fused step writes."""
        fused = self._fused
        assert fused is not None
        return self._cache.layer_kv(layer, fused.kv_heads, fused.dim, self.dtype, self.device)

    def _fused_decode(self, rows: int, width: int) -> torch.Tensor:
        """`_forward_decode` through the fused functions: the same logits in fewer kernels."""
        fused, cache = self._fused, self._cache
        assert fused is not None
        pos, idx = self._pos[:rows], self._row_idx[:rows]
        scale = fused.scale

        if self._flex is None:
            allowed = self._kv_arange[None, :width] <= pos[:, None]
            additive = self._additive_mask(allowed)[:, None, None, :]

            def attend(q: torch.Tensor, layer: int, rows: int, width: int) -> torch.Tensor:
                k, v = cache.keys[layer][:rows, :, :width], cache.values[layer][:rows, :, :width]
                return torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=additive, scale=scale
                )

        else:
            mask, flex_attend = self._flex
            mask.update(pos)  # inside the step, so a graph replay updates it too
            block_mask = mask.block_mask(rows, width)

            def attend(q: torch.Tensor, layer: int, rows: int, width: int) -> torch.Tensor:
                k, v = cache.keys[layer][:rows, :, :width], cache.values[layer][:rows, :, :width]
                return flex_attend(q, k, v, block_mask, scale)

        # Detached: views of the engine's buffers would make the compiled function guard on those
        # buffers' sizes, which prefill's own position tensors do not have.
        tokens, pos, idx = self._next_tok[:rows], pos.detach(), idx.detach()
        logits = fused.forward(tokens, pos, idx, self._layer_kv, attend, rows, width)
        self._fused_ok = True
        return logits

    def _decode_shape(self, n: int, kv_len: int) -> tuple[int, int]:
        """(rows, KV width) a step of ``n`` rows, the longest attending to ``kv_len``, runs at."""
        rows = row_bucket(n, self.max_batch_size)
        if self._flex is None:
            width = width_bucket(kv_len, self.max_seq_len)
            self._cache.reserve(rows, width)
        else:
            # Flex and the Triton kernel skip the positions past each row's length, so a wider
            # step costs (almost) nothing: steps run at the cache's whole width, one graph per
            # row bucket instead of one per (rows, width), and a longer row captures nothing
            # until the cache grows. Compiled flex also needs a fixed batch size, hence the
            # buckets off graphs.
            self._cache.reserve(rows, kv_len)
            width = self._cache.seq_capacity
        if rows > n:
            # Padding rows compute garbage into free cache rows; keep their writes in bounds.
            self._pos[n:rows] = 0
        return rows, width

    def _clear_graphs(self) -> None:
        """Drop every captured decode and prefill graph (and their memory pools)."""
        self._graphs.clear()
        if self._prefill_graphs is not None:
            self._prefill_graphs.clear()

    def _graph_logits(self, n: int, kv_len: int) -> torch.Tensor:
        """Replay (capturing on first use) the graph of the bucket holding ``n`` rows."""
        rows, width = self._decode_shape(n, kv_len)
        try:
            graph = self._graphs.get(rows, width, self._cache, self._forward_decode)
        except Exception as exc:
            # A model whose forward cannot be captured still works, only slower.
            logger.exception("CUDA graph capture failed; decoding eagerly from now on")
            self._last_error = f"CUDA graph capture failed: {exc!r}"
            self.cuda_graphs = False
            self._clear_graphs()
            torch.cuda.synchronize(self.device)
            return self._forward_decode(rows, width)[:n]
        graph.graph.replay()
        return graph.logits[:n]

    def _sample(self, logits: torch.Tensor, rows: list[Request]) -> tuple[torch.Tensor, ...]:
        """Sample one token per row; return it and its log-prob under log_softmax(logits / T)."""
        n = len(rows)
        return sample_rows(
            logits,
            self._temp[:n],
            self._greedy[:n],
            self._top_p[:n],
            self._top_k[:n],
            self._gen,
            all_greedy=all(r.greedy for r in rows),
            truncate=any(r.top_p < 1 or 0 < r.top_k < self._n_logits for r in rows),
        )

    def _remove_rows(self, dead: list[int]) -> None:
        """Drop rows ``dead`` and move the last live rows into the holes, keeping 0..n-1 dense."""
        rows = self._rows
        dead_set = set(dead)
        keep = len(rows) - len(dead_set)
        holes = [i for i in sorted(dead_set) if i < keep]
        movers = [i for i in range(keep, len(rows)) if i not in dead_set]
        if holes:
            dst = upload(holes, torch.long, self.device)
            src = upload(movers, torch.long, self.device)
            self._cache.move_rows(dst, src, max(rows[i].pos for i in movers) + 1)
            for state in self._row_state:
                state[dst] = state[src]
            for h, m in zip(holes, movers, strict=True):
                rows[h] = rows[m]
        del rows[keep:]
