"""Training hosting on a train node: one FSDP2 rank and the batch it is working on.

The controller creates one `TrainWorker` per rank and drives a step as a few calls that every
rank runs together (they share collectives, so the node runs them on its engine thread in call
order): ``load_batch(rtensor)`` (the node pulls this rank's shards first), ``compute_logp``
(where the update's forward does not give the proximal log-probs), ``compute_ref_logp`` (with
KL), ``compute_advantages``, ``ppo_update``. Between calls the batch stays
here; only small statistics travel back.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from arl.algo.packing import concat_shards
from arl.engines.hf import checksum_named_tensors
from arl.train.fsdp import FSDPEngine
from arl.wire.codec import parse_dtype


def _actor_config(actor: dict) -> Any:
    from arl.config import ActorConfig, converter

    return converter.structure(actor, ActorConfig)


@contextlib.contextmanager
def _weights_rounded_to(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """``model``'s parameters rounded to ``dtype`` and back (each shard in place), restored on
    exit; None: unchanged. Rounding a trained fp32 weight to bf16 can undo a small update."""
    if dtype is None:
        yield
        return
    params = [p for p in model.parameters() if p.dtype != dtype]
    saved = [p.detach().clone() for p in params]
    try:
        for p in params:
            p.data.copy_(p.data.to(dtype))
        yield
    finally:
        for p, orig in zip(params, saved, strict=True):
            p.data.copy_(orig)


class TrainWorker:
    """One data-parallel rank: the FSDP engine plus the current step's batch."""

    def __init__(
        self,
        actor: dict,
        *,
        rank: int,
        world_size: int,
        init_method: str,
        device: str = "cpu",
        seed: int = 1,
        ref_path: str | None = None,
        total_steps: int | None = None,
    ):
        if device == "cpu" and os.environ.get("OMP_NUM_THREADS"):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        self.rank = rank
        self.engine = FSDPEngine(
            _actor_config(actor),
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            device=device,
            seed=seed,
            ref_path=ref_path or None,
            total_steps=total_steps,
        )
        self.batch: dict[str, torch.Tensor] | None = None
        self.n_steps = 0  # load_batch calls: the steps this rank has started
        self._profile: tuple[int, Path] | None = None
        self._profiler: Any = None
        self._recorded: tuple[Any, float, Path] | None = None
        # The engines' weight dtype: weights are sent, and checksummed, in it (arl.weights).
        self.sync_dtype: torch.dtype | None = None

    def info(self) -> dict:
        """The layout this rank resolved, the seconds of its model's load, of its priming
        (small passes when it was built) and of its warm-up (the large pass; compilation
        included in both) and its CUDA graphs of the update (None where they do not apply)."""
        e = self.engine
        return {
            "layout": e.layout,
            "load_s": e.load_s,
            "prime_s": e.prime_s,
            "warm_up_s": e.warm_up_s,
            "device": str(e.device),
            "graphs": None if e.graphs is None else e.graphs.summary(),
        }

    def warm_up(self) -> float:
        """Pay the first training passes' one-time costs now (see `FSDPEngine.warm_up`)."""
        return self.engine.warm_up()

    # ---- one step ---------------------------------------------------------------------------
    def load_batch(self, shards: list[dict[str, torch.Tensor]]) -> dict:
        """Concatenate this rank's pulled shards (prompt groups) into one padded batch."""
        if not shards:
            raise ValueError(
                f"rank {self.rank} got no shards; data.batch_size must be >= the "
                "number of train ranks"
            )
        self.n_steps += 1
        self._profile_tick()
        self.batch = concat_shards(shards)
        mask = self.batch["loss_mask"]
        return {"n_seqs": int(mask.shape[0]), "n_tokens": int(self.batch["attention_mask"].sum())}

    def compute_logp(self) -> None:
        """Proximal log-probs: the current policy on the batch (before the update)."""
        self.batch["prox_logp"] = self.engine.compute_logp(self._need_batch())

    def compute_ref_logp(self) -> None:
        """Reference-model log-probs (only with actor.kl_ctl > 0)."""
        self.batch["ref_logp"] = self.engine.compute_ref_logp(self._need_batch())

    def compute_advantages(self) -> dict:
        """Advantages on the batch; returns reward statistics of this rank."""
        self.batch = self.engine.compute_advantages(self._need_batch())
        r = self.batch["rewards"]
        return {"reward_sum": float(r.sum()), "n_seqs": int(r.numel())}

    def ppo_update(self) -> dict:
        """The PPO update over the batch; returns this rank's statistics."""
        b = self._need_batch()
        stats = self.engine.ppo_update(b)
        mask = b["loss_mask"]
        stats["gen_len_mean"] = float(mask.sum(1).float().mean())
        return {k: float(v) if not math.isnan(float(v)) else "nan" for k, v in stats.items()}

    def arm_profile(self, step: int, path: str) -> None:
        """Record one whole step cycle with torch.profiler: from the ``step``-th `load_batch`
        (1-based) to the next one, weight sync and idle time included. The files are written
        by `write_profile`, called after the run, so that writing them costs no step time."""
        if step < 1:
            raise ValueError(f"the profiled step must be >= 1, got {step}")
        self._profile = (step, Path(path))

    def _profile_tick(self) -> None:
        if self._profile is None:
            return
        step, path = self._profile
        if self._profiler is not None and self.n_steps == step + 1:
            prof, self._profiler, self._profile = self._profiler, None, None
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)
            window = time.perf_counter() - self._profile_t0
            prof.stop()
            self._recorded = (prof, window, path)
        elif self._profiler is None and self.n_steps == step:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.engine.device.type == "cuda":
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=acts)
            self._profiler.start()
            self._profile_t0 = time.perf_counter()

    def write_profile(self) -> bool:
        """Write the recorded step cycle, if any (False if none was recorded): ``top_ops``
        (by self device time, or CPU time without a GPU), a Chrome ``trace`` and ``profile``
        (the window's wall seconds, device-busy seconds, kernels, host syncs, device
        allocations, op counts), each suffixed with this rank."""
        if self._recorded is None:
            return False
        prof, window, path = self._recorded
        self._recorded = None
        path.mkdir(parents=True, exist_ok=True)
        on_gpu = self.engine.device.type == "cuda"
        sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (path / f"top_ops_rank{self.rank}.txt").write_text(table)
        prof.export_chrome_trace(str(path / f"trace_rank{self.rank}.json"))
        summary = profile_summary(prof, window)
        (path / f"profile_rank{self.rank}.json").write_text(json.dumps(summary, indent=1))
        return True

    def end_step(self) -> None:
        """Drop the step's batch (the pulled shards are freed by the controller's fan-out)."""
        self.batch = None

    def _need_batch(self) -> dict[str, torch.Tensor]:
        if self.batch is None:
            raise RuntimeError("no batch loaded: call load_batch first")
        return self.batch

    # ---- weights (what the arl.weights plug-ins use: arl.protocol.weight_hooks.WeightSource)
    @property
    def weights_device(self) -> torch.device:
        """The device this rank's weights live on."""
        return self.engine.device

    def full_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) named weights in the sync dtype, yielded on rank 0; every rank must
        iterate to the end (collective gathers). With LoRA: the adapter's tensors only."""
        return self.engine.state_dict_for_sync(self.sync_dtype)

    def set_sync_dtype(self, dtype: str | None) -> None:
        """Send and checksum weights in the engines' dtype (e.g. bfloat16); None: as trained."""
        self.sync_dtype = None if dtype is None else parse_dtype(dtype)

    def weight_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """``(name, full shape, sync dtype)`` of every synced weight (with LoRA the adapter's),
        in state-dict order; no gathers."""
        return [
            (name, tuple(t.shape), self.sync_dtype or t.dtype)
            for name, t in self.engine.synced_state()
        ]

    def weight_sources(self) -> list[tuple[str, torch.Tensor]] | None:
        """The weights as trained (or, offloaded, their copy in the sync dtype), unsharded,
        without a gather (one rank only), else None."""
        return self.engine.weight_sources(self.sync_dtype)

    def tied_weights(self) -> dict[str, str]:
        """Tied weight names -> the first name of the same tensor (e.g. lm_head -> embed)."""
        return self.engine.tied_weights()

    def save_hf(self, path: str, merged: bool = False) -> None:
        """Write the weights as an HF folder (every rank calls; rank 0 writes), atomically; with
        LoRA the adapter (peft format), and with ``merged`` also ``merged/``, the base with the
        adapter merged in."""
        tmp, old = f"{path}.tmp", f"{path}.old"
        try:
            self.engine.save_hf(tmp, merged=merged)
            if self.rank == 0:
                if os.path.exists(path):  # this run's own earlier export of the step (a restart)
                    shutil.rmtree(old, ignore_errors=True)
                    os.replace(path, old)
                os.replace(tmp, path)
        except BaseException:  # e.g. a full disk: leave no half-written folder behind
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                if os.path.exists(old) and not os.path.exists(path):
                    os.replace(old, path)  # the earlier export back where it was
            raise
        if self.rank == 0:
            shutil.rmtree(old, ignore_errors=True)

    def weights_checksum(self) -> str:
        """Checksum of the synced weights (with LoRA the adapter's), comparable with an
        inference engine's."""
        return checksum_named_tensors(self.full_state())

    def score(self, token_ids: list[int], weights_dtype: str | None = None) -> list[float]:
        """Log-probs of ``token_ids[1:]`` under the current weights, each given the tokens
        before it (every rank calls it together: the sharded forward gathers). With
        ``weights_dtype`` the weights are first rounded to it, as an engine holding them in that
        dtype has them, and restored after."""
        model = self.engine.forward_model
        ids = torch.tensor([token_ids], device=self.engine.device)
        dtype = None if weights_dtype is None else parse_dtype(weights_dtype)
        with torch.no_grad(), _weights_rounded_to(model, dtype):
            logits = model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0].tolist()

    # ---- recovery ---------------------------------------------------------------------------
    def save_state(self, path: str) -> int:
        """This rank's trainable parameters, optimizer state and RNG states into ``path``, as
        data only (`arl.ckpt.rank_state`: safetensors, JSON, raw bytes); returns the bytes."""
        from arl.ckpt.rank_state import save_rank_state

        e = self.engine
        return save_rank_state(path, self.rank, e.world_size, e.model, e.optimizer)

    def load_state(self, path: str, step: int) -> None:
        """Restore what `save_state` wrote (in place: parameter tensors are never replaced),
        the optimizer step counter, and the forward copy's weights."""
        from arl.ckpt.rank_state import load_rank_state

        e = self.engine
        load_rank_state(path, self.rank, e.world_size, e.model, e.optimizer)
        e.set_step(step)
        e.sync_forward_weights()

    def get_step(self) -> int:
        """Optimizer steps taken."""
        return self.engine.get_step()

    def close(self) -> None:
        """Destroy the process group."""
        self.engine.destroy()


# Host-side calls that wait for the device (a .item(), .cpu() or .tolist() of a device tensor
# ends in one of these).
_HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profile_summary(prof: Any, window_s: float) -> dict:
    """Figures of one profiled window: device-busy seconds (kernel and copy time), kernels,
    host syncs, device allocations (cudaMalloc: the caching allocator grew), op counts."""
    from torch.autograd import DeviceType

    busy_us, kernels = 0.0, 0
    counts: dict[str, int] = {}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            busy_us += evt.time_range.elapsed_us()
            kernels += 1
        else:
            counts[evt.name] = counts.get(evt.name, 0) + 1
    return {
        "window_s": window_s,
        "device_busy_s": busy_us / 1e6,
        "kernels": kernels,
        "host_syncs": sum(counts.get(n, 0) for n in _HOST_SYNCS),
        "item_calls": counts.get("aten::_local_scalar_dense", 0),
        "device_mallocs": counts.get("cudaMalloc", 0),
        "top_counts": dict(sorted(counts.items(), key=lambda kv: -kv[1])[:25]),
    }
