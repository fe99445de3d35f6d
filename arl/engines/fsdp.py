"""One FSDP2 training rank: log-probs, advantages and the PPO/GRPO update of a HF causal LM.

`FSDPEngine` is a plain object with blocking methods; the node daemon runs them on one engine
thread. Every method that touches the model or the batch statistics is collective: all ranks
of the process group call it, in the same order, with their own share of the batch (see
`arl.algo.packing.concat_shards` for the batch layout).
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from arl.algo.advantages import (
    gae_advantages,
    grpo_advantages,
    normalize_advantages,
    token_rewards,
)
from arl.algo.losses import kl_estimate, ppo_loss, token_logp_entropy
from arl.algo.packing import (
    agree_count,
    balanced_partition,
    ffd_bins,
    micro_batches,
    pack_rows,
    select_rows,
    seq_lengths,
    unpack_values,
)
from arl.algo.rewards import normalize_rewards, transform_rewards
from arl.algo.schedule import lr_at
from arl.config import ActorConfig, ConfigError
from arl.wire.rendezvous import split_tcp_url, tcp_store

log = logging.getLogger(__name__)

Layout = Literal["packed", "padded"]
# Files copied next to saved weights so that the export loads as a complete HF model folder.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def forward_logp(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    temperature: float,
    layout: Layout = "padded",
    lengths: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy [n, L] of right-padded rows, 0 at position 0 and on padding.

    ``packed`` runs the model on one row holding every sequence (position_ids restart per
    sequence). With the varlen attention of `_load_sharded` (CUDA) that row costs what its
    tokens cost: no padding, no mask. Without it transformers builds a dense block-diagonal
    mask, O(total_tokens^2) in time and memory (~14 GB and minutes for 6k tokens on CPU), so
    ``padded`` (the rows as they are, O(n * L^2)) is the layout for CPU.
    The log-probs come from `ChunkedLogpHead` when the model has one: the fp32 logits of a
    micro-batch are never materialised at once. ``lengths`` (each row's attended tokens, as
    the host knows them) spares the packed layout its reads of sizes from the device: on a
    GPU time-shared with an inference engine each such read waits for the engine's turn too.
    """
    if layout == "packed":
        row = pack_rows(input_ids, attention_mask, lengths)
        kw = {}
        if getattr(model.config, "_attn_implementation", "") == VARLEN_ATTENTION:
            cu = row.cu_seqlens.to(torch.int32)
            longest = max(lengths) if lengths else int(attention_mask.sum(dim=1).max())
            kw = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": int(longest)}
        logp, ent = _logp_entropy(model, row.input_ids, row.position_ids, temperature, **kw)
        return (
            unpack_values(logp[0], attention_mask, row.index),
            unpack_values(ent[0], attention_mask, row.index),
        )
    if layout != "padded":
        raise ValueError(f"layout must be 'packed' or 'padded', got {layout!r}")
    if getattr(model.config, "_attn_implementation", "") == VARLEN_ATTENTION:
        # Such a model is given no mask (`_register_varlen`): padding would be attended.
        raise ValueError("a model loaded for packed rows (varlen attention) cannot run padded rows")
    pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    logp, ent = _logp_entropy(model, input_ids, pos, temperature, attention_mask=attention_mask)
    mask = attention_mask.bool()
    return torch.where(mask, logp, 0.0), torch.where(mask, ent, 0.0)


def _logp_entropy(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float,
    **kwargs: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    head = model.get_output_embeddings()
    if isinstance(getattr(head, "arl_logp", None), ChunkedLogpHead):
        with head.arl_logp.targets(input_ids, temperature):
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
    log_softmax(z[t-1] / T)[id_t] and the entropy of softmax(z[t-1] / T) (0 at t = 0). Each
    chunk of ``chunk_tokens`` positions computes its fp32 logits, logsumexp and gather, and
    keeps nothing for backward but its input: the backward recomputes the chunk's logits
    (torch.utils.checkpoint), so memory is one chunk's [chunk, V] instead of the micro-batch's.
    Outside `targets` it is the plain Linear.
    """

    def __init__(self, linear: torch.nn.Linear, chunk_tokens: int) -> None:
        self.linear, self.chunk_tokens = linear, chunk_tokens
        self._ids: torch.Tensor | None = None
        self._inv_temp = 1.0
        self._plain = linear.forward
        linear.arl_logp = self
        linear.forward = self.forward

    @contextlib.contextmanager
    def targets(self, input_ids: torch.Tensor, temperature: float) -> Iterator[None]:
        """Within this block the head computes log-probs of ``input_ids`` [B, T]."""
        if temperature <= 0:
            raise ValueError(f"temperature must be positive for log-probs, got {temperature}")
        self._ids, self._inv_temp = input_ids, 1.0 / temperature
        try:
            yield
        finally:
            self._ids = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        ids = self._ids
        if ids is None:
            return self._plain(hidden)
        b, t, _ = hidden.shape
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        tgt = ids[:, 1:].reshape(-1)
        w, bias = self.linear.weight, self.linear.bias
        parts = []
        for i in range(0, h.shape[0], self.chunk_tokens):
            sl = slice(i, i + self.chunk_tokens)
            if torch.is_grad_enabled():
                parts.append(
                    checkpoint(
                        _chunk_logp, h[sl], w, bias, tgt[sl], self._inv_temp, use_reentrant=False
                    )
                )
            else:
                parts.append(_chunk_logp(h[sl], w, bias, tgt[sl], self._inv_temp))
        out = torch.cat(parts, dim=0).reshape(b, t - 1, 2)
        return torch.cat([out.new_zeros(b, 1, 2), out], dim=1)


def _chunk_logp(
    h: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tgt: torch.Tensor, inv_t: float
) -> torch.Tensor:
    z = torch.nn.functional.linear(h, w, bias).float() * inv_t
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, tgt[:, None]).squeeze(-1) - lse
    with torch.no_grad():  # a statistic only; exp(z - lse) is the softmax, lse already known
        ent = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)
    return torch.stack([logp, ent], dim=-1)


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


def _register_varlen() -> str:
    # Only the attention function: with no mask function registered under this name,
    # transformers builds no mask for it (packed rows need none), and skips its scan of the
    # position_ids for packed sequences, which reads a result back from the device.
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, _varlen_attention)
    return VARLEN_ATTENTION


def _compute_dtype(cfg: ActorConfig, device: torch.device) -> torch.dtype:
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def _load_sharded(
    path: str,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype,
    *,
    trainable: bool,
    gradient_checkpointing: bool,
    varlen: bool = False,
    compile_layers: bool = False,
) -> torch.nn.Module:
    """Load a HF causal LM and shard it with FSDP2: each decoder layer (on more than one rank)
    and the root.

    The trainable model keeps fp32 master weights and computes in ``compute_dtype`` with fp32
    gradient reduction; the frozen reference is loaded directly in ``compute_dtype``. ``varlen``
    runs attention through `_varlen_attention` (packed rows without masks); the output layer
    gets a `ChunkedLogpHead`; ``compile_layers`` compiles each decoder layer.
    """
    from transformers import AutoModelForCausalLM

    from arl.engines.model import resolve_model

    local = resolve_model(path)
    model = AutoModelForCausalLM.from_pretrained(
        local,
        dtype=torch.float32 if trainable else compute_dtype,
        attn_implementation=_register_varlen() if varlen else "sdpa",
    )
    model.config.use_cache = False
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and not _transforms_logits(model.config):
        # ~1 GiB of fp32 logits per chunk at most, whatever the vocabulary.
        ChunkedLogpHead(head, max(256, (1 << 28) // head.out_features))
    if gradient_checkpointing and trainable:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    mp = None
    if compute_dtype != torch.float32 and trainable:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
    # HF lists its decoder-layer classes in _no_split_modules: one FSDP unit per layer bounds
    # the all-gathered memory to one layer at a time. One rank gathers nothing (its shard is
    # the whole model), so there the root is the only unit: one copy and cast per pass instead
    # of one per layer, whose per-unit hooks bound a small model's step on the host.
    layer_names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise RuntimeError(
            f"found no decoder layers in {type(model).__name__} (its _no_split_modules is "
            f"{sorted(layer_names)}); FSDP needs a HF causal LM with per-layer modules"
        )
    for layer in layers:
        if mesh.size() > 1:
            fully_shard(layer, **kwargs)
        if compile_layers:
            # Per layer, not the whole model: FSDP's hooks stay outside the compiled region, and
            # every layer shares one compiled graph (dynamic token counts).
            layer.compile(dynamic=True)
    fully_shard(model, **kwargs)
    return model


# Config fields of transformers models whose forward changes the logits after the output layer
# (Gemma's soft-capping, Cohere's and Granite's scales): the chunked head's log-probs would pass
# through that too, so those models keep the plain logits path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def _transforms_logits(config: object) -> bool:
    return any(getattr(config, k, None) not in (None, 1, 1.0) for k in _LOGIT_TRANSFORMS)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class FSDPEngine:
    """One data-parallel training rank of the policy (and the frozen reference when kl_ctl > 0).

    ``total_steps`` (optimizer steps of the run) is needed by the linear and cosine schedules.
    """

    def __init__(
        self,
        cfg: ActorConfig,
        *,
        rank: int,
        world_size: int,
        init_method: str,
        device: str = "cpu",
        seed: int = 1,
        ref_path: str | None = None,
        total_steps: int | None = None,
    ) -> None:
        _check_config(cfg, total_steps)
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.total_steps = total_steps
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # Rank 0's store listens on the rendezvous host only (torch's own would take every one).
        host, port = split_tcp_url(init_method)
        store = tcp_store(host, port, world_size, rank == 0, default_pg_timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
        torch.manual_seed(seed)
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        self.compute_dtype = _compute_dtype(cfg, self.device)
        self.layout: Layout = _resolve_layout(cfg.layout, self.device)
        varlen = self.layout == "packed" and varlen_available(self.device)
        self.model = _load_sharded(
            cfg.path,
            self.mesh,
            self.compute_dtype,
            trainable=True,
            gradient_checkpointing=cfg.gradient_checkpointing,
            varlen=varlen,
            compile_layers=cfg.compile and self.device.type == "cuda",
        )
        self._bytes_per_token = _activation_bytes_per_token(self.model.config, cfg)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            # One multi-tensor kernel for all parameters on CUDA, its step counts on the device:
            # no per-parameter host work (the default foreach path reads each step on the host).
            fused=self.device.type == "cuda",
        )
        self.ref: torch.nn.Module | None = None
        if cfg.kl_ctl > 0:
            self.ref = _load_sharded(
                ref_path or cfg.path,
                self.mesh,
                self.compute_dtype,
                trainable=False,
                gradient_checkpointing=False,
                varlen=varlen,
            )
        self.source_path = cfg.path
        self._step = 0
        # `weight_sources`' cached views and what they were taken from.
        self._sources: list[tuple[str, torch.Tensor]] | None = None
        self._sources_key: list[tuple[int, int]] = []
        self.warm_up_s = 0.0

    def warm_up(self) -> float:
        """Forwards with backward and without on two small packed batches of different
        shapes, gradients dropped: the first passes' one-time costs (kernel selection,
        allocator growth, and with ``actor.compile`` the compilation) are paid here, which the
        trainer overlaps with the first rollout. The second shape makes the compiled layers
        dynamic in every size that changes between steps (the token count, the longest
        sequence). Compiled code may also be specialised on a size range (measured: inductor
        fused SmolLM2's layer for tokens x hidden < 5 Mi elements, ~9k tokens), so on CUDA a
        third batch of up to 16k tokens (within the micro-batch budget, the same on every rank)
        compiles the large side too, and the first real step does not compile again; its
        memory is handed back to the device afterwards (an engine may share it). Collective;
        returns the seconds it took (``warm_up_s``; the start-up cost of ``actor.compile``).

        Off CUDA nothing compiles or selects kernels: those passes would only be compute taken
        from the first rollout's cores (on two cores they outlasted it), so one tiny pass runs."""
        t0 = time.perf_counter()
        shapes = [[48, 80, 72], [120, 33, 97, 64]] if self.device.type == "cuda" else [[3, 2]]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            big = min(16384, self.cfg.max_tokens_per_mb or 16384)
            big = min(big, int(0.5 * free / self._bytes_per_token))
            # Every rank runs the same passes (FSDP collectives): the smallest budget decides.
            big = -int(self._all_max(torch.tensor([-big]))[0])
            if big >= 1024:
                shapes.append([512] * (big // 512))
        for shape in shapes:
            lens = torch.tensor(shape, device=self.device)
            am = torch.arange(int(lens.max()), device=self.device)[None] < lens[:, None]
            ids = torch.ones_like(am, dtype=torch.long) * am
            for grad in (True, False):
                with torch.set_grad_enabled(grad):
                    logp, _ = forward_logp(self.model, ids, am, 1.0, self.layout, shape)
                    if grad:
                        (logp.sum() * 0.0).backward()
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        self.warm_up_s = time.perf_counter() - t0
        log.info(
            "rank %d: warmed up (compile=%s) in %.1f s", self.rank, self.cfg.compile, self.warm_up_s
        )
        return self.warm_up_s

    # ------------------------------------------------------------------ log-probs and advantages

    def compute_logp(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Log-prob [B, L] (float32, CPU) of token t at position t under the current policy."""
        return self._logp(self.model, batch)

    def compute_ref_logp(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Log-prob [B, L] under the frozen reference model (needs kl_ctl > 0)."""
        if self.ref is None:
            raise RuntimeError(
                "no reference model is loaded: it exists only when actor.kl_ctl > 0 "
                f"(kl_ctl={self.cfg.kl_ctl})"
            )
        return self._logp(self.ref, batch)

    @torch.no_grad()
    def _logp(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(batch["input_ids"].shape, dtype=torch.float32)
        lens = seq_lengths(batch)
        for rows in self._micro_batches(batch, self._token_budget(batch, backward=False)):
            if not rows:
                self._dummy_pass(model, backward=False)
                continue
            mb = self._to_device(select_rows(batch, rows), ("input_ids", "attention_mask"))
            logp, _ = forward_logp(
                model,
                mb["input_ids"],
                mb["attention_mask"],
                self.cfg.temperature,
                self.layout,
                [lens[i] for i in rows],
            )
            out[rows, : logp.shape[1]] = logp.float().cpu()
        return out

    def compute_advantages(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch plus ``advantages`` [B, L] (and ``norm_rewards`` [B]).

        Rewards are transformed and normalised (group or batch over all ranks); without KL and
        with discount = lambda = 1 this is GRPO (the normalised reward on every completion
        token), otherwise GAE with V = 0 over token rewards carrying -kl_ctl * KL(pi || ref).
        Advantages are then normalised as cfg says.
        """
        cfg = self.cfg
        mask = batch["loss_mask"].to(self.device).bool()
        group_ids = batch["group_ids"].to(self.device)
        r = transform_rewards(
            batch["rewards"].to(self.device).float(),
            bias=cfg.reward_bias,
            scaling=cfg.reward_scaling,
            clip=cfg.reward_clip,
        )
        r_hat = normalize_rewards(
            r,
            group_ids,
            mean_level=cfg.reward_norm_mean,
            std_level=cfg.reward_norm_std,
            eps=cfg.norm_eps,
            unbiased=cfg.unbiased_std,
        )
        if cfg.kl_ctl == 0 and cfg.discount == 1.0 and cfg.gae_lambda == 1.0:
            adv = grpo_advantages(r_hat, mask)
        else:
            kl = None
            if cfg.kl_ctl > 0:
                if "ref_logp" not in batch:
                    raise KeyError(
                        f"kl_ctl={cfg.kl_ctl} needs batch['ref_logp']; set it from "
                        "compute_ref_logp(batch) before compute_advantages"
                    )
                policy = batch.get("prox_logp", batch["logprobs"])
                kl = kl_estimate(policy, batch["ref_logp"], cfg.kl_estimator).to(self.device)
            tok_r = token_rewards(r_hat, mask, kl, cfg.kl_ctl)
            adv, _ = gae_advantages(
                tok_r, torch.zeros_like(tok_r), mask, gamma=cfg.discount, lam=cfg.gae_lambda
            )
        adv = normalize_advantages(
            adv,
            mask,
            mean_level=cfg.adv_norm_mean,
            std_level=cfg.adv_norm_std,
            group_ids=group_ids,
            eps=cfg.norm_eps,
            unbiased=cfg.unbiased_std,
        )
        return {**batch, "advantages": adv.float().cpu(), "norm_rewards": r_hat.float().cpu()}

    # ------------------------------------------------------------------ training

    def ppo_update(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """``ppo_n_minibatches`` optimizer steps over token-balanced mini-batches of the batch.

        Needs ``advantages`` (compute_advantages) and, for the decoupled loss, ``prox_logp``
        (compute_logp before the update) unless ``cfg.prox_in_update()``: then the update's own
        forward gives them. A non-finite gradient norm skips that step.
        Returns loss, grad_norm, lr, clip_frac, entropy, approx_kl, kl (to the reference),
        n_tokens, skipped (steps skipped), and importance-weight stats.
        """
        _require(batch, ("input_ids", "attention_mask", "loss_mask", "logprobs", "advantages"))
        if self.cfg.use_decoupled_loss and not self.cfg.prox_in_update():
            _require(
                batch,
                ("prox_logp",),
                "use_decoupled_loss needs batch['prox_logp'] = compute_logp(batch) computed "
                f"before the update (ppo_n_minibatches={self.cfg.ppo_n_minibatches}, "
                f"kl_ctl={self.cfg.kl_ctl}, prox_logp={self.cfg.prox_logp!r})",
            )
        parts = balanced_partition(seq_lengths(batch), self.cfg.ppo_n_minibatches)
        results = [self._train_minibatch(select_rows(batch, rows)) for rows in parts]
        out = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
        out["skipped"] = float(sum(r["skipped"] for r in results))
        out["n_tokens"] = float(sum(r["n_tokens"] for r in results))
        out["lr"] = results[-1]["lr"]
        for k in ("imp_weight_max", "imp_weight_min"):
            if k in out:
                out[k] = (max if k.endswith("max") else min)(r[k] for r in results)
        return out

    def _train_minibatch(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        stats = self.accumulate_gradients(batch)
        lr = lr_at(
            self._step,
            base_lr=self.cfg.lr,
            schedule=self.cfg.lr_scheduler,
            warmup_steps=self.cfg.warmup_steps,
            total_steps=self.total_steps,
            min_lr_ratio=self.cfg.min_lr_ratio,
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = self._clip_gradients()
        skipped = not math.isfinite(grad_norm)
        if skipped:
            log.warning(
                "rank %d: gradient norm %s is not finite; skipping the step", self.rank, grad_norm
            )
        else:
            self.optimizer.step()
            self._step += 1
        self.optimizer.zero_grad(set_to_none=True)
        return {**stats, "grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    def accumulate_gradients(
        self, batch: Mapping[str, torch.Tensor], max_tokens_per_mb: int | None = None
    ) -> dict[str, float]:
        """Forward/backward every micro-batch of one mini-batch, adding into ``.grad``.

        The loss of each micro-batch is divided by the mini-batch's global token count and
        multiplied by the world size (FSDP averages gradients over ranks), so the summed
        gradient is that of the full mini-batch token-mean loss however it is split.
        """
        n_global = float(self._all_sum(torch.tensor([float(batch["loss_mask"].sum())]))[0])
        keys = _TRAIN_KEYS + tuple(k for k in ("prox_logp", "ref_logp") if k in batch)
        acc = _StatSums(self.device)
        lens = seq_lengths(batch)
        bins = self._micro_batches(batch, max_tokens_per_mb or self._token_budget(batch))
        for rows in bins:
            if not rows:
                self._dummy_pass(self.model, backward=True)
                continue
            mb = self._to_device(select_rows(batch, rows), keys)
            logp, ent = forward_logp(
                self.model,
                mb["input_ids"],
                mb["attention_mask"],
                self.cfg.temperature,
                self.layout,
                [lens[i] for i in rows],
            )
            loss, stats = self._loss(logp, mb, n_global)
            (loss * self.world_size).backward()
            kl = None
            if "ref_logp" in mb:
                kl = kl_estimate(logp.detach(), mb["ref_logp"], self.cfg.kl_estimator)
            acc.add(loss.detach(), stats, mb["loss_mask"].bool(), ent.detach(), kl)
        out = acc.reduce(self._all_sum, self._all_max, n_global)
        if not self.cfg.use_decoupled_loss:
            out = {k: v for k, v in out.items() if not k.startswith(("imp_weight", "rejected"))}
        return out | {"n_micro_batches": float(len(bins))}

    def _loss(
        self, logp: torch.Tensor, mb: Mapping[str, torch.Tensor], n_tokens: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`ppo_loss` of one micro-batch with this engine's settings: the ratio against the
        proximal log-probs (the pass's, else this forward's detached when `prox_in_update`), or
        against the behaviour log-probs without the decoupled loss."""
        cfg = self.cfg
        if "prox_logp" in mb:
            old = mb["prox_logp"]
        elif cfg.use_decoupled_loss and cfg.prox_in_update():
            old = logp.detach()
        else:
            old = mb["logprobs"]
        return ppo_loss(
            logp,
            old,
            mb["advantages"],
            mb["loss_mask"],
            eps_clip=cfg.eps_clip,
            eps_clip_higher=cfg.eps_clip_higher,
            c_clip=cfg.c_clip,
            behave_logp=mb["logprobs"] if cfg.use_decoupled_loss else None,
            imp_weight_cap=cfg.behav_imp_weight_cap,
            rejection=cfg.rejection,
            n_tokens=max(n_tokens, 1.0),
        )

    def _clip_gradients(self) -> float:
        """Global L2 norm of the gradients (all ranks), clipped to cfg.grad_clip when finite."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = _full(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0))
        norm = float(total)
        if math.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, total)
        return norm

    def gradients(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) gradients by parameter name, yielded on rank 0; collective."""
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            full = _full(p.grad)
            if self.rank == 0:
                yield name, full.detach()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (after `accumulate_gradients` used on its own)."""
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ weights and state

    def state_dict_for_sync(
        self, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors by HF name, yielded on rank 0 (on this engine's device); collective:
        every rank must iterate it to the end, since each tensor is all-gathered."""
        sources = self.weight_sources()
        if sources is not None:  # one rank: the shards are the full tensors, nothing to gather
            for name, t in sources:
                yield name, t if dtype is None else t.to(dtype)
            return
        for name, t in self.model.state_dict().items():
            full = _full(t).detach()
            if self.rank == 0:
                yield name, full if dtype is None else full.to(dtype)

    def weight_sources(self) -> list[tuple[str, torch.Tensor]] | None:
        """The full weights by HF name as views of this rank's shards (no gather, no copy) when
        it is the only rank; None with more ranks (`state_dict_for_sync` gathers them).

        The list is kept while every parameter and buffer is the same tensor in the same memory
        (checked on each call, ~1 us per tensor), since a state dict costs ~10 ms to build.
        """
        if self.world_size != 1:
            return None
        tensors = [*self.model.parameters(), *self.model.buffers()]
        key = [(id(t), _local(t).data_ptr()) for t in tensors]
        if self._sources is not None and key == self._sources_key:
            return self._sources
        out = []
        for name, t in self.model.state_dict().items():
            local = _local(t)
            if tuple(local.shape) != tuple(t.shape):
                return None
            out.append((name, local.detach()))
        self._sources, self._sources_key = out, key
        return out

    def tied_weights(self) -> dict[str, str]:
        """State-dict names that alias an earlier name's tensor (tied embeddings), to it."""
        first: dict[tuple[int, tuple[int, ...]], str] = {}
        tied = {}
        for name, t in self.model.state_dict().items():
            key = (_local(t).data_ptr(), tuple(t.shape))
            if key in first:
                tied[name] = first[key]
            else:
                first[key] = name
        return tied

    def save_hf(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Save the policy as a HF model folder (weights, config, tokenizer files); collective."""
        state = {name: t.cpu() for name, t in self.state_dict_for_sync(dtype)}
        if self.rank == 0:
            out = Path(path)
            out.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(out, state_dict=state)
            src = Path(self.source_path)
            for fname in _TOKENIZER_FILES:
                if (src / fname).is_file() and not (out / fname).exists():
                    shutil.copy2(src / fname, out / fname)
        dist.barrier()

    def get_step(self) -> int:
        """Optimizer steps taken (skipped steps do not count); drives the LR schedule."""
        return self._step

    def set_step(self, step: int) -> None:
        """Set the optimizer step count, e.g. when resuming from a checkpoint."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        self._step = step

    def destroy(self) -> None:
        """Release the models and destroy the process group."""
        self.model = self.ref = self.optimizer = None  # type: ignore[assignment]
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ helpers

    def _micro_batches(self, batch: Mapping[str, torch.Tensor], budget: int) -> list[list[int]]:
        """FFD micro-batches of this rank's rows, padded so every rank runs the same number."""
        lens = seq_lengths(batch)
        return micro_batches(lens, budget, agree_count(len(ffd_bins(lens, budget))))

    def _token_budget(self, batch: Mapping[str, torch.Tensor], *, backward: bool = True) -> int:
        """Tokens per micro-batch: ``actor.max_tokens_per_mb``, or sized from free memory.

        On CUDA half of the free device memory (the colocated inference engine may still
        grow its KV cache) over the activation bytes a token keeps for backward
        (`_activation_bytes_per_token`); a forward without backward keeps none, so log-prob
        passes take 4x that. At least the longest row, at most 64k tokens. On CPU 8192.
        """
        if self.cfg.max_tokens_per_mb:
            return self.cfg.max_tokens_per_mb
        longest = int(batch["attention_mask"].sum(dim=1).max()) if len(batch["input_ids"]) else 1
        if self.device.type != "cuda":
            return max(8192, longest)
        free, _ = torch.cuda.mem_get_info(self.device)
        budget = int(0.5 * free / self._bytes_per_token) * (1 if backward else 4)
        return max(longest, min(budget, 65536))

    def _dummy_pass(self, model: torch.nn.Module, *, backward: bool) -> None:
        """A one-token pass contributing nothing, so FSDP collectives match the other ranks."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        logits = model(input_ids=ids, use_cache=False).logits
        if backward:
            (logits.float().sum() * 0.0).backward()

    def _to_device(
        self, batch: Mapping[str, torch.Tensor], keys: tuple[str, ...]
    ) -> dict[str, torch.Tensor]:
        return {k: batch[k].to(self.device, non_blocking=True) for k in keys}

    def _all_sum(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.SUM)

    def _all_max(self, t: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(t, dist.ReduceOp.MAX)

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp) -> torch.Tensor:
        """``t`` reduced over the ranks, on the host. One rank reduces nothing: a host tensor
        stays where it is (no round trip through the device, which would wait for it)."""
        if self.world_size == 1:
            return t.cpu()
        dev = t.to(self.device)
        dist.all_reduce(dev, op=op)
        return dev.cpu()


def _resolve_layout(layout: str, device: torch.device) -> Layout:
    """``auto``: packed rows where varlen attention runs them without a mask, else padded."""
    if layout == "auto":
        return "packed" if varlen_available(device) else "padded"
    if layout not in ("packed", "padded"):
        raise ConfigError(f"actor.layout must be auto, packed or padded, got {layout!r}")
    return layout  # type: ignore[return-value]


def _activation_bytes_per_token(config: object, cfg: ActorConfig) -> float:
    """Bytes of activations one trained token keeps for backward, from the model's shape.

    Per decoder layer in 16-bit: ~34 x hidden (norm inputs and outputs, q/k/v, attention
    output, residuals, fp32 norm statistics) and ~10 x intermediate (gate, up, activation,
    product); gradient checkpointing keeps only each layer's input. Measured peaks on an H200
    An estimate (on an H200: SmolLM2-135M peaked at ~1.0 MB a token against 1.06 estimated,
    Qwen2.5-1.5B's shape at ~3.0 MB against 3.96); taking half the free memory is the margin.
    """
    hidden = int(getattr(config, "hidden_size", 1024))
    inter = int(getattr(config, "intermediate_size", 4 * hidden))
    layers = int(getattr(config, "num_hidden_layers", 1))
    per_layer = 2 * hidden if cfg.gradient_checkpointing else 34 * hidden + 10 * inter
    return float(layers * per_layer + 8 * hidden)


def _require(batch: Mapping[str, torch.Tensor], keys: tuple[str, ...], why: str = "") -> None:
    missing = [k for k in keys if k not in batch]
    if missing:
        raise KeyError(
            f"batch is missing {missing} (has {sorted(batch)})" + (f": {why}" if why else "")
        )


def _check_config(cfg: ActorConfig, total_steps: int | None) -> None:
    """Fail fast, before any process group or model load, on settings that cannot work."""
    if cfg.rejection != "none" and not cfg.use_decoupled_loss:
        raise ConfigError(
            f"actor.rejection={cfg.rejection!r} bounds the behaviour importance weight of the "
            "decoupled loss; set actor.use_decoupled_loss=true or actor.rejection=none"
        )
    if cfg.rejection != "none" and cfg.behav_imp_weight_cap is None:
        raise ConfigError(
            f"actor.rejection={cfg.rejection!r} needs actor.behav_imp_weight_cap (> 1) as bound"
        )
    if cfg.behav_imp_weight_cap is not None and cfg.behav_imp_weight_cap <= 1:
        raise ConfigError(f"actor.behav_imp_weight_cap must be > 1, got {cfg.behav_imp_weight_cap}")
    if cfg.lr_scheduler != "constant" and (total_steps is None or total_steps <= cfg.warmup_steps):
        raise ConfigError(
            f"actor.lr_scheduler={cfg.lr_scheduler!r} needs total_steps (optimizer steps of the "
            f"run) > actor.warmup_steps={cfg.warmup_steps}; got total_steps={total_steps}"
        )


_TRAIN_KEYS = ("input_ids", "attention_mask", "loss_mask", "advantages", "logprobs")


class _StatSums:
    """Token-weighted sums of micro-batch stats, kept on the device (no per-step host syncs)
    and reduced over ranks once per mini-batch."""

    def __init__(self, device: torch.device) -> None:
        # loss, entropy, kl, clip_frac, approx_kl, imp_weight_mean, rejected_frac, kept tokens
        self.sums = torch.zeros(8, dtype=torch.float64, device=device)
        self.extremes = torch.full((2,), -math.inf, dtype=torch.float64, device=device)

    def add(
        self,
        loss: torch.Tensor,
        st: dict[str, torch.Tensor],
        mask: torch.Tensor,
        entropy: torch.Tensor,
        kl: torch.Tensor | None,
    ) -> None:
        kept = st["n_tokens"].double()
        zero = torch.zeros((), device=loss.device)
        self.sums += torch.stack(
            [
                loss.double(),
                torch.where(mask, entropy, 0.0).sum().double(),
                torch.where(mask, kl, 0.0).sum().double() if kl is not None else zero.double(),
                st["clip_frac"] * kept,
                st["approx_kl"] * kept,
                st.get("imp_weight_mean", zero) * kept,
                st.get("rejected_frac", zero) * mask.sum(),
                kept,
            ]
        ).double()
        if "imp_weight_max" in st:
            w = torch.stack([st["imp_weight_max"], -st["imp_weight_min"]]).double()
            self.extremes = torch.maximum(self.extremes, w)

    def reduce(self, all_sum: Callable, all_max: Callable, n_tokens: float) -> dict[str, float]:
        """Global stats: loss summed, entropy/kl per loss token, the rest per kept token."""
        s = all_sum(self.sums).tolist()
        e = all_max(self.extremes).tolist()
        denom, kept = max(n_tokens, 1.0), max(s[7], 1.0)
        return {
            "loss": s[0],
            "entropy": s[1] / denom,
            "kl": s[2] / denom,
            "clip_frac": s[3] / kept,
            "approx_kl": s[4] / kept,
            "n_tokens": n_tokens,
            "imp_weight_mean": s[5] / kept,
            "rejected_frac": s[6] / denom,
            "imp_weight_max": e[0],
            "imp_weight_min": -e[1],
        }
