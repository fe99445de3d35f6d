"""One train rank's recovery state as data, never code: safetensors, JSON and raw bytes.

torch.distributed.checkpoint keeps its ``.metadata`` as a pickle, so a tampered run directory
could run code on resume; nothing here is unpickled. Each rank writes, into the checkpoint's
``model/`` folder:

- ``params-rank<R>.safetensors``: this rank's local shards of the *trainable* parameters
  (``requires_grad``) by name. The frozen weights come from ``actor.path`` again (with LoRA
  only the adapters train, so only they are saved).
- ``optim-rank<R>.safetensors``: the optimizer's state tensors, named ``<param>/<key>``
  (``exp_avg``, ``exp_avg_sq``, ``step``), local shards like the parameters.
- ``rank<R>.json``: the format, world size and rank, each tensor's shape and dtype, the
  optimizer's non-tensor state and hyper-parameters (``param_groups``, by parameter name).
- ``rng-rank<R>.bin`` (and ``rng-cuda-rank<R>.bin``): the generators' states as raw bytes.

Loading copies into the existing tensors in place (``param.data.copy_``): CUDA graphs and the
forward copy's views hold the parameter tensors, so they are never replaced; values reach the
parameter's own device (with optimizer offload the masters live on the CPU). A checkpoint of
another world size, of other parameters, or in the old DCP format is refused with a message.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "arl-rank-state-1"


class RankStateError(RuntimeError):
    """A rank state cannot be loaded into this rank (format, world size or parameters differ)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def trainable(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of every parameter that trains, in module order (tied ones once)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _json_value(v: Any) -> Any:
    """A param-group value as JSON: tensors (a capturable lr) as floats, tuples as lists."""
    if isinstance(v, torch.Tensor):
        return v.item()
    if isinstance(v, tuple | list):
        return [_json_value(x) for x in v]
    return v if v is None or isinstance(v, bool | int | float | str) else None


def save_rank_state(
    folder: str | Path, rank: int, world_size: int, model: torch.nn.Module, optimizer: Any
) -> int:
    """Write this rank's trainable parameters, optimizer state and RNG states into ``folder``;
    returns the bytes written. Refuses to start (ENOSPC naming both sizes) when the folder's
    filesystem has less free space than the tensors need."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    params = trainable(model)
    names = {id(p): n for n, p in params}
    optim: dict[str, torch.Tensor] = {}  # this rank's local tensors, where they live
    scalars: dict[str, dict[str, Any]] = {}
    for p, state in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            continue
        for key, v in state.items():
            if isinstance(v, torch.Tensor):
                optim[f"{name}/{key}"] = _local(v).detach()
            else:
                scalars.setdefault(name, {})[key] = _json_value(v)
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: _json_value(v) for k, v in g.items() if k != "params"}
        hyper["params"] = [names[id(p)] for p in g["params"] if id(p) in names]
        groups.append(hyper)
    local = {n: _local(p).detach() for n, p in params}
    need = sum(t.numel() * t.element_size() for t in (*local.values(), *optim.values()))
    free = shutil.disk_usage(folder).free
    if free < need + 2**20:
        raise OSError(
            errno.ENOSPC,
            f"no space left on device: rank {rank}'s recovery state needs {need:,} bytes and "
            f"{free:,} are free on the filesystem of {folder}",
        )
    shapes = {n: [list(t.shape), str(t.dtype)] for n, t in local.items()}
    # One file at a time, staged in host memory (no copy of what already lives there, as
    # offloaded masters do): the peak is the larger file, not both.
    for stem, tensors in (("params", local), ("optim", optim)):
        save_file(_on_host(tensors), str(folder / f"{stem}-rank{rank}.safetensors"))
    rng = {"rng-rank": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["rng-cuda-rank"] = torch.cuda.get_rng_state()
    for stem, state in rng.items():
        _write_synced(folder / f"{stem}{rank}.bin", state.numpy().tobytes())
    meta = {
        "format": FORMAT,
        "rank": rank,
        "world_size": world_size,
        "params": shapes,
        "optim_scalars": scalars,
        "param_groups": groups,
    }
    _write_synced(folder / f"rank{rank}.json", json.dumps(meta))
    for name in (f"params-rank{rank}.safetensors", f"optim-rank{rank}.safetensors"):
        _fsync_file(folder / name)
    return need


def _on_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` in host memory, contiguous: device ones copied, host ones as they are
    unless they are views into a larger buffer (safetensors refuses shared storage)."""
    out = {}
    for n, t in tensors.items():
        t = t.cpu()
        if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.contiguous().clone()
        out[n] = t
    return out


def check_format(folder: str | Path, world_size: int | None = None, rank: int = 0) -> None:
    """Raise `RankStateError` unless ``folder`` holds ``rank``'s state in this format (and,
    given ``world_size``, of that many ranks); reads JSON only."""
    folder = Path(folder)
    if (folder / ".metadata").exists() or not (folder / f"rank{rank}.json").exists():
        raise RankStateError(
            f"{folder} is not a recovery state this arl can load: it was written by an older "
            "arl through torch.distributed.checkpoint, whose metadata is a pickle that could "
            "run code, so it is not read. Start afresh with experiment.overwrite=true (the old "
            "run is moved aside) or a new experiment.trial"
        )
    meta = _read_meta(folder, rank)
    saved = int(meta.get("world_size", -1))
    if world_size is not None and saved != world_size:
        raise RankStateError(
            f"{folder} holds the state of {saved} train ranks, this run has {world_size}; each "
            "rank loads its own shards, so resume with the same actor.backend (fsdp:d"
            f"{saved}), or start afresh with experiment.overwrite=true"
        )


def _read_meta(folder: Path, rank: int) -> dict:
    path = folder / f"rank{rank}.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise RankStateError(f"cannot read {path}: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise RankStateError(f"{path} is not in the {FORMAT} format")
    return meta


def load_rank_state(
    folder: str | Path, rank: int, world_size: int, model: torch.nn.Module, optimizer: Any
) -> None:
    """Copy what `save_rank_state` wrote into ``model``'s trainable parameters (in place, on
    their own devices), ``optimizer``'s state and the RNGs; raises `RankStateError` naming
    what differs."""
    folder = Path(folder)
    check_format(folder, world_size, rank)
    meta = _read_meta(folder, rank)
    params = trainable(model)
    have = {n for n, _ in params}
    saved = set(meta["params"])
    if have != saved:
        raise RankStateError(
            f"{folder} holds other trainable parameters than this model: only in the "
            f"checkpoint {sorted(saved - have)[:5]}, only in the model {sorted(have - saved)[:5]} "
            "(a different model or LoRA setting); resume with the run's own actor settings"
        )
    tensors = load_file(str(folder / f"params-rank{rank}.safetensors"))
    with torch.no_grad():
        for name, p in params:
            dst, src = _local(p), tensors[name]
            if tuple(dst.shape) != tuple(src.shape):
                raise RankStateError(
                    f"{folder}: parameter {name} has shape {tuple(src.shape)} in the "
                    f"checkpoint and {tuple(dst.shape)} here; resume with the same model"
                )
            dst.copy_(src)
    _load_optimizer(folder, rank, meta, params, optimizer)
    rng = folder / f"rng-rank{rank}.bin"
    torch.set_rng_state(torch.frombuffer(bytearray(rng.read_bytes()), dtype=torch.uint8))
    cuda_rng = folder / f"rng-cuda-rank{rank}.bin"
    if cuda_rng.exists() and torch.cuda.is_available():
        state = torch.frombuffer(bytearray(cuda_rng.read_bytes()), dtype=torch.uint8)
        torch.cuda.set_rng_state(state)


def _load_optimizer(
    folder: Path, rank: int, meta: dict, params: list[tuple[str, torch.Tensor]], optimizer: Any
) -> None:
    """Rebuild the optimizer's state dict from the files and hand it to ``load_state_dict``,
    which keeps the parameters and moves each state value to its parameter's device (a fused
    optimizer's ``step`` too). Sharded parameters get sharded state: the local values are
    copied into a ``zeros_like`` of the parameter."""
    flat = load_file(str(folder / f"optim-rank{rank}.safetensors"))
    by_name = dict(params)
    name_of = {id(p): n for n, p in params}
    index: dict[str, int] = {}
    groups = []
    n = 0
    for g in optimizer.param_groups:
        ids = []
        for p in g["params"]:  # frozen parameters handed to the optimizer keep no state
            if id(p) in name_of:
                index[name_of[id(p)]] = n
            ids.append(n)
            n += 1
        groups.append(ids)
    if len(meta["param_groups"]) != len(groups):
        raise RankStateError(f"{folder}: the optimizer has another number of parameter groups")
    unknown = sorted({k.rpartition("/")[0] for k in flat} | set(meta["optim_scalars"]))
    unknown = [n for n in unknown if n not in index]
    if unknown:
        raise RankStateError(
            f"{folder}: optimizer state for parameters this optimizer does not step: "
            f"{unknown[:5]}; resume with the run's own model and actor settings"
        )
    state: dict[int, dict[str, Any]] = {}
    for key, t in flat.items():
        name, _, field = key.rpartition("/")
        p = by_name[name]
        if t.dim() == 0:
            value = t.clone()
        else:
            value = torch.zeros_like(p, dtype=t.dtype)
            _local(value).copy_(t)
        state.setdefault(index[name], {})[field] = value
    for name, values in meta["optim_scalars"].items():
        state.setdefault(index[name], {}).update(values)
    saved_groups = []
    for hyper, ids in zip(meta["param_groups"], groups, strict=True):
        g = {k: v for k, v in hyper.items() if k != "params"}
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
        saved_groups.append({**g, "params": ids})
    optimizer.load_state_dict({"state": state, "param_groups": saved_groups})


def _write_synced(path: Path, data: str | bytes) -> None:
    with open(path, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
