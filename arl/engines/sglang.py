"""The `sglang` engine: an SGLang server that arl starts, drives over its native HTTP API, and ends.

Built against SGLang's documented HTTP API (``python -m sglang.launch_server``; the request and
response shapes of ``sglang/srt/managers/io_struct.py`` and ``entrypoints/http_server.py``).
SGLang cannot run on arl's CPU test machines (its wheels need CUDA), so this module is tested
against a stand-in server that speaks the same shapes (``tests/support/sglang_standin.py``),
not against SGLang itself.

Endpoints used:

- ``POST /generate`` ``{"input_ids", "sampling_params", "return_logprob": true}`` ->
  ``{"text", "output_ids", "meta_info": {"finish_reason": {"type": "stop"|"length"|"abort",
  ...}, "output_token_logprobs": [[logprob, token_id, text|null], ...], ...}}``
- ``POST /pause_generation`` ``{"mode": "abort"}`` aborts running requests (they return their
  tokens so far with finish type ``abort``) and holds new ones until ``POST /continue_generation``.
  Every pause aborts, ``pause(in_place=True)`` too (``pause_in_place = False``): SGLang's own
  ``mode="in_place"``, which keeps requests and their KV cache, is not used yet.
- ``POST /update_weights_from_disk`` -> ``{"success": bool, "message": str, ...}``. SGLang's
  distributed update (``/init_weights_update_group``, ``/update_weights_from_distributed``) is
  not used: arl's nccl mode broadcasts flat buckets, which that endpoint does not read.
- LoRA (``lora_rank`` > 0: ``--enable-lora --max-lora-rank R --lora-target-modules all``):
  ``POST /load_lora_adapter {"lora_name": "arl-v<N>", "lora_path": DIR}`` per synced version,
  requests sent with ``"lora_path": <that name>``, then ``POST /unload_lora_adapter
  {"lora_name": <previous>}``.
- Sleep (``sleep_mode``: ``--enable-memory-saver``): ``POST /release_memory_occupation {}`` and
  ``POST /resume_memory_occupation {}``.
- ``GET /health`` (it generates one token, so `health` asks ``GET /get_model_info`` while
  paused), ``POST /flush_cache``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from arl.engines.base import GenerationResult, SamplingParams
from arl.engines.server import HttpServerEngine, ServerError, ServerProcess, free_port

if TYPE_CHECKING:
    from arl.engines.spec import EngineSpec

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


class SGLangEngine(HttpServerEngine):
    """An `Engine` backed by an SGLang server subprocess.

    The server is started as ``launch_cmd + ["--model-path", model_path, "--host", host,
    "--port", port] + server_args``; ``launch_cmd`` defaults to
    ``[python, "-m", "sglang.launch_server"]``. Call `start` (or use ``async with``) first.
    """

    name = "sglang"

    # Flags arl derives from the engine spec, and the setting each comes from.
    OWNED_FLAGS = {
        "--model-path": "actor.path",
        "--host": "the node's address",
        "--port": "a free port on the node",
        "--tp-size": "the t of rollout.backend (sglang:dNtT)",
        "--tp": "the t of rollout.backend (sglang:dNtT)",
        "--dtype": "rollout.dtype",
        "--random-seed": "experiment.seed",
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
        launch_cmd: Sequence[str] | None = None,
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
        port = port or free_port(host)
        argv = sglang_command(
            list(launch_cmd) if launch_cmd else [python, "-m", "sglang.launch_server"],
            model_path,
            host,
            str(port),
            tp_size=tp_size,
            dtype=dtype,
            seed=seed,
            server_args=server_args,
            lora_rank=lora_rank,
            sleep_mode=sleep_mode,
        )
        server = ServerProcess(
            argv, host=host, port=port, env=env, log_path=log_path, name="sglang"
        )
        super().__init__(
            server,
            start_timeout_s=start_timeout_s,
            request_timeout_s=request_timeout_s,
            max_connections=max_connections,
        )
        self.model_path = model_path

    @staticmethod
    def command_line(spec: EngineSpec, host: str, port: str) -> list[str]:
        """The server command `from_spec` runs, with ``port`` as given."""
        return sglang_command(
            [spec.python, "-m", "sglang.launch_server"],
            spec.model_path,
            host,
            port,
            tp_size=spec.tp_size,
            dtype=spec.dtype,
            seed=spec.seed,
            server_args=spec.server_args,
            lora_rank=spec.lora_rank,
            sleep_mode=spec.sleep_mode,
        )

    async def agenerate(self, input_ids: list[int], sampling: SamplingParams) -> GenerationResult:
        """Generate from token ids; returns tokens, their log-probs and versions."""
        await self._admit()
        payload = {
            "rid": uuid.uuid4().hex,
            "input_ids": list(input_ids),
            "sampling_params": sampling_params_json(sampling),
            "return_logprob": True,
            "stream": False,
        }
        if self.adapter is not None:
            payload["lora_path"] = self.adapter
        self._inflight += 1
        try:
            body = await self._request("POST", "/generate", json=payload, control=False)
        finally:
            self._inflight -= 1
        return parse_generate_response(body, self._window_version)

    async def score(self, token_ids: Sequence[int]) -> list[float]:
        """Log-probs of ``token_ids[1:]``, each given the tokens before it, under the weights
        the server holds now (``logprob_start_len=0``, temperature 1); call while running."""
        payload = {
            "rid": uuid.uuid4().hex,
            "input_ids": [int(t) for t in token_ids],
            "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "stream": False,
        }
        if self.adapter is not None:
            payload["lora_path"] = self.adapter
        body = await self._request("POST", "/generate", json=payload, control=False)
        try:
            pairs = body["meta_info"]["input_token_logprobs"]
            ids = [int(p[1]) for p in pairs]
            lps = [float(p[0]) for p in pairs[1:]]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise ServerError(
                f"unexpected sglang input_token_logprobs response ({exc!r}): {str(body)[:500]}"
            ) from exc
        if ids != [int(t) for t in token_ids]:
            raise ServerError(f"sglang scored tokens {ids[:8]}..., not the ones sent")
        return lps

    async def update_weights_from_disk(
        self, path: str, *, load_format: str | None = None, flush_cache: bool = True
    ) -> dict:
        """Load new weights from the HF-format directory ``path``, or a peft adapter folder
        by a versioned name (`load_adapter`) (call while paused)."""
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            name = await self.load_adapter(path)
            if flush_cache:
                await self.flush_cache()
            return {"success": True, "adapter": name}
        body = {"model_path": str(path), "load_format": load_format, "flush_cache": flush_cache}
        return await self._checked("/update_weights_from_disk", body)

    async def flush_cache(self) -> None:
        """Drop the server's prefix (radix) cache; it refuses while requests are running."""
        await self._request("POST", "/flush_cache")

    def _health_path(self) -> str:
        # SGLang's /health generates one token, and a paused server holds that request until
        # its health check times out: probe a non-generating endpoint while paused.
        return "/health" if self._resumed.is_set() else "/get_model_info"

    async def _server_pause(self) -> None:
        await self._request("POST", "/pause_generation", json={"mode": "abort"})

    async def _server_resume(self) -> None:
        await self._request("POST", "/continue_generation", json={})

    async def _server_sleep(self, drop_weights: bool) -> None:
        await self._checked_or_empty("/release_memory_occupation", {})

    async def _server_wake(self) -> None:
        await self._checked_or_empty("/resume_memory_occupation", {})

    async def _server_load_adapter(self, name: str, path: str) -> None:
        await self._checked("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def _server_unload_adapter(self, name: str) -> None:
        await self._checked("/unload_lora_adapter", {"lora_name": name})

    async def _checked_or_empty(self, path: str, body: dict) -> None:
        """POST ``body``; an answer that is a map must say ``success`` (SGLang's memory
        endpoints answer with an empty body)."""
        result = await self._request("POST", path, json=body)
        if isinstance(result, dict) and result.get("success") is False:
            raise ServerError(f"sglang {path} did not succeed: {str(result)[:1000]}")

    async def _checked(self, path: str, body: dict) -> dict:
        """POST ``body``; raise `ServerError` unless the answer says ``success``."""
        result = await self._request("POST", path, json=body)
        if not isinstance(result, dict) or not result.get("success"):
            raise ServerError(f"sglang {path} did not succeed: {str(result)[:1000]}")
        return result


def sglang_command(
    launch_cmd: Sequence[str],
    model_path: str,
    host: str,
    port: str,
    *,
    tp_size: int | None = None,
    dtype: str | None = None,
    seed: int | None = None,
    server_args: Sequence[str] = (),
    lora_rank: int = 0,
    sleep_mode: bool = False,
) -> list[str]:
    """The SGLang server command line; settings left None are left to SGLang."""
    argv = [*launch_cmd, "--model-path", model_path, "--host", host, "--port", port]
    if tp_size is not None:
        argv += ["--tp-size", str(tp_size)]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if seed is not None:
        argv += ["--random-seed", str(seed)]
    if lora_rank > 0:
        argv += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--lora-target-modules", "all"]
    if sleep_mode:
        argv += ["--enable-memory-saver"]
    return [*argv, *server_args]


def sampling_params_json(sampling: SamplingParams) -> dict:
    """SGLang's ``sampling_params`` for `SamplingParams` (its top_k uses -1 for "off")."""
    return {
        "max_new_tokens": sampling.max_new_tokens,
        "temperature": 0.0 if sampling.greedy else sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "top_k": 1 if sampling.greedy else (sampling.top_k if sampling.top_k > 0 else -1),
        "stop_token_ids": list(sampling.stop_token_ids),
        "skip_special_tokens": False,
    }


def parse_generate_response(body: object, version: int) -> GenerationResult:
    """Turn a ``/generate`` response into a `GenerationResult` stamped with ``version``."""
    try:
        meta = body["meta_info"]
        finish = _FINISH[meta["finish_reason"]["type"]]
        pairs = meta.get("output_token_logprobs") or []
        ids = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ServerError(
            f"unexpected sglang /generate response ({exc!r}): {str(body)[:500]}; the request "
            "asked for return_logprob, so meta_info.output_token_logprobs and "
            "meta_info.finish_reason.type must be present"
        ) from exc
    return GenerationResult(ids, logprobs, [version] * len(ids), finish)
