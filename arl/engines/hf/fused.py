"""The hf engine's decode step in fewer kernels, for the Llama family (Llama, Mistral, Qwen2,
Qwen3: pre-norm decoder layers, RMSNorm, rotary positions, grouped-query attention, SwiGLU MLP).

Through transformers' modules a decode step of SmolLM2-135M launches ~800 kernels (per layer:
three projections, ten for the rotary embedding, two cache writes, attention, the norm and MLP
blocks and two residual adds), each a few microseconds even inside a CUDA graph, so at small and
medium batches the step costs ~2 ms whatever it reads (profiled on an H200: 825 kernels and
2.3 ms for one row whose floor is 0.07 ms). `FusedDecoder` runs the same arithmetic as three
functions per layer that ``torch.compile`` fuses (on CUDA):

- ``attn_in``: the previous layer's residual add, RMSNorm, one projection for q, k and v
  together, the Qwen3 q/k norms, the rotary embedding and the write of the new keys and values
  into the layer's KV cache (one store inside the kernel that computes them, in place: the
  layer's cache is a contiguous ``[2, rows, kv_heads, positions, dim]`` buffer);
- the attention, which stays the engine's (triton, flex or SDPA);
- ``attn_out``: the output projection, the residual add, RMSNorm, one projection for the MLP's
  gate and up halves, SiLU-and-multiply, and the down projection (its residual add is the next
  layer's, or the final norm's).

About nine kernels a layer. Compiled on CUDA, `attn_in` stops at the projection
(``attn_proj``) and one Triton kernel (`arl.engines.hf.kernels.rope_store`) does the norms, the
rotary embedding and the cache write, which inductor's code took three kernels for. The
functions are compiled once with the batch dimension dynamic, for every layer and every batch
bucket (layers differ only in the tensors passed in), and kept under ``ARL_CACHE``
(`arl.precompile`: the model's constants are in the key), so that a later run loads them
instead of tracing them again. Prefill (`FusedDecoder.prefill`) runs the same compiled
functions over every prompt token at once, with causal SDPA between them: through the modules
it cost ~50 ms of host time for 16 prompts whose GPU work is ~1 ms.

One projection for q, k and v (and one for gate and up) needs their weights in one matrix: at
`bind` each layer's q/k/v weights are copied into one buffer and the model's Parameters become
views of it, so the model's modules (which `score` still runs), weight syncs (in-place copies
into the Parameters) and checksums see the same memory. A sleep that drops weights calls
`release` first, and wake `bind`s again.

Off CUDA (or with ``compile_blocks=False``) the functions run eagerly: the same arithmetic in the
same order as transformers' modules, which the CPU tests compare token for token.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.experimental._config as fx_config
import torch.nn.functional as F

from arl.engines.hf import kernels
from arl.precompile import first_line, precompiled

logger = logging.getLogger(__name__)

FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")

# attend(q [n, kv_heads, group, dim], layer, rows, width) -> [n, kv_heads, group, dim]
Attend = Callable[[torch.Tensor, int, int, int], torch.Tensor]
# kv_of(layer) -> the layer's KV cache [2 (keys, values), rows, kv_heads, positions, dim]
KVOf = Callable[[int], torch.Tensor]


def unsupported_reason(model: Any) -> str | None:
    """Why `FusedDecoder` cannot run ``model`` (None: it can)."""
    cfg = model.config
    if cfg.model_type not in FAMILIES:
        return f"model_type {cfg.model_type!r} is not one of {sorted(FAMILIES)}"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None or getattr(model, "lm_head", None) is None:
        return "no model.layers / lm_head"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        if cfg.model_type == "mistral":
            return "sliding-window attention"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the fused MLP is SwiGLU)"
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        linears += (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "projections are not plain Linear layers (LoRA adapters?)"
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n).__name__ not in _NORMS for n in norms):
            return "norms are not the family's RMSNorm"
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
            return "output projections with a bias"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' RMSNorm, op for op: float32 statistics, cast back, then the weight.
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _no_duck_sizing(fn: Callable) -> Callable:
    """``fn`` run without "duck sizing" while the fused functions it calls run (and compile).
    Duck sizing gives sizes equal at the first compilation one symbol, so that a batch of 2 rows
    of a model with 2 KV heads would compile code valid only while rows == KV heads, and every
    other batch would compile again. Off, each size is its own symbol and one compilation serves
    every batch (a torch without the setting keeps duck sizing: the same results, compiled a
    few more times)."""
    if not hasattr(fx_config, "use_duck_shape"):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with fx_config.patch(use_duck_shape=False):
            return fn(*args, **kwargs)

    return run


class FusedDecoder:
    """The decode forward of a Llama-family model as fused per-layer functions; see the module
    docstring. ``compiled``: run them through ``torch.compile`` (CUDA)."""

    def __init__(self, model: Any, compiled: bool) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"fused decode cannot run this model: {reason}")
        cfg = model.config
        self.model = model
        self.layers = list(model.model.layers)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.group = self.heads // self.kv_heads
        self.eps = float(cfg.rms_norm_eps)
        scaling = getattr(self.layers[0].self_attn, "scaling", None)
        self.scale = float(scaling) if scaling is not None else self.dim**-0.5
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self._gate_up: list[torch.Tensor] = []
        self.compiled = compiled
        attn_in, attn_proj, attn_out, head = self._functions()
        if compiled:  # kept under ARL_CACHE (arl.precompile): a later run loads, not traces
            attn_in = precompiled(attn_in, name="hf.fused.attn_in", dynamic=True)
            attn_proj = precompiled(attn_proj, name="hf.fused.attn_proj", dynamic=True)
            attn_out = precompiled(attn_out, name="hf.fused.attn_out", dynamic=True)
            head = precompiled(head, name="hf.fused.head", dynamic=True)
        self._attn_in, self._attn_proj = attn_in, attn_proj
        self._attn_out, self._head = attn_out, head
        # Compiled on CUDA, `attn_proj` and the Triton kernel `kernels.rope_store` stand in for
        # `attn_in` (one kernel for what inductor made three); the first call that fails
        # falls back to `attn_in` for good.
        device = next(model.parameters()).device
        self.rope_kernel = compiled and kernels.available(device)
        self._rope_ok = False
        first = attn_proj if self.rope_kernel else attn_in
        self.functions = (first, attn_out, head)
        self.bind()

    # ------------------------------------------------------------------ weights
    def bind(self) -> None:
        """Put each layer's q/k/v weights (and biases) into one buffer, and gate/up into
        another, and make the model's Parameters views of them (one layer at a time, so the
        peak is one layer's weights more)."""
        self._qkv, self._gate_up = [], []
        with torch.no_grad():
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                w = _fuse([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                b = _fuse(biases) if all(x is not None for x in biases) else None
                self._qkv.append((w, b))
                self._gate_up.append(_fuse([m.gate_proj.weight, m.up_proj.weight]))

    def release(self) -> None:
        """Drop the fused buffers' references (before a sleep frees the Parameters' storage)."""
        self._qkv, self._gate_up = [], []

    @property
    def bound(self) -> bool:
        return bool(self._qkv)

    # ------------------------------------------------------------------ forward
    def _functions(self) -> tuple[Callable, Callable, Callable]:
        heads, kv_heads, dim, group, eps = self.heads, self.kv_heads, self.dim, self.group, self.eps
        q_size, kv_size = heads * dim, kv_heads * dim

        def attn_in(
            x: torch.Tensor,
            delta: torch.Tensor,
            norm_w: torch.Tensor,
            qkv_w: torch.Tensor,
            qkv_b: torch.Tensor | None,
            q_norm_w: torch.Tensor | None,
            k_norm_w: torch.Tensor | None,
            cos: torch.Tensor,
            sin: torch.Tensor,
            kv: torch.Tensor,
            kv_rows: torch.Tensor,
            kv_pos: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            x = x + delta
            qkv = F.linear(_rms(x, norm_w, eps), qkv_w, qkv_b)
            n = x.shape[0]
            q = qkv[:, :q_size].view(n, heads, dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, kv_heads, dim)
            v = qkv[:, q_size + kv_size :].view(n, kv_heads, dim)
            if q_norm_w is not None and k_norm_w is not None:
                q, k = _rms(q, q_norm_w, eps), _rms(k, k_norm_w, eps)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            # Token j's key and value to cache row kv_rows[j], position kv_pos[j]. Compiled, this
            # is a store of the kernel computing them (the cache is mutated in place).
            kv[:, kv_rows, :, kv_pos] = torch.stack((k, v), dim=1)
            return x, q.reshape(n, kv_heads, group, dim)

        def attn_proj(
            x: torch.Tensor,
            delta: torch.Tensor,
            norm_w: torch.Tensor,
            qkv_w: torch.Tensor,
            qkv_b: torch.Tensor | None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            # `attn_in` up to the projection; `kernels.rope_store` does the rest
            x = x + delta
            return x, F.linear(_rms(x, norm_w, eps), qkv_w, qkv_b)

        def attn_out(
            x: torch.Tensor,
            attn: torch.Tensor,
            o_w: torch.Tensor,
            norm_w: torch.Tensor,
            gate_up_w: torch.Tensor,
            down_w: torch.Tensor,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            n = x.shape[0]
            x = x + F.linear(attn.reshape(n, q_size), o_w)
            gate_up = F.linear(_rms(x, norm_w, eps), gate_up_w)
            half = gate_up.shape[-1] // 2
            mlp = F.linear(F.silu(gate_up[:, :half]) * gate_up[:, half:], down_w)
            return x, mlp

        def head(
            x: torch.Tensor, delta: torch.Tensor, norm_w: torch.Tensor, head_w: torch.Tensor
        ) -> torch.Tensor:
            return F.linear(_rms(x + delta, norm_w, eps), head_w)

        return attn_in, attn_proj, attn_out, head

    def _layer_in(
        self,
        i: int,
        x: torch.Tensor,
        delta: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: torch.Tensor,
        kv_rows: torch.Tensor,
        kv_pos: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s `attn_in` on its weights: the residual stream and q; the keys and
        values go into ``kv`` (the layer's cache) at rows ``kv_rows``, positions ``kv_pos``."""
        a = self.layers[i].self_attn
        qkv_w, qkv_b = self._qkv[i]
        q_norm = getattr(a, "q_norm", None)
        k_norm = getattr(a, "k_norm", None)
        if self.rope_kernel:
            try:
                out, qkv = self._attn_proj(
                    x, delta, self.layers[i].input_layernorm.weight, qkv_w, qkv_b
                )
                q = kernels.rope_store(
                    qkv,
                    cos,
                    sin,
                    None if q_norm is None else q_norm.weight,
                    None if k_norm is None else k_norm.weight,
                    self.eps,
                    kv,
                    kv_rows,
                    kv_pos,
                    self.heads,
                    self.kv_heads,
                    self.dim,
                )
                self._rope_ok = True
                return out, q.view(q.shape[0], self.kv_heads, self.group, self.dim)
            except Exception as exc:
                if self._rope_ok:
                    raise
                # The first call compiles (inductor and Triton): a machine where either
                # fails keeps the compiled torch code of `attn_in`.
                logger.warning("fused rope/KV kernel failed (%s); using attn_in", first_line(exc))
                self.rope_kernel = False
                self.functions = (self._attn_in, *self.functions[1:])
        return self._attn_in(
            x,
            delta,
            self.layers[i].input_layernorm.weight,
            qkv_w,
            qkv_b,
            None if q_norm is None else q_norm.weight,
            None if k_norm is None else k_norm.weight,
            cos,
            sin,
            kv,
            kv_rows,
            kv_pos,
        )

    def _layer_out(
        self, i: int, x: torch.Tensor, attn: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i``'s `attn_out` on its weights: the residual stream and the MLP's output."""
        layer = self.layers[i]
        return self._attn_out(
            x,
            attn,
            layer.self_attn.o_proj.weight,
            layer.post_attention_layernorm.weight,
            self._gate_up[i],
            layer.mlp.down_proj.weight,
        )

    @_no_duck_sizing
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache_rows: torch.Tensor,
        kv_of: KVOf,
        attend: Attend,
        rows: int,
        width: int,
    ) -> torch.Tensor:
        """Logits [n, vocab] of one decode token per row: ``tokens`` [n] at ``positions`` [n],
        whose keys and values go to KV-cache rows ``cache_rows`` [n] of each layer's
        ``kv_of(layer)``; ``attend(q, layer, rows, width)`` attends to the cache."""
        if not self.bound:
            raise RuntimeError("FusedDecoder.forward after release(): bind() it first")
        inner = self.model.model
        x = inner.embed_tokens(tokens)
        # [n, 1, dim]: one position per row, broadcast over the heads
        cos, sin = inner.rotary_emb(x[:, None, :], position_ids=positions[:, None])
        delta = _no_delta(x)
        for i in range(len(self.layers)):
            x, q = self._layer_in(i, x, delta, cos, sin, kv_of(i), cache_rows, positions)
            x, delta = self._layer_out(i, x, attend(q, i, rows, width))
        return self._head(x, delta, inner.norm.weight, self.model.lm_head.weight)

    @_no_duck_sizing
    def prefill(self, ids: torch.Tensor, rows_at: torch.Tensor, kv_of: KVOf) -> None:
        """Every layer's keys and values of ``ids`` [rows, width] (prompts right-padded, each
        at positions 0..width-1) through the same fused functions as decode, into KV-cache rows
        ``rows_at`` [rows] (a device tensor, so that a CUDA graph of a prefill serves any
        rows) of each layer's ``kv_of(layer)``. No logits: the engine feeds each prompt's last
        token as the first decode step's input, so the last layer stops after its keys and
        values.

        Causal attention alone is each row's mask: padding comes after a row's tokens, so no
        real query reaches it (the padded queries' outputs, and the keys and values they write
        past the row's length, are never read: decode overwrites or masks them).
        """
        if not self.bound:
            raise RuntimeError("FusedDecoder.prefill after release(): bind() it first")
        rows, width = ids.shape
        heads, kv_heads, dim, group = self.heads, self.kv_heads, self.dim, self.group
        inner = self.model.model
        x = inner.embed_tokens(ids.reshape(-1))  # [rows * width, hidden]: one token per row
        positions = torch.arange(width, device=ids.device).repeat(rows)
        # An index, not repeat_interleave, whose result is a view: compiled code guards on an
        # input's base
        cache_rows = rows_at[torch.arange(rows * width, device=ids.device) // width]
        cos, sin = inner.rotary_emb(x[:, None, :], position_ids=positions[:, None])
        delta = _no_delta(x)
        last = len(self.layers) - 1
        for i in range(len(self.layers)):
            kv = kv_of(i)
            x, q = self._layer_in(i, x, delta, cos, sin, kv, cache_rows, positions)
            if i == last:
                return
            # [rows, kv_heads, width, dim] each: what this layer just cached
            k, v = kv[:, rows_at, :, :width].unbind(0)
            # [rows, heads, width, dim]; query head h reads KV head h // group
            q = q.reshape(rows, width, heads, dim).transpose(1, 2)
            if group > 1:
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
            # Shaped as decode's attention output, and a tensor of its own (no view base that
            # the compiled function would guard on), so prefill reuses decode's compilation.
            out = out.transpose(1, 2).reshape(rows * width, kv_heads, group, dim).clone()
            x, delta = self._layer_out(i, x, out)


def _no_delta(x: torch.Tensor) -> torch.Tensor:
    """The first layer's residual delta: zeros, so that every layer calls `attn_in` with a
    tensor (a ``None`` there would be one more compilation of it, seconds at start-up)."""
    return torch.zeros_like(x)


def _fuse(params: list[torch.Tensor]) -> torch.Tensor:
    """One buffer holding ``params`` stacked on dim 0; each Parameter becomes a view of it."""
    base = params[0]
    fused = torch.empty(
        (sum(p.shape[0] for p in params), *base.shape[1:]), dtype=base.dtype, device=base.device
    )
    row = 0
    for p in params:
        n = p.shape[0]
        fused[row : row + n].copy_(p.data)
        p.data = fused[row : row + n]
        row += n
    return fused
