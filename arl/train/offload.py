"""Optimizer offload on one rank (``actor.offload=optimizer``): the fp32 master weights and the
AdamW state in host memory; the GPU keeps only the compute-dtype copy
that every pass runs on.

A full fine-tune in mixed precision holds 16 bytes a parameter beside its 2-byte forward copy
(4 fp32 masters, 4 fp32 gradients, 8 AdamW moments): 122 GB for a 7B model, more than a GPU
that also hosts the inference engine has. Here, per optimizer step:

1. backward adds the copy's gradients into one flat fp32 buffer on the GPU (as
   `arl.train.master.MasterWeights.hold_grads` does), allocated for the train phase only;
2. the global norm is taken on the GPU and the sums clipped there (`clip`);
3. `step` streams the parameters chunk by chunk (at most `_CHUNK` elements, whole tensors):
   the chunk's clipped sums are copied into one of two pinned host buffers (4 bytes a
   parameter over PCIe, the next chunk's copy queued while this one steps), AdamW steps the
   chunk's host masters (one parameter group per chunk; ``torch.optim.AdamW(fused=True)`` on
   the CPU, measured on a 2-core machine, 104 M parameters: fused 0.06-0.07 s a step, foreach
   0.14-0.37 s), and the updated masters are cast through two pinned compute-dtype buckets
   and copied into the forward copy without blocking. The host never holds the whole model's
   gradients: 12 bytes a parameter (masters and moments) plus the fixed buffers, which is what
   lets a 7B model's state (91 GB) fit a 128 GB host;
4. passes queued after the last copy on the same stream see the new weights.

The forward copy is exactly the masters rounded to the compute dtype, so a weight sync in that
dtype reads it (already on the GPU) instead of the host masters. ``master`` stays the module
that the optimizer steps and checkpoints read and write in place (on the CPU).
"""

from __future__ import annotations

import copy
import math

import torch

_ALIGN = 64  # elements: every view of a flat buffer starts on a 256-byte boundary
_BUCKET = 1 << 26  # elements of one staging bucket
_CHUNK = 1 << 28  # elements of one streamed optimizer chunk (1 GiB of fp32 gradients)


class HostMasterWeights:
    """The fp32 ``master`` module in host memory and its compute-dtype ``forward`` copy on
    ``device``, parameter by name; the interface of `MasterWeights` plus `param_groups`,
    `clip` and `step` (the optimizer step, streamed chunk by chunk)."""

    def __init__(
        self,
        master: torch.nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        bucket_elements: int = _BUCKET,
        chunk_elements: int = _CHUNK,
    ) -> None:
        if any(p.dtype != torch.float32 or p.device.type != "cpu" for p in master.parameters()):
            raise ValueError("offloaded master weights must be float32 on the CPU")
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        # The masters are not pinned: every transfer goes through the pinned buffers below, and
        # pinning tensor by tensor rounds each up to a power of two in torch's host allocator
        # (at 7B: ~55 GB pinned for 30.5 GB of masters, which with AdamW's 61 GB ran the host
        # out of memory on a 125 GB machine; the trainer died mid-step).
        with torch.no_grad():
            # The copy is built tensor by tensor on the device (deepcopy's memo supplies each
            # parameter), never as a second fp32 model; tied weights stay tied.
            memo = {
                id(p): torch.nn.Parameter(
                    p.detach().to(device=self.device, dtype=dtype, copy=True),
                    requires_grad=p.requires_grad,
                )
                for p in master.parameters()
            }
        self.master = master
        self.forward = copy.deepcopy(master, memo).to(self.device)
        fwd = dict(self.forward.named_parameters())
        self.pairs = [(p, fwd[name]) for name, p in master.named_parameters()]
        sizes = [-(-m.numel() // _ALIGN) * _ALIGN for m, _ in self.pairs]
        self._offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self._numel = sum(sizes)
        # Chunks of whole parameters, in order, each at most chunk_elements (or one tensor).
        self.chunks: list[list[int]] = []
        size = 0
        for i, s in enumerate(sizes):
            if not self.chunks or size + s > chunk_elements:
                self.chunks.append([])
                size = 0
            self.chunks[-1].append(i)
            size += s
        largest = max((sum(sizes[i] for i in c) for c in self.chunks), default=0)
        self._host_grads = [
            torch.zeros(largest, dtype=torch.float32, pin_memory=pin) for _ in range(2)
        ]
        self._grads_in: list[torch.cuda.Event | None] = [None, None]
        bucket = min(bucket_elements, self._numel)
        self._buckets = [torch.empty(bucket, dtype=dtype, pin_memory=pin) for _ in range(2)]
        # Per bucket, the copy out of it last queued (CUDA), which must end before a refill.
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0  # the staging bucket the next cast goes into
        # The fp32 gradient sums on the device, and their views: only during a train phase.
        self._sums: torch.Tensor | None = None
        self._sum_views: list[torch.Tensor] = []

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [
            flat[off : off + m.numel()].view_as(m)
            for (m, _), off in zip(self.pairs, self._offsets, strict=True)
        ]

    def accumulate_grads(self) -> None:
        """Add the copy's gradients into the fp32 sums on the device and drop them."""
        if self._sums is None:
            self._sums = torch.zeros(self._numel, dtype=torch.float32, device=self.device)
            self._sum_views = self._views(self._sums)
        grads = [(s, f.grad) for s, (_, f) in zip(self._sum_views, self.pairs, strict=True)]
        grads = [(s, g) for s, g in grads if g is not None]
        if grads:
            # Mixed dtypes: torch runs this as one kernel per parameter.
            torch._foreach_add_([s for s, _ in grads], [g for _, g in grads])
        for _, f in self.pairs:
            f.grad = None

    def param_groups(self) -> list[dict]:
        """One optimizer parameter group per chunk of `step`, in order (the masters)."""
        return [{"params": [self.pairs[i][0] for i in chunk]} for chunk in self.chunks]

    def clip(self, max_norm: float) -> float:
        """The global L2 norm of the summed gradients, taken on the device; when finite, the
        sums are clipped to ``max_norm`` there (torch's rule: times min(1, max_norm / (norm +
        1e-6))). Returns the norm."""
        if self._sums is None:
            return 0.0
        norm = float(torch.linalg.vector_norm(self._sums))  # the alignment padding is zeros
        if math.isfinite(norm):
            coef = max_norm / (norm + 1e-6)
            if coef < 1.0:
                self._sums.mul_(coef)
        return norm

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer step of the host masters, chunk by chunk (``optimizer``'s parameter
        groups are `param_groups`): each chunk's clipped gradient sums go to a pinned host
        buffer (the next chunk's copy queued before this one steps), the chunk's group steps,
        and its masters are published into the forward copy. No-op without gradients."""
        if self._sums is None:
            return
        if len(optimizer.param_groups) != len(self.chunks):
            raise ValueError(
                f"the offloaded optimizer needs one parameter group per chunk "
                f"({len(self.chunks)}), got {len(optimizer.param_groups)}"
            )
        groups = optimizer.param_groups
        self._fetch(0)
        try:
            for c, chunk in enumerate(self.chunks):
                if c + 1 < len(self.chunks):
                    self._fetch(c + 1)
                if self._grads_in[c % 2] is not None:
                    self._grads_in[c % 2].synchronize()
                optimizer.param_groups = [groups[c]]
                optimizer.step()
                for i in chunk:
                    self.pairs[i][0].grad = None
                self._publish([self.pairs[i] for i in chunk])
        finally:
            optimizer.param_groups = groups

    def _fetch(self, c: int) -> None:
        """Queue the copy of chunk ``c``'s gradient sums into host buffer ``c % 2`` and point
        the chunk's masters' gradients at it."""
        buf, off = self._host_grads[c % 2], 0
        for i in self.chunks[c]:
            m = self.pairs[i][0]
            view = buf[off : off + m.numel()].view_as(m)
            view.copy_(self._sum_views[i], non_blocking=True)
            m.grad = view
            off += -(-m.numel() // _ALIGN) * _ALIGN
        if self.device.type == "cuda":
            self._grads_in[c % 2] = torch.cuda.Event()
            self._grads_in[c % 2].record()

    def zero_grads(self) -> None:
        """Drop the copy's gradients and give the device's fp32 sums back (the memory plan
        counts them for the train phase only; an engine sleeping beside may take it)."""
        for _, f in self.pairs:
            f.grad = None
        if self._sums is not None:
            self._sums, self._sum_views = None, []
            if self.device.type == "cuda":
                torch.cuda.empty_cache()

    def publish(self) -> None:
        """Cast the masters into the forward copy (after a checkpoint load; `step` publishes
        each chunk it steps)."""
        self._publish(self.pairs)

    def _publish(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Cast ``pairs``' masters into their copies chunk by chunk of at most a bucket, cast on
        the host into the two pinned buckets in turn, each copied to the device without
        blocking."""
        cuda = self.device.type == "cuda"
        turn = self._turn
        with torch.no_grad():
            for m, f in pairs:
                src, dst = m.detach().view(-1), f.detach().view(-1)
                for start in range(0, src.numel(), len(self._buckets[0])):
                    n = min(len(self._buckets[0]), src.numel() - start)
                    done = self._copied[turn]
                    if done is not None:
                        done.synchronize()  # its previous copy has left this bucket
                    staged = self._buckets[turn][:n]
                    staged.copy_(src[start : start + n])
                    dst[start : start + n].copy_(staged, non_blocking=True)
                    if cuda:
                        self._copied[turn] = torch.cuda.Event()
                        self._copied[turn].record()
                    turn = 1 - turn
        self._turn = turn
