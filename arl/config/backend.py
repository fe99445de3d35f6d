"""Backend strings: ``ENGINE:SPEC`` such as ``sglang:d4t2`` (d data, t tensor, p pipeline)."""

import re
from typing import Literal

import attrs

from arl.config.tree import ConfigError

ROLLOUT_ENGINES = ("hf", "vllm", "sglang")
TRAIN_ENGINES = ("fsdp",)
_BACKEND_FORMAT = (
    "expected ENGINE:SPEC such as sglang:d4t2, vllm:d2, hf:d1 or fsdp:d4 (ENGINE: hf, vllm or "
    "sglang for rollout, fsdp for training; SPEC: d data, t tensor, p pipeline parallel sizes, "
    "each letter at most once with a positive integer, a missing one is 1)"
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
        raise ConfigError(f"backend {s!r} is malformed: {_BACKEND_FORMAT}")
    engine, spec = m.group(1), m.group(2) or ""
    allowed = {
        "rollout": ROLLOUT_ENGINES,
        "train": TRAIN_ENGINES,
        None: ROLLOUT_ENGINES + TRAIN_ENGINES,
    }[role]
    if engine not in allowed:
        if role and engine in ROLLOUT_ENGINES + TRAIN_ENGINES:
            raise ConfigError(
                f"backend {s!r}: {engine!r} is not a {role} engine; use one of {', '.join(allowed)}"
            )
        raise ConfigError(f"backend {s!r}: unknown engine {engine!r}; {_BACKEND_FORMAT}")
    sizes = {"d": 1, "t": 1, "p": 1}
    seen: set[str] = set()
    for letter, digits in re.findall(r"([a-z])(\d+)", spec):
        if letter not in sizes:
            raise ConfigError(f"backend {s!r}: unknown letter {letter!r}; {_BACKEND_FORMAT}")
        if letter in seen:
            raise ConfigError(f"backend {s!r}: {letter!r} given twice; {_BACKEND_FORMAT}")
        if int(digits) < 1:
            raise ConfigError(f"backend {s!r}: {letter}{digits} must be >= 1; {_BACKEND_FORMAT}")
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
