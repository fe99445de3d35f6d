"""One rank's mixed precision without FSDP: fp32 master weights beside a compute-dtype copy.

With one training rank there is nothing to shard, and FSDP2's per-pass hooks (gather, cast,
reduce) and DTensor dispatch cost host time that bounds a small model's step. What its mixed
precision policy does on one rank is kept here by hand: the optimizer steps the fp32 weights
of ``master``; every pass runs on ``forward``, a copy of the same module in the compute dtype;
after each backward the copy's gradients are added into the masters' in fp32 (FSDP2 reduces in
fp32 too), and after each optimizer step the masters are cast into the copy. The state dict,
the checkpoint and the weights sent to inference engines stay those of the fp32 masters.
"""

from __future__ import annotations

import copy

import torch


class MasterWeights:
    """The fp32 ``master`` module and its compute-dtype ``forward`` copy, parameter by name."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype) -> None:
        if any(p.dtype != torch.float32 for p in master.parameters()):
            raise ValueError("master weights must be float32")
        self.master = master
        self.forward = copy.deepcopy(master)
        with torch.no_grad():
            # Parameters only: buffers (rotary frequencies) keep their fp32, as FSDP2 keeps them.
            for p in self.forward.parameters():
                p.data = p.data.to(dtype)
        fwd = dict(self.forward.named_parameters())
        # named_parameters lists a tied weight once, under its first name, in both modules.
        self.pairs = [(p, fwd[name]) for name, p in master.named_parameters()]
        # (master grads, copy grads) as flat buffers once `hold_grads` was called, else None.
        self.flat: tuple[torch.Tensor, torch.Tensor] | None = None

    def accumulate_grads(self) -> None:
        """Add the copy's gradients into the masters' (fp32) and drop them from the copy: once
        held (`hold_grads`), one add and one zeroing over the flat buffers, else per parameter."""
        if self.flat is not None:
            master, copy_ = self.flat
            master.add_(copy_)
            copy_.zero_()
            return
        pairs = [(m, f) for m, f in self.pairs if f.grad is not None]
        for m, _ in pairs:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        if pairs:
            # Mixed dtypes: torch runs this as one kernel per parameter.
            torch._foreach_add_([m.grad for m, _ in pairs], [f.grad for _, f in pairs])
        for _, f in pairs:
            f.grad = None

    def hold_grads(self) -> None:
        """Zeroed gradients on every master and copy parameter that stay where they are (for
        CUDA graphs, which add into the same memory at every replay): views, in parameter order,
        of one flat fp32 buffer (``flat[0]``) and one flat buffer in the copy's dtype
        (``flat[1]``), so adding the copy's into the masters' and zeroing it are one kernel each
        instead of one per parameter. From then on gradients must be zeroed, never set to None."""
        if self.flat is not None:
            return
        align = 64  # elements: every view starts on a 256-byte boundary (vectorised access)
        sizes = [-(-m.numel() // align) * align for m, _ in self.pairs]
        dev, dtype = self.pairs[0][0].device, self.pairs[0][1].dtype
        master = torch.zeros(sum(sizes), dtype=torch.float32, device=dev)
        copy_ = torch.zeros(sum(sizes), dtype=dtype, device=dev)
        off = 0
        for (m, f), size in zip(self.pairs, sizes, strict=True):
            view_m = master[off : off + m.numel()].view_as(m)
            view_f = copy_[off : off + f.numel()].view_as(f)
            with torch.no_grad():
                if m.grad is not None:
                    view_m.copy_(m.grad)
                if f.grad is not None:
                    view_f.copy_(f.grad)
            m.grad, f.grad = view_m, view_f
            off += size
        self.flat = (master, copy_)

    def zero_grads(self) -> None:
        """Clear the copy's gradients: zeroed in place once held (`hold_grads`), else freed."""
        if self.flat is not None:
            self.flat[1].zero_()
        else:
            for _, f in self.pairs:
                f.grad = None

    def publish(self) -> None:
        """Cast the masters into the copy (after an optimizer step or a checkpoint load)."""
        with torch.no_grad():
            torch._foreach_copy_([f for _, f in self.pairs], [m for m, _ in self.pairs])
