"""The engine spec: everything a rollout node's engine is built from, decided once.

`engine_spec(cfg, node, model_path)` turns the config and one node of the placement plan into
an `EngineSpec` on the launcher side: the engine's registered name, the model, the device, the
dtype, the seed, the tensor-parallel size (the ``t`` of ``vllm:d2t2``), and for the server
engines the interpreter, the extra server arguments and the start timeout. The spec travels to
the node as a plain msgpack map (a wire struct: `to_wire` / `from_wire`) and becomes an engine
there through the class registered under its name in `ENGINES` (`build_engine`). An engine that
runs in the node process also gets its sizing for the run (`engine_options`: rows, length,
warm-up).

For the server engines `server_command(spec)` is the exact command line the node will run,
which ``--dry-run`` prints. The flags arl derives from the spec (model, host, port, dtype,
seed, tensor-parallel size) may not also appear in ``rollout.server_args``: two values for one
flag would leave the server's choice to its argument parser, so that is a `ConfigError`.
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

import attrs

from arl.config import Config, ConfigError
from arl.engines.base import EngineTraits, WeightCheck, WeightTarget
from arl.protocol.wire import WireStruct

if TYPE_CHECKING:
    from arl.engines.base import Engine
    from arl.protocol.plan import NodeSpec

# name -> "module:class". The class builds itself from a spec with `from_spec(spec)`.
ENGINES: dict[str, str] = {
    "hf": "arl.engines.hf:HFEngine",
    "vllm": "arl.engines.vllm:VLLMEngine",
    "sglang": "arl.engines.sglang:SGLangEngine",
}
SERVER_ENGINES = ("vllm", "sglang")
# What each engine declares (`EngineTraits`; its class reads its entry): the launcher checks a
# plan against these before any node starts, without importing the engine.
SERVER_TRAITS = EngineTraits(
    weight_targets=frozenset({WeightTarget.DIRECTORY}),  # a server loads weights from a folder
    pause_in_place=False,
    # Both servers sleep (vLLM on CUDA only: `check_engine_support`) and serve LoRA adapters,
    # each when its command line enabled it (`EngineSpec.sleep_mode`, `EngineSpec.lora_rank`).
    can_sleep=True,
    serves_lora=True,
    weight_check=WeightCheck.PROBE,  # no weights to checksum: it scores the probe
)
TRAITS: dict[str, EngineTraits] = {
    "hf": EngineTraits(
        weight_targets=frozenset({WeightTarget.TENSORS, WeightTarget.DIRECTORY}),
        pause_in_place=True,
        can_sleep=True,
        serves_lora=True,
        weight_check=WeightCheck.CHECKSUM,
    ),
    "vllm": SERVER_TRAITS,
    "sglang": SERVER_TRAITS,
}
DTYPES = ("auto", "bfloat16", "float16", "float32")
PORT_PLACEHOLDER = "<port>"  # the server's port is picked free on its node when it starts


@attrs.frozen(kw_only=True)
class EngineSpec(WireStruct):
    """One rollout node's engine: what to build and with which settings (a wire struct: every
    field travels, and a node refuses a map with one missing, unknown or mistyped)."""

    name: str
    model_path: str
    device: str = "cpu"
    dtype: str = "auto"
    seed: int = 1
    tp_size: int = 1
    python: str = "python"
    server_args: tuple[str, ...] = ()
    start_timeout_s: float = 600.0
    # actor.lora.rank (0: no adapter): a server is started able to serve adapters of this rank.
    lora_rank: int = 0
    # rollout.gpu_sharing=sleep: a server is started with its sleep endpoints enabled.
    sleep_mode: bool = False

    def __attrs_post_init__(self) -> None:
        problems = [
            f"name={self.name!r} is not a registered engine ({', '.join(ENGINES)})"
            if self.name not in ENGINES
            else "",
            f"dtype={self.dtype!r} is not one of {DTYPES}" if self.dtype not in DTYPES else "",
            f"tp_size={self.tp_size} must be >= 1" if self.tp_size < 1 else "",
            f"start_timeout_s={self.start_timeout_s} must be > 0"
            if not self.start_timeout_s > 0
            else "",
            "hf runs one device per replica: tp_size must be 1 (use vllm or sglang for tensor "
            "parallelism)"
            if self.name == "hf" and self.tp_size != 1
            else "",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise ConfigError("engine spec: " + "; ".join(problems))

    @property
    def is_server(self) -> bool:
        """Whether the engine is an inference server that the node starts as a process."""
        return self.name in SERVER_ENGINES


def engine_spec(
    cfg: Config, node: NodeSpec, model_path: str, device: str | None = None
) -> EngineSpec:
    """The spec of rollout ``node``'s engine under ``cfg``; raises `ConfigError` when the
    settings contradict each other (a server flag given twice, tensor parallelism on hf).
    Replica ``r`` samples with seed ``experiment.seed + r``.

    ``device`` is the device as the node process sees it (its CUDA_VISIBLE_DEVICES numbers
    from 0); None: the plan's physical device, as ``--dry-run`` shows it.
    """
    spec = EngineSpec(
        name=node.engine,
        model_path=model_path,
        device=node.device if device is None else device,
        dtype=cfg.rollout.dtype,
        seed=cfg.experiment.seed + node.dp_rank,  # replicas draw different samples
        tp_size=node.tp_size,
        python=os.path.expanduser(cfg.rollout.server_python),  # a shell leaves ~ in key=~/x
        server_args=tuple(cfg.rollout.server_args),
        start_timeout_s=cfg.rollout.server_start_timeout,
        lora_rank=int(cfg.actor.lora.rank),
        sleep_mode=cfg.rollout.gpu_sharing == "sleep" and node.colocated,
    )
    check_engine_support(spec)
    if spec.is_server:
        server_command(spec)  # refuses server_args that repeat a flag arl sets
    elif spec.server_args:
        raise ConfigError(
            f"rollout.server_args={list(spec.server_args)} is set but rollout.backend="
            f"{cfg.rollout.backend!r} starts no server; remove them or use vllm/sglang"
        )
    return spec


def engine_sizing(cfg: Config, n_engines: int) -> tuple[int, int]:
    """(rows, positions) of the KV cache an engine is sized for with ``n_engines`` rollout
    nodes: room for every sequence the staleness semaphore lets run at once, split over the
    engines (the hf engine's default 64 rows would serialise gsm8k's 768 concurrent samples), up
    to 1,024 rows (SmolLM2's KV cache for 1,024 rows of gsm8k's 1,537 positions is 36 GB; the hf
    engine grows it lazily where that does not fit); and the longest prompt plus completion, at
    least 2,048 positions. The memory plan counts the same."""
    per_engine = -(-cfg.max_concurrent_rollouts * cfg.gconfig.n_samples // max(1, n_engines))
    positions = max(2048, cfg.data.max_prompt_len + cfg.gconfig.max_new_tokens + 1)
    return max(1, min(1024, per_engine)), positions


def engine_options(cfg: Config, spec: EngineSpec, n_engines: int) -> dict:
    """The constructor options of an engine that runs in the node process (`build_engine`'s
    ``options``): its sizing for this run (`engine_sizing`), and the trainer's LoRA adapter; {}
    for a server, which sizes itself from its own arguments."""
    if spec.is_server:
        return {}
    rows, positions = engine_sizing(cfg, n_engines)
    # The cache grows on demand up to max_seq_len; agent turns can outgrow prompt + new tokens.
    longest = cfg.data.max_prompt_len + cfg.gconfig.max_new_tokens + 1
    options: dict[str, Any] = {
        "max_batch_size": rows,
        "max_seq_len": positions,
        # Decode graphs for every batch size up to that length are captured at start, with the
        # cache at its full size (rows x length; lazily grown if that does not fit).
        "warm_up_len": longest,
        "decode_attention": cfg.rollout.hf_decode_attention,
        # None: fused where the model's family allows (False keeps the model's modules).
        "fused_decode": None if cfg.rollout.hf_fused_decode else False,
        # None: overlapped where the device runs apart from the host (CUDA).
        "overlap": None if cfg.rollout.hf_overlap else False,
    }
    if cfg.actor.lora.rank > 0:  # the trainer's adapters, served on the base
        options["lora"] = attrs.asdict(cfg.actor.lora)
    return options


def check_engine_support(spec: EngineSpec) -> None:
    """Refuse, before any node starts, a spec asking its engine for what it cannot do: a LoRA
    adapter where the engine serves none, sleep where it cannot sleep (vLLM's sleep mode
    needs CUDA)."""
    traits = TRAITS[spec.name]
    if spec.lora_rank > 0 and not traits.serves_lora:
        raise ConfigError(
            f"actor.lora.rank={spec.lora_rank}: the {spec.name} engine serves no LoRA adapter; "
            "set actor.lora.rank=0 or pick an engine that does (hf, vllm, sglang)"
        )
    if spec.sleep_mode and not traits.can_sleep:
        raise ConfigError(
            f"rollout.gpu_sharing=sleep: the {spec.name} engine cannot sleep; use "
            "rollout.gpu_sharing=alternate"
        )
    if spec.sleep_mode and spec.name == "vllm" and not spec.device.startswith("cuda"):
        raise ConfigError(
            f"rollout.gpu_sharing=sleep: vLLM's sleep mode needs CUDA, but this engine runs on "
            f"{spec.device!r}; use rollout.gpu_sharing=alternate (or concurrent)"
        )


def engine_class(name: str) -> Any:
    """The engine class registered under ``name``."""
    module, _, attr = ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def build_engine(spec: EngineSpec, **options: Any) -> Engine:
    """A new, unstarted engine for ``spec`` (server engines start with ``await engine.start()``);
    ``options`` are further arguments of the engine's constructor (a server's ``env``...)."""
    return engine_class(spec.name).from_spec(spec, **options)


def server_command(spec: EngineSpec, host: str = "127.0.0.1", port: int | None = None) -> list[str]:
    """The server engine's exact command line (``port`` None: the placeholder ``<port>``)."""
    if not spec.is_server:
        raise ValueError(f"engine {spec.name!r} starts no server")
    cls = engine_class(spec.name)
    argv = cls.command_line(spec, host, PORT_PLACEHOLDER if port is None else str(port))
    owned = cls.OWNED_FLAGS
    for arg in spec.server_args:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise ConfigError(
                f"rollout.server_args sets {flag}, which arl sets itself from "
                f"{owned[flag]}; set that instead and remove {flag} from rollout.server_args"
            )
    return argv


def describe(spec: EngineSpec) -> str:
    """One line for ``--dry-run``: the engine, its device and settings, or its server command."""
    if spec.is_server:
        import shlex

        line = shlex.join(server_command(spec)).replace(shlex.quote(PORT_PLACEHOLDER), "<port>")
        return f"{spec.name} server: {line}"
    settings = f"dtype {spec.dtype}, seed {spec.seed}"
    return f"{spec.name} engine in the node process on {spec.device} ({settings})"
