"""Loading a HF causal LM for training (FSDP2 shards on several ranks, whole on one), and reading
DTensors back as plain tensors."""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from arl.config import ActorConfig
from arl.precompile import kept_counts, precompiled
from arl.train.logp import ChunkedLogpHead, chunk_kernels, register_varlen, transforms_logits
from arl.train.lora import compute_adapters_in, inject_adapters
from arl.train.master import MasterWeights
from arl.train.offload import HostMasterWeights
from arl.transformers_imports import prepare_transformers_import

# torch's own guard code reads ``.grad`` of the tensors a compiled layer takes, and a tensor that
# is not a leaf makes that read warn (seen with torch 2.11 on CUDA, once a rank compiles its layers
# for a one-rank bf16 update): a line in every GPU run's log about torch's access, which nothing a
# user does can change.
warnings.filterwarnings(
    "ignore",
    message=r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed",
    category=UserWarning,
    module=r"torch\._dynamo\.guards",
)


def compute_dtype(cfg: ActorConfig, device: torch.device) -> torch.dtype:
    """``actor.dtype``: bf16 on CUDA and fp32 elsewhere for ``auto``."""
    if cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


class LoadedModel(NamedTuple):
    """A loaded model: ``model`` holds the weights the optimizer steps and checkpoints save;
    passes run on ``forward``, which is ``model`` itself, or with one rank in mixed precision
    its compute-dtype copy kept by ``master`` (on the host with optimizer offload)."""

    model: torch.nn.Module
    forward: torch.nn.Module
    master: MasterWeights | HostMasterWeights | None


def load_sharded(
    path: str,
    mesh: DeviceMesh,
    compute_dtype: torch.dtype,
    *,
    trainable: bool,
    gradient_checkpointing: bool,
    varlen: bool = False,
    compile_layers: bool = False,
    lora: Mapping[str, Any] | None = None,
    offload: bool = False,
) -> LoadedModel:
    """Load a HF causal LM for ``mesh``: on more than one rank sharded with FSDP2 (each decoder
    layer and the root); on one rank whole, on the mesh's device.

    The trainable model keeps fp32 master weights and computes in ``compute_dtype`` with fp32
    gradient reduction (FSDP2's mixed precision; on one rank `MasterWeights`); the frozen
    reference is loaded directly in ``compute_dtype``. ``varlen`` runs attention through the
    varlen attention of `register_varlen` (packed rows without masks); the output layer gets a
    `ChunkedLogpHead`; ``compile_layers`` compiles each decoder layer. ``offload`` (trainable
    only) keeps the fp32 weights and optimizer state in host memory: on one rank as
    `HostMasterWeights`, with FSDP2 through its ``CPUOffloadPolicy``.

    With ``lora`` (``actor.lora`` as a dict, rank > 0) a trainable model is its frozen base in
    ``compute_dtype`` plus fp32 adapters (`arl.train.lora`), injected before FSDP wraps the
    layers; one rank keeps no master copy (``forward`` is ``model``) and runs the adapters in
    ``compute_dtype`` itself.
    """
    prepare_transformers_import()  # before transformers' first import
    from transformers import AutoModelForCausalLM

    from arl.engines.model import resolve_model

    local = resolve_model(path)
    masters = trainable and lora is None  # fp32 weights that the optimizer steps
    model = AutoModelForCausalLM.from_pretrained(
        local,
        dtype=torch.float32 if masters else compute_dtype,
        attn_implementation=register_varlen() if varlen else "sdpa",
    )
    model.config.use_cache = False
    if trainable and lora is not None:
        inject_adapters(model, lora)
    if not trainable:
        model.requires_grad_(False)
        model.eval()
    one_rank = mesh.size() == 1
    master = None
    offload = offload and trainable
    if one_rank:
        device = mesh.device_type
        device = torch.device(device, torch.cuda.current_device()) if device == "cuda" else device
        # Offloaded, the fp32 model stays on the host; only its copy goes to the device.
        if offload and masters:
            master = HostMasterWeights(model, compute_dtype, torch.device(device))
        else:
            model.to(device)
        if masters and compute_dtype != torch.float32 and not offload:
            master = MasterWeights(model, compute_dtype)
        if trainable and lora is not None and compute_dtype != torch.float32:
            compute_adapters_in(model, compute_dtype)
    forward = master.forward if master is not None else model
    head = forward.get_output_embeddings()
    if isinstance(head, torch.nn.Linear) and not transforms_logits(forward.config):
        # ~1 GiB of fp32 logits per chunk at most, whatever the vocabulary.
        ChunkedLogpHead(head, max(256, (1 << 28) // head.out_features))
    if gradient_checkpointing and trainable:
        forward.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False}
        )
    # HF lists its decoder-layer classes in _no_split_modules: one FSDP unit per layer bounds
    # the all-gathered memory to one layer at a time.
    layer_names = set(getattr(forward, "_no_split_modules", None) or [])
    layers = [m for m in forward.modules() if type(m).__name__ in layer_names]
    if not layers:
        raise RuntimeError(
            f"found no decoder layers in {type(forward).__name__} (its _no_split_modules is "
            f"{sorted(layer_names)}); FSDP needs a HF causal LM with per-layer modules"
        )
    mp = None
    if compute_dtype != torch.float32 and trainable:
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    kwargs = {"mesh": mesh} | ({"mp_policy": mp} if mp is not None else {})
    if offload:  # pinned where there is a device to copy to
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    for layer in layers:
        if not one_rank:
            fully_shard(layer, **kwargs)
    if compile_layers:
        compile_forwards(layers, checkpointing=gradient_checkpointing and trainable)
    if not one_rank:
        fully_shard(model, **kwargs)
    return LoadedModel(model, forward, master)


def compile_forwards(layers: list[torch.nn.Module], checkpointing: bool = False) -> None:
    """Compile each decoder layer's forward: per layer, not the whole model, so that FSDP's
    hooks stay outside the compiled region, and one compiled function per layer class, shared
    by its layers (they differ only in the weights ``self`` holds; token counts dynamic).

    It is kept under ``ARL_CACHE`` (`arl.precompile`, the class's source file in the key), so a
    later run loads it rather than tracing it. torch cannot load back a function that holds the
    one it wraps, so the model's own forward is compiled, under the wrappers that do nothing
    here: transformers' ``deprecate_kwarg`` (it accepts an old keyword name, which the model's
    own calls do not use) and, with ``checkpointing`` off, its gradient-checkpointing wrapper
    (which then only calls it). Behind any other wrapper the forward is compiled as
    ``torch.compile`` always did, and so where this path fails."""
    kept: dict[Any, Any] = {}
    options = layer_compile_options()
    for layer in layers:
        fn = _own_forward(type(layer).forward, checkpointing)
        if fn not in kept:
            if hasattr(fn, "__wrapped__"):
                kept[fn] = torch.compile(fn, dynamic=True, options=options)
            else:
                name = "train.layer." + fn.__qualname__.split(".")[0]
                kept[fn] = precompiled(fn, name=name, dynamic=True, options=options)
        layer.forward = types.MethodType(kept[fn], layer)
        layer._arl_compiled_forward = True


def layer_compile_options() -> dict[str, Any] | None:
    """Inductor settings for the decoder layers. Its mix-order reduction (RMSNorm's backward:
    the reduction over the hidden size fused with the weight gradient's over the tokens) is
    applied only from 5 Mi elements on, a guard on the token count: a layer compiled on small
    batches compiled again at the first micro-batch above ~9k tokens (SmolLM2-135M; ~5 s on an
    H100, within the first step). Its non-strict mode skips those size checks, so one
    compilation serves every token count. None where this torch has no such setting."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "mix_order_reduction_non_strict_mode"):
        return None
    return {"triton.mix_order_reduction_non_strict_mode": True}


# (file, function name) of the wrappers `_own_forward` takes off: transformers' deprecate_kwarg
# always, its gradient-checkpointing wrapper where checkpointing is off.
_RENAMING = (os.path.join("transformers", "utils", "deprecation.py"), None)
_CHECKPOINTING = (os.path.join("transformers", "modeling_layers.py"), "forward_with_checkpointing")


def _own_forward(fn: Any, checkpointing: bool) -> Any:
    """``fn`` without the wrappers that do nothing in a training pass (`compile_forwards`)."""
    idle = [_RENAMING] + ([] if checkpointing else [_CHECKPOINTING])
    while hasattr(fn, "__wrapped__") and any(
        fn.__code__.co_filename.endswith(path) and name in (None, fn.__code__.co_name)
        for path, name in idle
    ):
        fn = fn.__wrapped__
    return fn


def kept_functions(model: torch.nn.Module, device: torch.device) -> tuple[int, int]:
    """The compiled functions of a train rank kept under ``ARL_CACHE`` (`arl.precompile`): its
    layers' and, on CUDA, the log-prob head's; how many were loaded from it and how many
    compiled into it, in this process so far."""
    fns = {m.forward.__func__ for m in model.modules() if m.__dict__.get("_arl_compiled_forward")}
    if device.type == "cuda":
        fns |= {getattr(k, "kept", None) for k in chunk_kernels(device)}
    return kept_counts(fns)


def compiled_layers(model: torch.nn.Module) -> int:
    """How many modules of ``model`` run compiled (`compile_forwards`, or ``nn.Module.compile``)."""
    return sum(
        bool(m.__dict__.get("_arl_compiled_forward"))
        or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )


def uncompile_layers(model: torch.nn.Module) -> int:
    """Run every module of ``model`` that `load_sharded` compiled eagerly again (the compiled
    forward of `compile_forwards` removed, what ``nn.Module.compile`` set cleared); returns how
    many there were."""
    n = 0
    for m in model.modules():
        if m.__dict__.pop("_arl_compiled_forward", False):
            del m.forward
            n += 1
        elif getattr(m, "_compiled_call_impl", None) is not None:
            m._compiled_call_impl = None
            n += 1
    return n


def compile_failed(err: BaseException) -> bool:
    """Whether ``err`` is torch.compile's failure to compile (Dynamo or Inductor), as opposed
    to an error of the computation itself (out of memory, a bad input)."""
    from torch._dynamo.exc import TorchDynamoException

    try:
        from torch._inductor.exc import InductorError
    except ImportError:  # older torch wraps Inductor's errors in Dynamo's
        InductorError = TorchDynamoException  # noqa: N806
    return isinstance(err, TorchDynamoException | InductorError)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (all-gathered: collective); a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication); a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t
