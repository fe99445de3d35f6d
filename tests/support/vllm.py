"""What the tests against a real vLLM server on CPU share: the interpreter that has vLLM, and
the server arguments they all pass."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# No torch.compile in a server a test starts itself (`VLLMEngine(...)`): on CI's two cores
# compiling took ~145 of a server's ~185 s start-up (42 s with this flag). A server started from
# an engine spec on the CPU gets the flag from arl (`arl.engines.vllm.server_args_for`).
EAGER = ("--enforce-eager",)

SKIP_REASON = (
    "no vLLM virtualenv: run `.ci/install-vllm` (creates .venv-vllm) or set ARL_VLLM_PYTHON"
)


def vllm_python() -> str | None:
    """``ARL_VLLM_PYTHON``, else ``<repo>/.venv-vllm``'s interpreter where it exists."""
    explicit = os.environ.get("ARL_VLLM_PYTHON")
    if explicit:
        return explicit
    venv = REPO / ".venv-vllm" / "bin" / "python"
    return str(venv) if venv.exists() else None
