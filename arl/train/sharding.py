"""Loading a HF causal LM as FSDP2 shards, and reading its DTensors back as plain tensors."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from arl.config import ActorConfig
from arl.train.logp import ChunkedLogpHead, register_varlen, transforms_logits


def compute_dtype(cfg: ActorConfig, device: torch.device) -> torch.dtype:
    """``actor.dtype``: bf16 on CUDA and fp32 elsewhere for ``auto``."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


def load_sharded(
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
    runs attention through the varlen attention of `register_varlen` (packed rows without
    masks); the output layer gets a `ChunkedLogpHead`; ``compile_layers`` compiles each
    decoder layer.
    """
    from transformers import AutoModelForCausalLM

    from arl.engines.model import resolve_model

    local = resolve_model(path)
    model = AutoModelForCausalLM.from_pretrained(
        local,
        dtype=torch.float32 if trainable else compute_dtype,
        attn_implementation=register_varlen() if varlen else "sdpa",
    )
    model.config.use_cache = False
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and not transforms_logits(model.config):
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


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (all-gathered: collective); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
