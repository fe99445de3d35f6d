"""Backend strings: ``ENGINE:SPEC`` such as ``sglang:d4t2`` (d data, t tensor, p pipeline)."""

import re
from typing import Literal

import attrs

from arl.config.errors import ConfigError
from arl.config.registry import registry_names

# The rollout engines are the registry's (`arl.engines.spec.ENGINES`, read when asked: the
# engines import this package); the train engine runs in `arl.node.train`, the one there is.
ROLLOUT_REGISTRY = "arl.engines.spec:ENGINES"
TRAIN_ENGINES = ("fsdp",)


def engine_names(role: Literal["rollout", "train"] | None) -> tuple[str, ...]:
    """The engines a backend string of ``role`` may name (None: either role)."""
    rollout = tuple(registry_names(ROLLOUT_REGISTRY))
    return {"rollout": rollout, "train": TRAIN_ENGINES, None: rollout + TRAIN_ENGINES}[role]


def _backend_format() -> str:
    return (
        "expected ENGINE:SPEC such as sglang:d4t2, vllm:d2, hf:d1 or fsdp:d4 (ENGINE: "
        f"{', '.join(engine_names('rollout'))} for rollout, {', '.join(TRAIN_ENGINES)} for "
        "training; SPEC: d data, t tensor, p pipeline parallel sizes, each letter at most once "
        "with a positive integer, a missing one is 1)"
    )


@attrs.frozen
class Backend:
    """A parsed backend string: the engine and its data/tensor/pipeline parallel sizes."""

    engine: str
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        """Devices one backend instance spans: dp x tp x pp."""
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return f"{self.engine}:d{self.dp}t{self.tp}p{self.pp}"


def parse_backend(s: str, role: Literal["rollout", "train"] | None = None) -> Backend:
    """Parse ``ENGINE:SPEC`` such as ``sglang:d4t2``; ``role`` restricts the engines allowed."""
    m = re.fullmatch(r"([a-z]+)(?::((?:[a-z]\d+)+))?", s.strip())
    if m is None:
        raise ConfigError(f"backend {s!r} is malformed: {_backend_format()}")
    engine, spec = m.group(1), m.group(2) or ""
    allowed = engine_names(role)
    if engine not in allowed:
        if role and engine in engine_names(None):
            raise ConfigError(
                f"backend {s!r}: {engine!r} is not a {role} engine; use one of {', '.join(allowed)}"
            )
        raise ConfigError(f"backend {s!r}: unknown engine {engine!r}; {_backend_format()}")
    sizes = {"d": 1, "t": 1, "p": 1}
    seen: set[str] = set()
    for letter, digits in re.findall(r"([a-z])(\d+)", spec):
        if letter not in sizes:
            raise ConfigError(f"backend {s!r}: unknown letter {letter!r}; {_backend_format()}")
        if letter in seen:
            raise ConfigError(f"backend {s!r}: {letter!r} given twice; {_backend_format()}")
        if int(digits) < 1:
            raise ConfigError(f"backend {s!r}: {letter}{digits} must be >= 1; {_backend_format()}")
        seen.add(letter)
        sizes[letter] = int(digits)
    b = Backend(engine, dp=sizes["d"], tp=sizes["t"], pp=sizes["p"])
    if engine in ("hf", "fsdp") and (b.tp > 1 or b.pp > 1):
        hint = "use vllm or sglang for tensor parallel" if engine == "hf" else "fsdp shards over d"
        raise ConfigError(
            f"backend {s!r}: {engine} supports only data parallelism (d); "
            f"t and p must be 1 ({hint})"
        )
    if engine in ("vllm", "sglang") and b.pp > 1:
        raise ConfigError(
            f"backend {s!r}: pipeline parallelism (p > 1) is not supported for {engine}; "
            "it supports d (replicas) and t (tensor parallel)"
        )
    return b
