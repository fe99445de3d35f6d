"""One training rank: log-probs, advantages and the PPO/GRPO update of a HF causal LM.

The model is loaded by `arl.train.sharding`: FSDP2 shards on several ranks; on one rank the
whole model, with fp32 master weights beside a bf16 copy that the passes run on
(`arl.train.master`). Its log-probs come from `arl.train.logp`, the maths of the update from
`arl.algo`. A packed micro-batch is one row gathered on the device (`arl.train.packed`), and
on one CUDA rank small ones replay a CUDA graph per bucket of sizes (`arl.train.graphs`).

`FSDPEngine` is a plain object with blocking methods; the node daemon runs them on one engine
thread. Every method that touches the model or the batch statistics is collective: all ranks
of the process group call it, in the same order, with their own share of the batch (see
`arl.algo.packing.concat_shards` for the batch layout).
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import init_device_mesh

from arl.algo.advantages import (
    gae_advantages,
    grpo_advantages,
    normalize_advantages,
    token_rewards,
)
from arl.algo.losses import kl_estimate, ppo_loss
from arl.algo.packing import (
    agree_count,
    balanced_partition,
    ffd_bins,
    micro_batches,
    select_rows,
    seq_lengths,
)
from arl.algo.rewards import normalize_rewards, transform_rewards
from arl.algo.schedule import lr_at
from arl.compile_cache import use_compile_cache
from arl.config import ActorConfig, ConfigError
from arl.engines.lora import is_lora_name, save_adapter
from arl.precompile import kept_note
from arl.train.activations import activation_bytes_per_token
from arl.train.graphs import MicroBatchGraphs
from arl.train.logp import (
    Layout,
    forward_logp,
    packed_logp_entropy,
    resolve_layout,
    varlen_available,
)
from arl.train.lora import adapters_disabled, lora_settings, merged_state
from arl.train.offload import HostMasterWeights
from arl.train.packed import PackedMicroBatch, bucket_for, pack_micro_batch
from arl.train.sharding import (
    compile_failed,
    compute_dtype,
    full_tensor,
    kept_functions,
    load_sharded,
    local_tensor,
    uncompile_layers,
)
from arl.train.stats import StatSums
from arl.wire.rendezvous import split_tcp_url, tcp_store

log = logging.getLogger(__name__)

# Files copied next to saved weights so that the export loads as a complete HF model folder
# (the tokenizer and its generation config).
EXPORT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


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
        use_compile_cache()  # before the layers and the log-prob head compile
        t_start = time.perf_counter()
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.total_steps = total_steps
        self.device = torch.device(device)
        if self.device.type == "cuda":
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        offload = cfg.offload == "optimizer"
        if offload and backend == "nccl":
            # FSDP's offloaded shards and their gradient norm live on the host: gloo for those.
            backend = "cpu:gloo,cuda:nccl"
        # Rank 0's store listens on the rendezvous host only (torch's own would take every one).
        host, port = split_tcp_url(init_method)
        store = tcp_store(host, port, world_size, rank == 0, default_pg_timeout)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size)
        torch.manual_seed(seed)
        self.mesh = init_device_mesh(self.device.type, (world_size,))
        group_s = time.perf_counter() - t_start  # of load_s: the process group and its mesh
        self.compute_dtype = compute_dtype(cfg, self.device)
        self.layout: Layout = resolve_layout(cfg.layout, self.device)
        varlen = self.layout == "packed" and varlen_available(self.device)
        # With LoRA (`arl.train.lora`) only the adapters train, sync and export.
        self.lora = lora_settings(cfg)
        # ``model`` holds the trained weights (what the optimizer steps, checkpoints and weight
        # syncs read); passes run on ``forward_model``: the same module, or on one rank in
        # mixed precision its compute-dtype copy (`arl.train.master`).
        self.model, self.forward_model, self._master = load_sharded(
            cfg.path,
            self.mesh,
            self.compute_dtype,
            trainable=True,
            gradient_checkpointing=cfg.gradient_checkpointing,
            varlen=varlen,
            compile_layers=cfg.compile and self.device.type == "cuda",
            lora=self.lora,
            offload=offload,
        )
        self.load_s = time.perf_counter() - t_start  # process group and the sharded model
        # What the optimizer steps, the gradients clip and CUDA graphs hold: every parameter,
        # or with LoRA the adapters alone.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self._bytes_per_token = activation_bytes_per_token(
            self.model.config, cfg.gradient_checkpointing
        )
        self.model.train()
        self.forward_model.train()
        offloaded = isinstance(self._master, HostMasterWeights)
        self.optimizer = torch.optim.AdamW(
            # Offloaded, one group per chunk that `HostMasterWeights.step` streams.
            self._master.param_groups() if offloaded else self.trainable,
            lr=cfg.lr,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            # One multi-tensor kernel for all parameters on CUDA, its step counts on the device:
            # no per-parameter host work (the default foreach path reads each step on the host).
            # Offloaded on one rank, the fused CPU kernel (`arl.train.offload`); with FSDP's
            # offloaded shards (DTensors on the host) the default.
            fused=offloaded or (self.device.type == "cuda" and not offload),
        )
        self.ref: torch.nn.Module | None = None
        # With LoRA the starting policy is the base: the reference is the policy's own model
        # with its adapters bypassed, unless another model is asked for.
        self._ref_is_base = (
            cfg.kl_ctl > 0 and self.lora is not None and ref_path in (None, cfg.path)
        )
        if cfg.kl_ctl > 0 and not self._ref_is_base:
            self.ref = load_sharded(
                ref_path or cfg.path,
                self.mesh,
                self.compute_dtype,
                trainable=False,
                gradient_checkpointing=False,
                varlen=varlen,
            ).forward
        self.source_path = cfg.path
        self._step = 0
        # `weight_sources`' cached views and what they were taken from.
        self._sources: list[tuple[str, torch.Tensor]] | None = None
        self._sources_key: list[tuple[int, int]] = []
        self.prime_s = self.warm_up_s = 0.0
        # Whether any pass runs without gradients: the proximal log-probs' pass (unless the
        # update's own forward gives them) or the reference's. Without one, priming compiles
        # and warms only the passes with gradients (a compiled function per grad mode).
        self._no_grad_passes = (cfg.use_decoupled_loss and not cfg.prox_in_update()) or (
            cfg.kl_ctl > 0
        )
        # Summed over a mini-batch's micro-batches, and the loss's token count: tensors that
        # stay where they are, so captured passes (`graphs`) add into and read the same ones.
        self._stats = StatSums(self.device)
        self._n_global = torch.ones((), dtype=torch.float32, device=self.device)
        self.graphs = self._graphs_if_they_pay()
        self.prime()
        # One line per rank that `python -m arl.bench startup` reads back from the run's log.
        log.info(
            "rank %d: ready in %.1f s (load %.1f s, prime %.1f s; process group %.1f s)%s",
            self.rank,
            time.perf_counter() - t_start,
            self.load_s,
            self.prime_s,
            group_s,
            kept_note(kept_functions(self.forward_model, self.device)),
        )

    def _graphs_if_they_pay(self) -> MicroBatchGraphs | None:
        """CUDA graphs of small micro-batches (`arl.train.graphs`), where they apply: one CUDA
        rank (FSDP's hooks cannot be replayed) with packed varlen rows, ``actor.cuda_graphs`` on,
        and no gradient checkpointing (its recomputation is not captured; it is for models whose
        passes are device-bound anyway). A graph's memory stays held, so its micro-batches are
        capped at 16k tokens or the activations that a quarter of the free device memory holds,
        whichever is fewer; larger ones are bound by the device, not the host, and run eagerly.
        With graphs, gradients stay allocated (zeroed, never freed): the graphs add into them,
        which optimizer offload does not want (its gradients leave the device after a step)."""
        cfg = self.cfg
        if not (
            cfg.cuda_graphs
            and cfg.offload == "none"
            and self.device.type == "cuda"
            and self.world_size == 1
            and self.layout == "packed"
            and varlen_available(self.device)
            and not cfg.gradient_checkpointing
        ):
            return None
        free, _ = torch.cuda.mem_get_info(self.device)
        cap = min(16384, int(0.25 * free / self._bytes_per_token))
        if cap < 1024:
            return None
        if self._master is not None:
            self._master.hold_grads()
        else:
            for p in self.trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        return MicroBatchGraphs(self.device, cap)

    def prime(self) -> float:
        """On CUDA, forwards with backward (and without, where the run makes such passes: the
        proximal or reference log-probs') on two small packed batches of different shapes,
        gradients dropped: the first passes' one-time costs that do not grow with the
        batch (kernel selection, the log-prob head's compilation, and with ``actor.compile`` the
        layers'; the second shape makes compiled code dynamic in every size that changes between
        steps: the token count, the longest sequence). It runs when the rank is built, while the
        inference engines load and warm up, so neither the first step nor the start-up waits for
        it; the passes hold a few hundred tokens of activations, handed back to the device
        afterwards. If the layers fail to compile, they run eagerly from then on, with one
        warning. Collective; returns the seconds it took (``prime_s``). Off CUDA nothing
        compiles or selects kernels, and it does nothing."""
        if self.device.type != "cuda":
            return 0.0
        t0 = time.perf_counter()
        shapes = [[48, 80, 72], [120, 33, 97, 64]]
        try:
            self._passes(shapes)
        except Exception as err:
            # Compiled layers are on by default: a model they cannot compile still trains.
            if not (self.cfg.compile and compile_failed(err)):
                raise
            self.zero_grad()
            n = uncompile_layers(self.forward_model)
            log.warning(
                "rank %d: torch.compile failed on the decoder layers (%s: %s); %d layers run "
                "eagerly (set actor.compile=false to skip trying)",
                self.rank,
                type(err).__name__,
                (str(err).splitlines() or [""])[0][:300],
                n,
            )
            self._passes(shapes)
        self.prime_s = time.perf_counter() - t0
        log.info(
            "rank %d: primed (compile=%s) in %.1f s", self.rank, self.cfg.compile, self.prime_s
        )
        return self.prime_s

    def warm_up(self) -> float:
        """The first large pass's one-time costs, which the trainer overlaps with the first
        rollout: kernel selection at a large size, compiled code specialised on a size range
        where something still specialises it (the layers' mix-order reduction no longer does:
        `layer_compile_options`), and the allocator growing to a large micro-batch's size. On
        CUDA, a forward with backward (and one without where `prime` runs one) on a batch of
        up to 16k tokens (within the micro-batch budget and half the free memory, the same on
        every rank), so the first real step neither compiles nor grows again; its memory is
        handed back to the device afterwards (an engine may share it). `prime` paid the small
        passes' costs when the rank was built. Collective; returns the seconds it took
        (``warm_up_s``).

        Off CUDA one tiny pass runs: larger ones would only be compute taken from the first
        rollout's cores (on two cores they outlasted it)."""
        t0 = time.perf_counter()
        shapes = [] if self.device.type == "cuda" else [[3, 2]]
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            big = min(16384, self.cfg.max_tokens_per_mb or 16384)
            big = min(big, int(0.5 * free / self._bytes_per_token))
            # Every rank runs the same passes (FSDP collectives): the smallest budget decides.
            big = -int(self._all_max(torch.tensor([-big]))[0])
            if big >= 1024:
                shapes.append([512] * (big // 512))
        self._passes(shapes)
        self.warm_up_s = time.perf_counter() - t0
        log.info(
            "rank %d: warmed up (compile=%s) in %.1f s", self.rank, self.cfg.compile, self.warm_up_s
        )
        return self.warm_up_s

    def _passes(self, shapes: list[list[int]]) -> None:
        """A forward with backward, and one without where the run makes such passes, per batch
        of rows of ``shapes``' lengths, gradients dropped; on CUDA the memory they took goes
        back to the device."""
        modes = (True, False) if self._no_grad_passes else (True,)
        for shape in shapes:
            lens = torch.tensor(shape, device=self.device)
            am = torch.arange(int(lens.max()), device=self.device)[None] < lens[:, None]
            ids = torch.ones_like(am, dtype=torch.long) * am
            for grad in modes:
                with torch.set_grad_enabled(grad):
                    logp, _ = forward_logp(
                        self.forward_model, ids, am, self.cfg.temperature, self.layout, shape
                    )
                    if grad:
                        (logp.sum() * 0.0).backward()
        self.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ------------------------------------------------------------------ log-probs and advantages

    def compute_logp(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Log-prob [B, L] (float32, CPU) of token t at position t under the current policy."""
        return self._logp(self.forward_model, batch)

    def compute_ref_logp(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Log-prob [B, L] under the frozen reference model (needs kl_ctl > 0): with LoRA
        and no other reference model, the policy's base (its adapters bypassed)."""
        if self._ref_is_base:
            with adapters_disabled(self.forward_model) as base:
                return self._logp(base, batch)
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
        keys = ("input_ids", "attention_mask", *(("loss_mask",) if "loss_mask" in batch else ()))
        for rows in self._micro_batches(batch, self._token_budget(batch, backward=False)):
            if not rows:
                self._dummy_pass(model, backward=False)
                continue
            mb = self._to_device(select_rows(batch, rows), keys)
            logp, _ = forward_logp(
                model,
                mb["input_ids"],
                mb["attention_mask"],
                self.cfg.temperature,
                self.layout,
                [lens[i] for i in rows],
                needed=mb.get("loss_mask"),  # the loss reads these positions alone
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
        self.zero_grad()
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
        elif isinstance(self._master, HostMasterWeights):
            self._master.step(self.optimizer)  # streamed; publishes each chunk it steps
            self._step += 1
        else:
            self.optimizer.step()
            self._step += 1
            self.sync_forward_weights()
        self.zero_grad()
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
        self._n_global.fill_(max(n_global, 1.0))
        self._stats.reset()
        lens = seq_lengths(batch)
        bins = self._micro_batches(batch, max_tokens_per_mb or self._token_budget(batch))
        fields = _TRAIN_FIELDS + tuple(k for k in ("prox_logp", "ref_logp") if k in batch)
        if self.layout == "packed":
            self._packed_passes(batch, bins, lens, fields)
        else:
            keys = ("input_ids", "attention_mask", *fields)
            for rows in bins:
                if not rows:
                    self._dummy_pass(self.forward_model, backward=True)
                    continue
                mb = self._to_device(select_rows(batch, rows), keys)
                logp, ent = forward_logp(
                    self.forward_model,
                    mb["input_ids"],
                    mb["attention_mask"],
                    self.cfg.temperature,
                    self.layout,
                    [lens[i] for i in rows],
                    needed=mb["loss_mask"],
                )
                self._train_pass(logp, ent, mb)
        out = self._stats.reduce(self._all_sum, self._all_max, n_global)
        if not self.cfg.use_decoupled_loss:
            out = {k: v for k, v in out.items() if not k.startswith(("imp_weight", "rejected"))}
        return out | {"n_micro_batches": float(len(bins))}

    def _packed_passes(
        self,
        batch: Mapping[str, torch.Tensor],
        bins: list[list[int]],
        lens: list[int],
        fields: tuple[str, ...],
    ) -> None:
        """The micro-batches of a packed mini-batch: its fields go to the device once, each
        micro-batch is gathered there into one packed row and, where `graphs` are on and every
        micro-batch fits them, replays its bucket's CUDA graph. A mini-batch with a larger
        micro-batch is bound by the device, not the host: it runs eagerly, since capturing its
        small remainder would cost a capture (which empties the allocator's cache) and the
        graph's memory for no gain."""
        keys = ("input_ids", *fields)
        dev = {k: batch[k].to(self.device, non_blocking=True) for k in keys}
        buckets = [
            bucket_for(sum(lens[i] for i in rows), len(rows), max(lens[i] for i in rows))
            if rows and self.graphs is not None
            else None
            for rows in bins
        ]
        graphed = self.graphs is not None and all(
            b is None or self.graphs.takes(b) for b in buckets
        )
        for rows, bucket in zip(bins, buckets, strict=True):
            if not rows:
                self._dummy_pass(self.forward_model, backward=True)
                continue

            def fill(out: PackedMicroBatch | None, rows: list[int] = rows, bucket=bucket):
                return pack_micro_batch(dev, rows, lens, fields, bucket, out)

            if graphed:
                self.graphs.run(bucket, fill, self._packed_pass)
            else:
                if self.graphs is not None:
                    self.graphs.eager += 1
                self._packed_pass(pack_micro_batch(dev, rows, lens, fields))

    def _packed_pass(self, mb: PackedMicroBatch) -> None:
        """Forward, loss and backward of one packed row; adds into the gradients and stats."""
        logp, ent = packed_logp_entropy(
            self.forward_model,
            mb.input_ids,
            mb.position_ids,
            self.cfg.temperature,
            mb.cu_seqlens,
            mb.max_len,
        )
        self._train_pass(logp, ent, mb.fields, mb.seq_ids, mb.n_seqs)

    def _train_pass(
        self,
        logp: torch.Tensor,
        ent: torch.Tensor,
        mb: Mapping[str, torch.Tensor],
        seq_ids: torch.Tensor | None = None,
        n_seqs: int = 0,
    ) -> None:
        """Loss and backward of one micro-batch's log-probs; its gradients are added into the
        trained weights' and its statistics into `_stats`, all without reading the device."""
        loss, stats = self._loss(logp, mb, seq_ids, n_seqs)
        (loss * self.world_size).backward()
        kl = None
        if "ref_logp" in mb:
            kl = kl_estimate(logp.detach(), mb["ref_logp"], self.cfg.kl_estimator)
        self._stats.add(loss.detach(), stats, mb["loss_mask"].bool(), ent.detach(), kl)
        if self._master is not None:
            self._master.accumulate_grads()

    def _loss(
        self,
        logp: torch.Tensor,
        mb: Mapping[str, torch.Tensor],
        seq_ids: torch.Tensor | None = None,
        n_seqs: int = 0,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`ppo_loss` of one micro-batch with this engine's settings: the ratio against the
        proximal log-probs (the pass's, else this forward's detached when `prox_in_update`), or
        against the behaviour log-probs without the decoupled loss; the token count of the
        mini-batch (all ranks) divides it."""
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
            n_tokens=self._n_global,
            seq_ids=seq_ids,
            n_seqs=n_seqs,
        )

    def _clip_gradients(self) -> float:
        """Global L2 norm of the gradients (all ranks), clipped to cfg.grad_clip when finite."""
        if isinstance(self._master, HostMasterWeights):  # taken and clipped on the device
            return self._master.clip(self.cfg.grad_clip)
        params = [p for p in self.trainable if p.grad is not None]
        total = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0))
        norm = float(total)
        if math.isfinite(norm):
            torch.nn.utils.clip_grads_with_norm_(params, self.cfg.grad_clip, total)
        return norm

    def gradients(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) gradients by parameter name, yielded on rank 0; collective."""
        for name, p in self.model.named_parameters():
            if not p.requires_grad or p.grad is None:
                continue
            full = full_tensor(p.grad)
            if self.rank == 0:
                yield name, full.detach()

    def zero_grad(self) -> None:
        """Drop accumulated gradients (after `accumulate_gradients` used on its own): zeroed
        where CUDA graphs add into them at fixed addresses, else freed."""
        self.optimizer.zero_grad(set_to_none=self.graphs is None)
        if self._master is not None:
            self._master.zero_grads()

    def sync_forward_weights(self) -> None:
        """Cast the trained weights into the forward copy (one rank in mixed precision), after
        they changed: an optimizer step, a checkpoint load."""
        if self._master is not None:
            self._master.publish()

    # ------------------------------------------------------------------ weights and state

    def synced_state(self, module: torch.nn.Module | None = None) -> list[tuple[str, torch.Tensor]]:
        """The state-dict entries of ``module`` (default: the trained ``model``) a weight sync
        moves (full shapes; DTensors under FSDP), in state-dict order: all of them, or with
        LoRA the adapter's alone (the engines hold the same frozen base)."""
        items = (self.model if module is None else module).state_dict().items()
        if self.lora is None:
            return list(items)
        return [(name, t) for name, t in items if is_lora_name(name)]

    def state_dict_for_sync(
        self, dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of `synced_state` whole, yielded on rank 0 (on this engine's device;
        offloaded and not in the compute dtype, the host masters); collective: every rank must
        iterate it to the end, since each tensor is all-gathered."""
        sources = self.weight_sources(dtype)
        if sources is not None:  # one rank: the shards are the full tensors, nothing to gather
            for name, t in sources:
                yield name, t if dtype is None else t.to(dtype)
            return
        yield from self._gathered(self.synced_state(), dtype)

    def _gathered(
        self, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each of ``named`` whole (all-gathered one at a time), yielded on rank 0; collective."""
        for name, t in named:
            full = full_tensor(t).detach()
            if self.rank == 0:
                yield name, full if dtype is None else full.to(dtype)

    def weight_sources(
        self, dtype: torch.dtype | None = None
    ) -> list[tuple[str, torch.Tensor]] | None:
        """The tensors of `synced_state` as views of this rank's shards (no gather, no copy)
        when it is the only rank; None with more ranks (`state_dict_for_sync` gathers them).
        With optimizer offload and ``dtype`` the compute dtype, the forward copy's tensors on
        the device: the host masters rounded to that dtype, the same bytes a cast would give.

        The list is kept while every synced tensor is the same tensor in the same memory
        (checked on each call, ~1 us per tensor), since a state dict costs ~10 ms to build.
        """
        if self.world_size != 1:
            return None
        module = self.model
        if isinstance(self._master, HostMasterWeights) and dtype == self.compute_dtype:
            module = self.forward_model
        tensors = (
            self.trainable if self.lora is not None else [*module.parameters(), *module.buffers()]
        )
        key = [(id(t), local_tensor(t).data_ptr()) for t in tensors]
        if self._sources is not None and key == self._sources_key:
            return self._sources
        out = []
        for name, t in self.synced_state(module):
            local = local_tensor(t)
            if tuple(local.shape) != tuple(t.shape):
                return None
            out.append((name, local.detach()))
        self._sources, self._sources_key = out, key
        return out

    def tied_weights(self) -> dict[str, str]:
        """State-dict names that alias an earlier name's tensor (tied embeddings), to it; none
        among LoRA adapters."""
        if self.lora is not None:
            return {}
        first: dict[tuple[int, tuple[int, ...]], str] = {}
        tied = {}
        for name, t in self.model.state_dict().items():
            key = (local_tensor(t).data_ptr(), tuple(t.shape))
            if key in first:
                tied[name] = first[key]
            else:
                first[key] = name
        return tied

    def save_hf(
        self, path: str | Path, dtype: torch.dtype | None = None, *, merged: bool = False
    ) -> None:
        """Save the policy as a HF model folder (weights, config, tokenizer files); collective.

        With LoRA the folder holds the adapter in peft's format (its base: ``actor.path``) and
        the tokenizer files; ``merged`` adds ``merged/``, a whole HF model folder of the base
        with the adapter merged in (`arl.train.lora.merged_state`)."""
        out = Path(path)
        if self.lora is None:
            state = {name: t.cpu() for name, t in self.state_dict_for_sync(dtype)}
            if self.rank == 0:
                out.mkdir(parents=True, exist_ok=True)
                self.model.save_pretrained(out, state_dict=state)
                self._copy_export_files(out)
            dist.barrier()
            return
        adapter = [(name, t.cpu()) for name, t in self.state_dict_for_sync(dtype)]
        full = []
        if merged:
            full = [(n, t.cpu()) for n, t in self._gathered(list(self.model.state_dict().items()))]
        if self.rank == 0:
            save_adapter(out, adapter, self.lora, base_model=self.source_path)
            self._copy_export_files(out)
            if merged:
                self.model.save_pretrained(out / "merged", state_dict=merged_state(full, self.lora))
                self._copy_export_files(out / "merged")
        dist.barrier()

    def _copy_export_files(self, out: Path) -> None:
        """The model's tokenizer and generation config beside exported weights."""
        src = Path(self.source_path)
        for fname in EXPORT_FILES:
            if (src / fname).is_file() and not (out / fname).exists():
                shutil.copy2(src / fname, out / fname)

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
        self.model = self.forward_model = self.ref = self.optimizer = None  # type: ignore[assignment]
        self._master = self.graphs = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ helpers

    def _micro_batches(self, batch: Mapping[str, torch.Tensor], budget: int) -> list[list[int]]:
        """This rank's rows in as many micro-batches as FFD packing needs, padded so every rank
        runs the same number; with training graphs, of about equal loads (`micro_batches`
        ``balanced``), so that a step's micro-batches share a graph bucket instead of each
        remainder capturing one of its own."""
        lens = seq_lengths(batch)
        n = agree_count(len(ffd_bins(lens, budget)))
        return micro_batches(lens, budget, n, balanced=self.graphs is not None)

    def _token_budget(self, batch: Mapping[str, torch.Tensor], *, backward: bool = True) -> int:
        """Tokens per micro-batch: ``actor.max_tokens_per_mb``, or sized from free memory.

        On CUDA half of the free device memory (the colocated inference engine may still
        grow its KV cache) over the activation bytes a token keeps for backward
        (`activation_bytes_per_token`); a forward without backward keeps none, so log-prob
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
    lora = cfg.lora
    if lora.rank < 0 or (lora.rank > 0 and (lora.alpha <= 0 or not 0 <= lora.dropout < 1)):
        raise ConfigError(
            f"actor.lora needs rank >= 0 (0: off), alpha > 0 and 0 <= dropout < 1; got "
            f"rank={lora.rank}, alpha={lora.alpha}, dropout={lora.dropout}"
        )
    if cfg.lr_scheduler != "constant" and (total_steps is None or total_steps <= cfg.warmup_steps):
        raise ConfigError(
            f"actor.lr_scheduler={cfg.lr_scheduler!r} needs total_steps (optimizer steps of the "
            f"run) > actor.warmup_steps={cfg.warmup_steps}; got total_steps={total_steps}"
        )


# The per-token fields a micro-batch's loss reads (besides the tokens).
_TRAIN_FIELDS = ("loss_mask", "advantages", "logprobs")
