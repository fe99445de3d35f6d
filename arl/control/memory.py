"""The memory plan: what each GPU of the placement plan holds, part by part, and whether it fits.

With P the model's parameters, T the trained ones (P; with LoRA the adapters' A), w the train
ranks, e / c the bytes of the engine's / trainer's dtype (2 for bf16, the default on CUDA):

===============  ======================================================================
engine weights   P x e (/ tp of a server replica)
KV cache         rows x positions x layers x 2 x kv_heads x head_dim x e, rows and positions
                 as `arl.engines.spec.engine_sizing` sizes an engine: rows = min(1024,
                 ceil(concurrent groups x n_samples / engines)), positions = max(2048,
                 prompt + new tokens + 1)
trainer weights  one rank, full fine-tune in 16-bit: 4P fp32 masters + cP copy; LoRA: cP base +
                 4A adapters; FSDP: 4P / w (+ two gathered layers in the train phase)
gradients        4T fp32 (+ cT of the 16-bit copy's, held between steps with CUDA graphs)
optimizer        8T: AdamW's two fp32 moments
activations      `activation_bytes_per_token` x the tokens of a micro-batch (actor
                 .max_tokens_per_mb, else the longest row: the least the trainer takes)
sync buffer      P x e (A x e with LoRA), on train rank 0's GPU with weight_sync ipc_buffer
reserve          2 GB per process: CUDA context with torch's kernels (~0.5-1 GB), cuBLAS and
                 NCCL workspaces, the engine's decode-graph pool, allocator fragmentation;
                 the trainer 1 GB more for its log-prob head's fp32 logits chunk (~1 GiB)
===============  ======================================================================

``actor.offload=optimizer`` moves the fp32 masters, the optimizer state and the gradients'
fp32 sums to host memory (`arl.train.offload`): one rank keeps its 16-bit forward copy and,
during the train phase only, its gradients on the GPU; the host holds 4P + 8P and the
gradients of at most two 1 GiB chunks, streamed through the optimizer step (and two 0.27 GB
staging buckets, not counted). ``rollout.gpu_sharing=sleep`` frees an engine's KV
cache (and for a full fine-tune its weights) while the ranks train, so a shared GPU's peak is
the larger of the rollout and train phases instead of their sum. A GPU fits when its peak is within
``cluster.gpu_memory_gb`` (none: the bytes CUDA can allocate on the device, `arl.control.gpus`,
or 80 GB assumed where no GPU is visible). A plan that does not fit is refused (`check_memory`)
with the first change, in order of least change, under which it would.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from arl.config import Config, ConfigError, apply_overrides
from arl.config.tree import get_key
from arl.control.gpus import gpu_memory
from arl.engines.spec import engine_sizing
from arl.train.activations import activation_bytes_per_token

if TYPE_CHECKING:
    from arl.protocol.plan import NodeSpec, Plan

# Elements of one chunk of `arl.train.offload`'s streamed optimizer step (kept in step with it;
# this module imports no torch).
_OFFLOAD_CHUNK = 1 << 28
GB = 1e9
ASSUMED_GPU_GB = 80.0
PROCESS_RESERVE = int(2 * GB)
LOGP_HEAD_RESERVE = int(1 * GB)
# Changes tried on a plan that does not fit, least change first.
CANDIDATES: tuple[tuple[str, ...], ...] = (
    ("rollout.gpu_sharing=sleep",),
    ("actor.offload=optimizer",),
    ("rollout.gpu_sharing=sleep", "actor.offload=optimizer"),
    ("actor.lora.rank=16",),
    ("actor.gradient_checkpointing=true",),
    ("rollout.gpu_sharing=sleep", "actor.lora.rank=16"),
    ("rollout.gpu_sharing=sleep", "actor.offload=optimizer", "actor.gradient_checkpointing=true"),
)
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BOTH, ROLLOUT, TRAIN = frozenset({"rollout", "train"}), frozenset({"rollout"}), frozenset({"train"})


@attrs.frozen(kw_only=True)
class ModelShape:
    """A decoder-only transformer's shape, with HF's ``config.json`` names."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool

    @classmethod
    def from_config(cls, d: dict) -> ModelShape:
        """From a parsed ``config.json`` (a multimodal one's ``text_config``). Qwen2 has q/k/v
        biases without saying so in its config."""
        d = d.get("text_config") or d
        heads = int(d["num_attention_heads"])
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            vocab_size=int(d["vocab_size"]),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", d.get("model_type") == "qwen2")),
        )

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by HF name."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        hd, i = self.head_dim, self.intermediate_size
        return {
            "q_proj": (h, q * hd),
            "k_proj": (h, kv * hd),
            "v_proj": (h, kv * hd),
            "o_proj": (q * hd, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its linears, q/k/v biases, two norms."""
        lin = self.linears()
        bias = sum(lin[n][1] for n in ("q_proj", "k_proj", "v_proj")) if self.attention_bias else 0
        return sum(a * b for a, b in lin.values()) + bias + 2 * self.hidden_size

    def n_params(self) -> int:
        """All parameters: embeddings, the output head unless tied, the layers, the final norm."""
        embed = self.vocab_size * self.hidden_size
        head = 0 if self.tie_word_embeddings else embed
        return embed + head + self.num_hidden_layers * self.layer_params() + self.hidden_size

    def lora_params(self, rank: int, targets: Sequence[str]) -> int:
        """Adapter parameters of rank ``rank`` on the targeted linears (by name suffix, or
        ``all-linear``): r x (in + out) each."""
        if rank <= 0:
            return 0
        lin = self.linears()
        names = _LINEARS if "all-linear" in targets else [n for n in _LINEARS if n in targets]
        return self.num_hidden_layers * sum(rank * sum(lin[n]) for n in names)

    def kv_bytes_per_position(self, dtype_bytes: int) -> int:
        """KV cache bytes of one row's position over all layers: layers x 2 x kv x hd x bytes."""
        kv = self.num_key_value_heads * self.head_dim
        return self.num_hidden_layers * 2 * kv * dtype_bytes


def read_model_shape(path: str) -> tuple[ModelShape | None, str]:
    """``actor.path``'s shape from its ``config.json``: the folder's own when ``path`` is a
    local folder, else the Hugging Face cache's (or arl's converted default model), never the
    network. Returns (shape, the file it came from) or (None, why it is unknown)."""
    folder = Path(path).expanduser()
    found = folder / "config.json" if folder.is_dir() else _cached_config(path)
    if found is None or not found.is_file():
        return None, f"no config.json for actor.path={path!r} in a local folder or the HF cache"
    try:
        return ModelShape.from_config(json.loads(found.read_text())), str(found)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return None, f"{found} does not give the model's shape ({type(e).__name__}: {e})"


def _cached_config(repo_id: str) -> Path | None:
    """A hub id's cached ``config.json`` (no network), or None."""
    from huggingface_hub import try_to_load_from_cache

    from arl.cache import cache_root
    from arl.engines.model import DEFAULT_MODEL

    try:
        hit = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not a valid repo id (a missing local path)
        hit = None
    if isinstance(hit, str):
        return Path(hit)
    if repo_id == DEFAULT_MODEL:  # converted once from the offline GGUF (arl.engines.model)
        return cache_root() / "models" / DEFAULT_MODEL.split("/")[1] / "config.json"
    return None


@attrs.frozen(kw_only=True)
class Part:
    """Bytes one part takes on the GPU (in the phases it is resident) and on the host."""

    name: str
    gpu: int
    host: int = 0
    phases: frozenset[str] = BOTH


@attrs.frozen(kw_only=True)
class GpuMemory:
    """One GPU's parts, its nodes (ids, and their roles as text) and its capacity (``note``:
    how it was found)."""

    gpu: int
    node_ids: tuple[int, ...]
    roles: str
    parts: tuple[Part, ...]
    capacity: int
    note: str

    def phase_bytes(self, phase: str) -> int:
        """GPU bytes resident during ``phase`` (rollout or train)."""
        return sum(p.gpu for p in self.parts if phase in p.phases)

    @property
    def peak(self) -> int:
        """The larger of the two phases."""
        return max(self.phase_bytes("rollout"), self.phase_bytes("train"))

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity


@attrs.frozen(kw_only=True)
class MemoryPlan:
    """The memory plan of a placement plan; ``gpus`` empty when there is nothing to check (no
    GPU, or the model's shape is unknown: ``source`` says which)."""

    gpus: tuple[GpuMemory, ...]
    source: str
    n_params: int = 0

    @property
    def fits(self) -> bool:
        return all(g.fits for g in self.gpus)

    def worst(self) -> GpuMemory:
        """The GPU with the largest overshoot of its capacity."""
        return max(self.gpus, key=lambda g: g.peak - g.capacity)

    def format(self) -> str:
        """The plan as text: per GPU a table of parts, the phases, the peak against capacity."""
        if not self.gpus:
            return f"{self.source}\n"
        lines = [f"model: {self.n_params / 1e9:.2f} B parameters ({self.source}); GB = 1e9 bytes"]
        groups: dict[tuple, list[GpuMemory]] = {}
        for g in self.gpus:
            groups.setdefault((g.roles, g.parts, g.capacity, g.note), []).append(g)
        for same in groups.values():
            g = same[0]
            gpus = ",".join(str(s.gpu) for s in same)
            ids = [i for s in same for i in s.node_ids]
            nodes = f"node{'s' * (len(ids) > 1)} {','.join(map(str, ids))}"
            lines += ["", f"GPU{'s' * (len(same) > 1)} {gpus} ({nodes}): {g.roles}"]
            lines += _table(g.parts)
            rollout, train = g.phase_bytes("rollout"), g.phase_bytes("train")
            verdict = "fits" if g.fits else "DOES NOT FIT"
            lines.append(
                f"rollout phase {rollout / GB:.1f} GB, train phase {train / GB:.1f} GB: peak "
                f"{g.peak / GB:.1f} of {g.capacity / GB:.1f} GB ({g.note}): {verdict}"
            )
        host = sum(p.host for g in self.gpus for p in g.parts)
        if host:
            lines.append(f"host memory (all GPUs' trainers): {host / GB:.1f} GB")
        lines.append("verdict: " + ("fits" if self.fits else "does not fit"))
        return "\n".join(lines) + "\n"


def _table(parts: Sequence[Part]) -> list[str]:
    rows = [("part", "GB on GPU", "GB on host", "resident on GPU")]
    for p in parts:
        when = "both phases" if p.phases == BOTH else f"{next(iter(p.phases))} phase"
        host = f"{p.host / GB:.2f}" if p.host else "-"
        rows.append((p.name, f"{p.gpu / GB:.2f}", host, when if p.gpu else "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    out = [
        "  ".join(
            c.ljust(w) if i in (0, 3) else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in rows
    ]
    out.insert(1, "  ".join("-" * w for w in widths))
    return out


def gpu_capacity(cfg: Config, gpu: int) -> tuple[int, str]:
    """Bytes of one GPU and how they were found: ``cluster.gpu_memory_gb``, else the bytes CUDA
    can allocate on it (`arl.control.gpus`: NVML, or torch's device properties; no CUDA context
    in the launcher either way), else 80 GB assumed."""
    if cfg.cluster.gpu_memory_gb is not None:
        return int(cfg.cluster.gpu_memory_gb * GB), "cluster.gpu_memory_gb"
    found = gpu_memory(gpu)
    if found is not None:
        total, name = found
        return total, f"{name}, as the driver reports it"
    return int(ASSUMED_GPU_GB * GB), "assumed; set cluster.gpu_memory_gb"


def plan_memory(
    cfg: Config, plan: Plan, shape: ModelShape | None = None, source: str = ""
) -> MemoryPlan:
    """The memory plan of ``plan`` under ``cfg`` (``shape``: read from ``actor.path`` when
    None). Empty, saying why, for a CPU plan or an unknown model shape."""
    gpus = sorted({g for n in plan.nodes for g in n.gpu_ids})
    if not gpus:
        return MemoryPlan(gpus=(), source="no GPU in the placement plan: nothing to fit")
    if shape is None:
        shape, source = read_model_shape(cfg.actor.path)
        if shape is None:
            return MemoryPlan(gpus=(), source=f"model shape unknown ({source}): not checked")
    out = []
    for gpu in gpus:
        on_gpu = [n for n in plan.nodes if gpu in n.gpu_ids]
        shared = {n.role for n in on_gpu} == {"rollout", "train"}
        parts: list[Part] = []
        for node in on_gpu:
            if node.role == "rollout":
                parts += _engine_parts(cfg, plan, node, shape, shared)
            else:
                parts += _trainer_parts(cfg, plan, node, shape)
        capacity, note = gpu_capacity(cfg, gpu)
        roles = " + ".join(n.role for n in on_gpu)
        if shared:
            roles += f", rollout.gpu_sharing={cfg.rollout.gpu_sharing}"
        ids = tuple(n.node_id for n in on_gpu)
        merged = _merge(parts)
        out.append(
            GpuMemory(
                gpu=gpu, node_ids=ids, roles=roles, parts=merged, capacity=capacity, note=note
            )
        )
    return MemoryPlan(gpus=tuple(out), source=source, n_params=shape.n_params())


def _merge(parts: list[Part]) -> tuple[Part, ...]:
    """Parts of the same name and phases summed (two processes' reserves, say)."""
    merged: dict[tuple[str, frozenset[str]], Part] = {}
    for p in parts:
        key = (p.name, p.phases)
        if key in merged:
            q = merged[key]
            p = attrs.evolve(q, gpu=q.gpu + p.gpu, host=q.host + p.host)
        merged[key] = p
    # The reserves last: the table reads engine, then trainer, then what every process adds.
    return tuple(sorted(merged.values(), key=lambda p: p.name.startswith("reserve")))


def _dtype_bytes(dtype: str) -> int:
    return 4 if dtype == "float32" else 2  # auto is bf16 on CUDA


def _engine_parts(
    cfg: Config, plan: Plan, node: NodeSpec, shape: ModelShape, shared: bool
) -> list[Part]:
    e = _dtype_bytes(cfg.rollout.dtype)
    lora = cfg.actor.lora
    rows, positions = engine_sizing(cfg, len(plan.rollout))
    tp = node.tp_size
    sleeps = shared and cfg.rollout.gpu_sharing == "sleep"
    weights = (shape.n_params() + shape.lora_params(lora.rank, lora.target_modules)) * e // tp
    kv = rows * positions * shape.kv_bytes_per_position(e) // tp
    return [
        Part(
            name="engine weights", gpu=weights, phases=ROLLOUT if sleeps and not lora.rank else BOTH
        ),
        Part(
            name=f"KV cache ({rows} rows x {positions})", gpu=kv, phases=ROLLOUT if sleeps else BOTH
        ),
        Part(name="reserve (processes)", gpu=PROCESS_RESERVE),
    ]


def _trainer_parts(cfg: Config, plan: Plan, node: NodeSpec, shape: ModelShape) -> list[Part]:
    a = cfg.actor
    w = len(plan.train)
    c = 4 if a.dtype == "float32" else 2
    p = shape.n_params()
    adapters = shape.lora_params(a.lora.rank, a.lora.target_modules)
    t = adapters or p
    offload = a.offload == "optimizer" and not adapters  # validation refuses both
    one_rank = w == 1
    # CUDA graphs hold the gradients (and the captured passes' activations) between steps.
    graphs = (
        one_rank
        and a.cuda_graphs
        and not a.gradient_checkpointing
        and a.layout != "padded"
        and not offload
    )
    held = BOTH if graphs else TRAIN
    parts = []
    if one_rank and adapters:
        parts.append(Part(name="trainer weights", gpu=c * p + 4 * adapters))
    elif one_rank and offload:
        # fp32 masters on the host; the forward copy on the GPU.
        parts.append(Part(name="trainer weights", gpu=c * p, host=4 * p))
    elif one_rank:
        parts.append(Part(name="trainer weights", gpu=4 * p + (c * p if c < 4 else 0)))
    elif adapters:
        parts.append(Part(name="trainer weights", gpu=(c * p + 4 * adapters) // w))
    else:
        shard = 4 * p // w
        parts.append(
            Part(name="trainer weights", gpu=0 if offload else shard, host=shard * offload)
        )
        gathered = 2 * c * shape.layer_params()
        parts.append(Part(name="gathered layers (FSDP)", gpu=gathered, phases=TRAIN))
    if one_rank and offload:
        # The fp32 sums and the copy's gradients on the GPU for the train phase; the step
        # streams the sums to the host two 1 GiB chunks at a time (`arl.train.offload`).
        host = min(4 * p, 2 * 4 * _OFFLOAD_CHUNK)
        parts.append(Part(name="gradients", gpu=4 * p + c * p, host=host, phases=TRAIN))
    elif offload:
        parts.append(Part(name="gradients", gpu=0, host=4 * t // w, phases=TRAIN))
    else:
        copy_grads = c * t if one_rank and not adapters and c < 4 else 0
        parts.append(Part(name="gradients", gpu=(4 * t + copy_grads) // w, phases=held))
    optim = 8 * t // w
    parts.append(Part(name="optimizer (AdamW)", gpu=0 if offload else optim, host=optim * offload))
    if a.kl_ctl > 0:
        parts.append(Part(name="reference model", gpu=c * p // w))
    tokens = a.max_tokens_per_mb or cfg.data.max_prompt_len + cfg.gconfig.max_new_tokens
    per_token = activation_bytes_per_token(shape, a.gradient_checkpointing)
    parts.append(
        Part(name=f"activations ({tokens} tokens)", gpu=int(per_token * tokens), phases=held)
    )
    if plan.sync_mode == "ipc_buffer" and node.rank == 0:
        parts.append(
            Part(
                name="sync buffer (ipc_buffer)",
                gpu=(adapters or p) * _dtype_bytes(cfg.rollout.dtype),
            )
        )
    parts.append(Part(name="reserve (processes)", gpu=PROCESS_RESERVE + LOGP_HEAD_RESERVE))
    return parts


def format_memory_plan(cfg: Config, plan: Plan) -> str:
    """What ``--dry-run`` prints under its "memory plan" heading."""
    return "# memory plan\n" + plan_memory(cfg, plan).format()


def check_memory(cfg: Config, plan: Plan) -> MemoryPlan:
    """The memory plan of ``plan``; raises `ConfigError` when a GPU cannot hold its parts,
    naming the first change of `CANDIDATES` (least change first) under which every GPU fits,
    or, when none does, the largest parts. An unknown model shape refuses nothing."""
    mem = plan_memory(cfg, plan)
    if mem.fits:
        return mem
    shape, source = read_model_shape(cfg.actor.path)
    g = mem.worst()
    phase = "train" if g.phase_bytes("train") >= g.phase_bytes("rollout") else "rollout"
    big = sorted((p for p in g.parts if phase in p.phases), key=lambda p: -p.gpu)[:3]
    what = ", ".join(f"{p.name} {p.gpu / GB:.1f}" for p in big)
    problem = (
        f"the memory plan does not fit: GPU {g.gpu} needs {g.peak / GB:.1f} GB in the {phase} "
        f"phase ({what}, ...) and has {g.capacity / GB:.1f} GB ({g.note})"
    )
    for option in CANDIDATES:
        if any(o.startswith("actor.lora.rank=") for o in option) and cfg.actor.offload != "none":
            option = (*option, "actor.offload=none")  # LoRA with offload is refused
        todo = [o for o in option if not _already(cfg, o)]
        changed = apply_overrides(cfg, todo)
        if changed == cfg:
            continue
        after = plan_memory(changed, plan, shape, source)
        if after.fits:
            raise ConfigError(
                f"{problem}; set {' '.join(todo)} (then the peak is "
                f"{after.worst().peak / GB:.1f} GB; --dry-run with it prints the plan)"
            )
    raise ConfigError(
        f"{problem}, and no change tried (engine sleep, optimizer offload, both, LoRA rank 16, "
        "gradient checkpointing) makes it fit; lower rollout.max_concurrent_rollouts or "
        "gconfig.max_new_tokens (the KV cache), train a smaller model, or use more GPUs"
    )


def _already(cfg: Config, override: str) -> bool:
    key, _, value = override.partition("=")
    return str(get_key(cfg, key)).lower() == value
