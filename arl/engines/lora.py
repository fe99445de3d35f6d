"""LoRA adapters as the trainer and the hf engine both build them.

Both sides inject the same peft `LoraConfig` (from ``actor.lora``) into a loaded HF causal LM
with peft's `inject_adapter_in_model`, under the adapter name `ADAPTER`. The adapter's tensors
are then named alike on both sides (``model.layers.0.self_attn.q_proj.lora_A.default.weight``),
so a weight sync of a LoRA policy is a sync of those names alone, in every mode that moves
named tensors, and the engine computes exactly what the trainer's forward does (base + the
adapter's own path, never a merged approximation).

On disk an adapter is written in peft's format (`save_adapter`: ``adapter_config.json`` and
``adapter_model.safetensors`` with peft's ``base_model.model.`` names and no adapter name),
which peft, vLLM and SGLang load by path.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"
_PEFT_PREFIX = "base_model.model."


def lora_enabled(lora: Mapping[str, Any] | None) -> bool:
    """Whether ``lora`` (``actor.lora`` as a dict) asks for adapters (rank > 0)."""
    return bool(lora) and int(lora.get("rank", 0)) > 0


def lora_config(lora: Mapping[str, Any]) -> Any:
    """The peft `LoraConfig` of ``actor.lora`` (as a dict: rank, alpha, dropout,
    target_modules; ``["all-linear"]`` becomes peft's ``"all-linear"``)."""
    from peft import LoraConfig

    targets = list(lora.get("target_modules") or ["all-linear"])
    return LoraConfig(
        r=int(lora["rank"]),
        lora_alpha=float(lora.get("alpha", 2 * int(lora["rank"]))),
        lora_dropout=float(lora.get("dropout", 0.0)),
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        bias="none",
    )


def add_lora(model: torch.nn.Module, lora: Mapping[str, Any]) -> torch.nn.Module:
    """Inject ``lora``'s adapters into ``model`` in place (peft initialises A randomly and B to
    zero, so the model's output is unchanged); only the adapter's parameters keep
    ``requires_grad``. Returns the model."""
    from peft import inject_adapter_in_model

    model = inject_adapter_in_model(lora_config(lora), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_name(name))
    return model


def is_lora_name(name: str) -> bool:
    """Whether a parameter name belongs to a LoRA adapter (its A or B matrix)."""
    return ".lora_A." in name or ".lora_B." in name


def lora_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The adapter's tensors of ``model`` by state-dict name, in state-dict order."""
    return [(n, t) for n, t in model.state_dict().items() if is_lora_name(n)]


def to_peft_name(name: str) -> str:
    """A state-dict name (``model.layers.0...lora_A.default.weight``) as peft saves it
    (``base_model.model.model.layers.0...lora_A.weight``)."""
    return _PEFT_PREFIX + name.replace(f".{ADAPTER}.", ".")


def from_peft_name(name: str) -> str:
    """The inverse of `to_peft_name`."""
    if not name.startswith(_PEFT_PREFIX):
        raise ValueError(f"{name!r} is not a peft adapter tensor name (no {_PEFT_PREFIX!r})")
    body = name[len(_PEFT_PREFIX) :]
    for part in (".lora_A.", ".lora_B."):
        body = body.replace(part, f"{part}{ADAPTER}.")
    return body


def save_adapter(
    path: str | Path,
    named: Iterable[tuple[str, torch.Tensor]],
    lora: Mapping[str, Any],
    base_model: str = "",
) -> Path:
    """Write an adapter in peft's format into the folder ``path`` (created)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {to_peft_name(n): t.detach().cpu().contiguous() for n, t in named}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    cfg = lora_config(lora)
    cfg.base_model_name_or_path = base_model or None
    cfg.save_pretrained(str(out))
    return out


def load_adapter(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The adapter tensors of a peft folder by state-dict name, and its config as a dict."""
    from safetensors.torch import load_file

    folder = Path(path)
    raw = load_file(str(folder / "adapter_model.safetensors"))
    config = json.loads((folder / "adapter_config.json").read_text())
    return {from_peft_name(n): t for n, t in raw.items()}, config
