"""``python -m arl.bench NAME [args]``: run one benchmark; ``NAME --help`` shows its options.

Each benchmark is a module with ``main(argv) -> int``, imported only when it is asked for, so one
benchmark's dependencies never slow down or break another. Its options are checked as they are
parsed (the types in `arl.bench`); an error the user can fix (`ConfigError`, a model or dataset
that cannot be used) is one ``error:`` line and exit 2, Ctrl-C one line and exit 130.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from typing import Any

BENCHMARKS: dict[str, tuple[str, str]] = {
    "transport": (
        "arl.bench.transport",
        "RPC round trip and bulk tensor transfer, beside memcpy and HTTP+pickle",
    ),
    "rtensor": ("arl.bench.rtensor", "RTensor shard pulls between nodes over the data plane"),
    "rollout": ("arl.bench.rollout", "rollout throughput of the inference engines"),
    "e2e": ("arl.bench.e2e", "a recipe's training steps, synchronous (eta=0) against eta=2"),
    "sim": ("arl.bench.sim", "async overlap with simulated engines and train ranks, eta 0/2/8"),
    "controller": ("arl.bench.controller", "controller CPU, memory and bytes per training step"),
    "collective": (
        "arl.bench.collective",
        "broadcast bus bandwidth (NCCL on GPUs, gloo on CPU): the floor of nccl weight sync",
    ),
    "gpu": ("arl.bench.gpu", "GPU decode, training and weight-sync figures beside their floors"),
    "sync": ("arl.bench.sync", "weight-sync seconds per mode in a recipe, beside the copy floor"),
    "loop": ("arl.bench.loop", "a recipe's RL step phase by phase beside its floors, profiled"),
    "scale": ("arl.bench.scale", "the RL loop at 1.5B/3B/7B shapes on one GPU: step, MFU, memory"),
    "startup": (
        "arl.bench.startup",
        "a recipe's launch to step 1 and to exit, cold and warm compile cache, phase by phase",
    ),
}


def usage() -> str:
    """The list of benchmarks, one per line."""
    lines = ["usage: python -m arl.bench NAME [args]   (NAME --help for its options)", ""]
    lines += [f"  {name:<10} {doc}" for name, (_, doc) in BENCHMARKS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch to the named benchmark's ``main``; returns the process exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in BENCHMARKS:
        close = difflib.get_close_matches(name, BENCHMARKS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(
            f"error: unknown benchmark {name!r}{hint}; known benchmarks: {', '.join(BENCHMARKS)}",
            file=sys.stderr,
        )
        return 2
    from arl.config import ConfigError
    from arl.data.gsm8k import DatasetError
    from arl.engines.model import ModelResolutionError

    try:
        module = _import(name)
        return int(module.main(rest) or 0) if module is not None else 2
    except (ConfigError, DatasetError, ModelResolutionError) as e:
        # What the user named and can fix: a run folder the benchmark may not replace, a model
        # or a dataset that cannot be used. Other exceptions are bugs and keep their traceback.
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: benchmark {name!r} stopped before its report", file=sys.stderr)
        return 130


def _import(name: str) -> Any:
    """The benchmark's module, or None (said on stderr) when arl has no such module."""
    module_name = BENCHMARKS[name][0]
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise  # the benchmark exists but one of its own imports is missing
        print(
            f"error: benchmark {name!r} is not available yet ({module_name} is missing)",
            file=sys.stderr,
        )
        return None


if __name__ == "__main__":
    sys.exit(main())
