"""Log-probs and entropy of a causal LM's tokens, as the training rank computes them.

`forward_logp` runs the model on right-padded rows, or packs them into one row (``packed``)
where the varlen attention registered by `register_varlen` runs them without a mask (CUDA,
`varlen_available`); `resolve_layout` picks between the two. `ChunkedLogpHead` turns the output
layer into log-prob and entropy of the given targets chunk by chunk (`LinearLogp`), so a
micro-batch's logits are never materialised at once, and never in fp32.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Literal

import torch

from arl.algo.losses import token_logp_entropy
from arl.algo.packing import pack_rows, unpack_values
from arl.config import ConfigError
from arl.precompile import precompiled

log = logging.getLogger(__name__)

Layout = Literal["packed", "padded"]


def forward_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    layout: Layout = "padded",
    lengths: Sequence[int] | None = None,
    needed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy [n, L] of right-padded rows, 0 at position 0 and on padding.

    ``packed`` runs the model on one row holding every sequence (position_ids restart per
    sequence). With the varlen attention of `register_varlen` (CUDA) that row costs what its
    tokens cost: no padding, no mask. Without it transformers builds a dense block-diagonal
    mask, O(total_tokens^2) in time and memory (~14 GB and minutes for 6k tokens on CPU), so
    ``padded`` (the rows as they are, O(n * L^2)) is the layout for CPU.
    The log-probs come from `ChunkedLogpHead` when the model has one: the fp32 logits of a
    micro-batch are never materialised at once. ``lengths`` (each row's attended tokens, as
    the host knows them) spares the packed layout its reads of sizes from the device: on a
    GPU time-shared with an inference engine each such read waits for the engine's turn too.

    ``needed`` [n, L] (the loss mask) names the positions whose values are used: on a CPU the
    padded layout's head then computes those alone (0 elsewhere); a prompt is most of a short
    completion's row. The packed layout computes every position (on CUDA its micro-batches
    replay graphs of fixed shapes, and a data-dependent selection would read the device).
    """
    if layout == "packed":
        row = pack_rows(input_ids, attention_mask, lengths)
        longest = 0
        if uses_varlen(model):
            longest = max(lengths) if lengths else int(attention_mask.sum(dim=1).max())
        logp, ent = packed_logp_entropy(
            model, row.input_ids, row.position_ids, temperature, row.cu_seqlens, longest
        )
        return (
            unpack_values(logp[0], attention_mask, row.index),
            unpack_values(ent[0], attention_mask, row.index),
        )
    if layout != "padded":
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    if uses_varlen(model):
        # Such a model is given no mask (`register_varlen`): padding would be attended.
        raise ValueError("a model loaded for packed rows (varlen attention) cannot run padded rows")
    pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    if input_ids.device.type != "cpu":
        needed = None
    logp, ent = _logp_entropy(
        model, input_ids, pos, temperature, needed, attention_mask=attention_mask
    )
    mask = attention_mask.bool()
    return torch.where(mask, logp, 0.0), torch.where(mask, ent, 0.0)


def packed_logp_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    cu_seqlens: torch.Tensor,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy [1, T] of one packed row: sequences bounded by ``cu_seqlens``, the
    longest ``max_len`` tokens, ``position_ids`` restarting at 0 for each. A model without the
    varlen attention tells them apart by the position ids (a dense mask: CPU)."""
    kw = {}
    if uses_varlen(model):
        cu = cu_seqlens.to(torch.int32)
        kw = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(max_len)}
    return _logp_entropy(model, input_ids, position_ids, temperature, None, **kw)


def uses_varlen(model: torch.nn.Module) -> bool:
    """Whether ``model`` was loaded with the varlen attention of `register_varlen`."""
    return getattr(model.config, "_attn_implementation", "") == VARLEN_ATTENTION


def _logp_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    needed: torch.Tensor | None,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    head = model.get_output_embeddings()
    if isinstance(getattr(head, "arl_logp", None), ChunkedLogpHead):
        with head.arl_logp.targets(input_ids, temperature, needed):
            out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        logp, ent = out.logits.unbind(-1)
        starts = position_ids == 0
        # The entropy is a statistic, as in token_logp_entropy: no gradient.
        return torch.where(starts, 0.0, logp), torch.where(starts, 0.0, ent.detach())
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs).logits
    return token_logp_entropy(logits, input_ids, position_ids, temperature)


class ChunkedLogpHead:
    """Turns a model's output layer into log-prob + entropy of given targets, chunk by chunk.

    Installed on the ``lm_head`` Linear (its forward is replaced, its weight and state-dict
    names stay), so it runs inside the root module's forward, where FSDP has the weight
    gathered. While `targets` is active the head returns [B, T, 2] float32: position t holds
    log_softmax(z[t-1] / T)[id_t] and the entropy of softmax(z[t-1] / T) (0 at t = 0). The
    logits exist one chunk of ``chunk_tokens`` positions at a time, in the layer's dtype, and
    are never kept for backward (`LinearLogp` recomputes each chunk's). Given the positions
    that are ``needed``, only those are computed (the rest hold 0 and get no gradient). Outside
    `targets` it is the plain Linear.
    """

    def __init__(self, linear: torch.nn.Linear, chunk_tokens: int) -> None:
        self.linear, self.chunk_tokens = linear, chunk_tokens
        self._ids: torch.Tensor | None = None
        self._needed: torch.Tensor | None = None
        self._inv_temp = 1.0
        self._plain = linear.forward
        linear.arl_logp = self
        linear.forward = self.forward

    @contextlib.contextmanager
    def targets(
        self, input_ids: torch.Tensor, temperature: float, needed: torch.Tensor | None = None
    ) -> Iterator[None]:
        """Within this block the head computes log-probs of ``input_ids`` [B, T], at the
        positions ``needed`` [B, T] (bool) holds, or at every position."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive for log-probs, got {temperature}")
        self._ids, self._inv_temp, self._needed = input_ids, 1.0 / temperature, needed
        try:
            yield
        finally:
            self._ids = self._needed = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self._ids
        if ids is None:
            return self._plain(hidden)
        b, t, _ = hidden.shape
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        tgt = ids[:, 1:].reshape(-1)
        w, bias = self.linear.weight, self.linear.bias
        if self._needed is None:
            out = LinearLogp.apply(h, w, bias, tgt, self._inv_temp, self.chunk_tokens)
        else:
            rows = self._needed[:, 1:].reshape(-1).nonzero().squeeze(1)
            some = LinearLogp.apply(h[rows], w, bias, tgt[rows], self._inv_temp, self.chunk_tokens)
            out = some.new_zeros(h.shape[0], 2).index_copy(0, rows, some)
        return torch.cat([out.new_zeros(b, 1, 2), out.reshape(b, t - 1, 2)], dim=1)


class LinearLogp(torch.autograd.Function):
    """[log_softmax(z / T)[tgt], entropy(softmax(z / T))] of z = h W^T + b, chunk by chunk.

    Forward keeps only ``h``, the targets and each position's logsumexp; backward recomputes a
    chunk's logits and turns them into their gradient g (onehot(tgt) - softmax(z / T)) / T in
    one pass, so memory is one chunk's [chunk, V] in the layer's dtype however many positions
    there are, and the fp32 logits are never written (on CUDA the per-chunk maths is compiled
    into fused kernels; `chunk_kernels`). The weight's gradient is summed over chunks in fp32.
    The entropy is a statistic: no gradient flows through it.

    The compiled kernels are specialised on sizes and storage offsets of 0 and 1 and on whether
    an input is a view: each gets fresh tensors of at least two positions (`chunk_slices`;
    the per-chunk targets, log-sum-exps and gradients are copied, a few kilobytes), so one
    compilation serves every chunk of every batch and none happens mid-run.
    """

    @staticmethod
    def forward(ctx, h, w, bias, tgt, inv_t, chunk):  # type: ignore[override]
        stats = chunk_kernels(h.device)[0]
        out = torch.empty(h.shape[0], 2, dtype=torch.float32, device=h.device)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for sl in chunk_slices(h.shape[0], chunk):
            z = torch.nn.functional.linear(h[sl], w, bias)
            logp, ent, lse[sl] = stats(z, tgt[sl].clone(), inv_t)
            out[sl, 0], out[sl, 1] = logp, ent
        ctx.save_for_backward(h, w, bias, tgt, lse)
        ctx.inv_t, ctx.chunk = inv_t, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        h, w, bias, tgt, lse = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad = chunk_kernels(h.device)[1]
        g = grad_out[:, 0].float()
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
        grad_b = torch.zeros(w.shape[0], dtype=torch.float32, device=w.device) if need_b else None
        for sl in chunk_slices(h.shape[0], ctx.chunk):
            z = torch.nn.functional.linear(h[sl], w, bias)
            dz = grad(z, tgt[sl].clone(), lse[sl].clone(), g[sl].clone(), ctx.inv_t)
            if grad_h is not None:
                grad_h[sl] = dz @ w
            if grad_w is not None:
                grad_w += (dz.t() @ h[sl]).float()
            if grad_b is not None:
                grad_b += dz.float().sum(0)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(w.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
        )


def chunk_slices(n: int, chunk: int) -> list[slice]:
    """``range(n)`` in consecutive slices of ``chunk`` positions, the last one shorter; where
    that one would hold a single position, it takes one from the slice before it (a size of 1
    would make the compiled kernels compile again)."""
    if chunk < 3:
        raise ValueError(f"chunk must be >= 3 positions, got {chunk}")
    out = [slice(i, min(i + chunk, n)) for i in range(0, n, chunk)]
    if len(out) > 1 and out[-1].stop - out[-1].start == 1:
        out[-2] = slice(out[-2].start, out[-2].stop - 1)
        out[-1] = slice(out[-1].start - 1, n)
    return out


def chunk_logp_stats(
    z: torch.Tensor, tgt: torch.Tensor, inv_t: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of ``tgt``, entropy and logsumexp (each [C], fp32) of the logits ``z`` [C, V]
    taken at temperature 1 / inv_t."""
    zf = z.float() * inv_t
    lse = torch.logsumexp(zf, dim=-1)
    logp = zf.gather(-1, tgt[:, None]).squeeze(-1) - lse
    ent = lse - (torch.exp(zf - lse[:, None]) * zf).sum(-1)
    return logp, ent, lse


def chunk_logit_grad(
    z: torch.Tensor, tgt: torch.Tensor, lse: torch.Tensor, g: torch.Tensor, inv_t: float
) -> torch.Tensor:
    """The gradient of sum(g * logp) with respect to the logits ``z`` [C, V], in z's dtype:
    g * inv_t * (onehot(tgt) - softmax(z * inv_t)), from the forward's logsumexp ``lse``."""
    p = torch.exp(z.float() * inv_t - lse[:, None])
    hit = torch.arange(z.shape[-1], device=z.device)[None, :] == tgt[:, None]
    return ((hit.float() - p) * (g * inv_t)[:, None]).to(z.dtype)


_KERNELS: dict[str, tuple] = {}


def chunk_kernels(device: torch.device) -> tuple:
    """`chunk_logp_stats` and `chunk_logit_grad` for ``device``: compiled on CUDA (each becomes
    one or two fused kernels that read a chunk's logits in their own dtype; eager, those are a
    dozen passes over fp32 copies of the chunk), eager elsewhere."""
    kind = device.type
    if kind not in _KERNELS:
        if kind == "cuda":
            _KERNELS[kind] = (
                _compiled_or_eager(chunk_logp_stats),
                _compiled_or_eager(chunk_logit_grad),
            )
        else:
            _KERNELS[kind] = (chunk_logp_stats, chunk_logit_grad)
    return _KERNELS[kind]


def _compiled_or_eager(fn):
    """``fn`` compiled (dynamic chunk sizes). If its first call fails to compile (e.g. no
    Triton), the eager ``fn`` from then on, with one warning, so the head works wherever torch
    does; later errors (out of memory, say) are raised as they are."""
    # Kept under ARL_CACHE (arl.precompile): a later run loads it instead of tracing it.
    kept = precompiled(fn, name=f"train.logp.{fn.__name__}", dynamic=True)
    state = {"fn": kept, "proven": False}

    def call(*args):
        if state["proven"]:
            return state["fn"](*args)
        try:
            out = state["fn"](*args)
        except Exception as exc:  # a compilation problem surfaces at the first call
            log.warning(
                "compiling %s failed (%s: %s); the log-prob head runs eagerly",
                fn.__name__,
                type(exc).__name__,
                (str(exc).splitlines() or [""])[0][:200],
            )
            state["fn"] = fn
            out = fn(*args)
        state["proven"] = True
        return out

    call.kept = kept  # type: ignore[attr-defined]  # for the rank's ready line
    return call


# The varlen attention of packed rows (CUDA): one flash-attention call over the concatenated
# sequences, told apart by cu_seqlens; without those kwargs (a pass with no rows to tell apart,
# e.g. `FSDPEngine._dummy_pass`) it is stock causal sdpa.
VARLEN_ATTENTION = "arl_varlen"


def _varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """Attention for transformers: [1, H, T, D] packed queries -> [1, T, H, D] outputs."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if dropout:
        raise ValueError(
            f"the varlen attention of packed rows has no dropout, and this model trains with "
            f"attention dropout {dropout}; set actor.layout=padded"
        )
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    if k.shape[1] != q.shape[1]:  # grouped-query heads: each KV head serves a group of heads
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    m = int(kwargs["max_length_q"])
    out = varlen_attn(q, k, v, cu, cu, m, m, scale=scaling, **_CAUSAL)
    return out[None], None


def _causal_kwarg() -> dict:
    """torch 2.9-2.11 take ``is_causal``; later versions a causal ``window_size``."""
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return {}
    params = inspect.signature(varlen_attn).parameters
    return {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}


_CAUSAL = _causal_kwarg()


def varlen_available(device: torch.device) -> bool:
    """Whether packed rows can run on ``device`` without a dense mask (CUDA + torch varlen)."""
    return device.type == "cuda" and bool(_CAUSAL)


def register_varlen() -> str:
    """Register the varlen attention with transformers; returns its ``attn_implementation``."""
    # Only the attention function: with no mask function registered under this name,
    # transformers builds no mask for it (packed rows need none), and skips its scan of the
    # position_ids for packed sequences, which reads a result back from the device.
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention)
    return VARLEN_ATTENTION


# Config fields of transformers models whose forward changes the logits after the output layer
# (Gemma's soft-capping, Cohere's and Granite's scales): the chunked head's log-probs would pass
# through that too, so those models keep the plain logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def transforms_logits(config: object) -> bool:
    """Whether the model's forward changes its logits after the output layer (then the
    `ChunkedLogpHead` must not replace that layer)."""
    return any(getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_TRANSFORMS)


def resolve_layout(layout: str, device: torch.device) -> Layout:
    """``auto``: packed rows where varlen attention runs them without a mask, else padded."""
    if layout == "auto":
        return "packed" if varlen_available(device) else "padded"
    if layout not in ("packed", "padded"):
        raise ConfigError(f"actor.layout must be auto, packed or padded, got {layout!r}")
    return layout  # type: ignore[return-value]
