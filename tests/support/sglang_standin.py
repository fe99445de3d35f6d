"""A stand-in for an SGLang server, for tests on machines where SGLang cannot run (no CUDA).

It speaks the request and response shapes of SGLang's native HTTP API (``/generate``,
``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``, ``/flush_cache``,
``/health``, ``/get_load``, LoRA's ``/load_lora_adapter`` and ``/unload_lora_adapter``, and
``/release_memory_occupation`` / ``/resume_memory_occupation``) and is backed by a real
transformers causal LM (with the adapters injected by peft), so tokens and log-probs are real.
Request bodies are checked strictly: a missing, mistyped or unknown field is a 400, so a client
that drifts from SGLang's documented shapes fails here.

Run it as SGLang is run (the same flag names)::

    python -m tests.support.sglang_standin --model-path DIR --host 127.0.0.1 --port P

What it does not model: batching across requests (each request decodes on its own KV cache,
one step at a time), a radix cache, streaming, tensor parallelism, the distributed weight update
(arl does not use it).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import logging
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from aiohttp import web

log = logging.getLogger("sglang_standin")
# Set: /update_weights_from_disk answers success and loads nothing (a server that drops updates).
IGNORE_UPDATES_ENV = "ARL_STANDIN_IGNORE_WEIGHT_UPDATES"
# Seconds to wait after each generated token: a slower server (for tests that need generations
# still running when the trainer reaches its next sync, whatever the machine's speed).
TOKEN_DELAY_ENV = "ARL_STANDIN_TOKEN_DELAY_S"

_SAMPLING_KEYS = {
    "max_new_tokens": int,
    "temperature": (int, float),
    "top_p": (int, float),
    "top_k": int,
    "min_p": (int, float),
    "stop_token_ids": list,
    "ignore_eos": bool,
    "skip_special_tokens": bool,
    "no_stop_trim": bool,
}
_GENERATE_KEYS = {
    "rid": str,
    "input_ids": list,
    "text": str,
    "sampling_params": dict,
    "return_logprob": bool,
    "logprob_start_len": int,
    "top_logprobs_num": int,
    "stream": bool,
    "lora_path": str,
}


class BadRequest(Exception):
    """A request body that does not match SGLang's documented shape."""


def _check(body: object, schema: dict, required: tuple[str, ...], what: str) -> dict:
    """Validate ``body`` against {key: type}; unknown keys and wrong types are errors."""
    if not isinstance(body, dict):
        raise BadRequest(f"{what}: the body must be a JSON object, got {type(body).__name__}")
    for key in required:
        if key not in body:
            raise BadRequest(f"{what}: missing required field {key!r}")
    for key, value in body.items():
        if key not in schema:
            raise BadRequest(f"{what}: unknown field {key!r}; known: {sorted(schema)}")
        if value is not None and not isinstance(value, schema[key]):
            raise BadRequest(f"{what}: field {key!r} has type {type(value).__name__}")
    return body


class StandinServer:
    """The model, the requests in flight, and the pause state behind the HTTP routes."""

    def __init__(self, model_path: str, dtype: torch.dtype, seed: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model_path = model_path
        self.dtype = dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
        self.tokenizer = _maybe_tokenizer(model_path)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version = "default"
        # One compute thread: model steps and weight loads never overlap, and the event loop
        # stays free to answer /pause_generation while a request decodes.
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="standin-compute")
        self.running: dict[str, dict] = {}  # rid -> {"abort": bool, "tokens": int}
        self.paused = False
        self.pause_mode = "abort"
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.drained = asyncio.Event()
        self.drained.set()
        self.token_delay_s = float(os.environ.get(TOKEN_DELAY_ENV, "0"))
        # LoRA: adapters by name (the peft layers are injected at the first load), the one
        # whose tensors the model holds now ("" : the base, every B zero), and the sleep flag.
        self.adapters: dict[str, dict[str, torch.Tensor]] = {}
        self.active_adapter = ""
        self.asleep = False

    async def run(self, fn, *args):
        """Run blocking model work on the compute thread."""
        return await asyncio.get_running_loop().run_in_executor(self.compute, fn, *args)

    # ---- generation -------------------------------------------------------------------------

    async def generate(self, body: dict) -> dict:
        _check(body, _GENERATE_KEYS, (), "/generate")
        if body.get("stream"):
            raise BadRequest("/generate: stream=true is not supported by the stand-in")
        if body.get("top_logprobs_num"):
            raise BadRequest("/generate: top_logprobs_num is not supported by the stand-in")
        input_ids = body.get("input_ids")
        if input_ids is None:
            if body.get("text") is None or self.tokenizer is None:
                raise BadRequest("/generate: give input_ids (or text, with a tokenizer)")
            input_ids = self.tokenizer(body["text"])["input_ids"]
        if not input_ids or not all(isinstance(t, int) for t in input_ids):
            raise BadRequest("/generate: input_ids must be a non-empty list of ints")
        sp = _check(body.get("sampling_params") or {}, _SAMPLING_KEYS, (), "sampling_params")
        if self.asleep:
            raise BadRequest("/generate: the server's memory is released; resume it first")
        lora = body.get("lora_path") or ""
        if lora and lora not in self.adapters:
            raise BadRequest(
                f"/generate: no LoRA adapter named {lora!r}; loaded: {sorted(self.adapters)}"
            )
        sp = {**sp, "lora": lora}
        rid = body.get("rid") or uuid.uuid4().hex
        # SGLang holds new requests while paused, until /continue_generation.
        await self.unpaused.wait()
        if rid in self.running:
            raise BadRequest(f"/generate: duplicate rid {rid!r}")
        state = {"abort": False, "tokens": len(input_ids)}
        self.running[rid] = state
        self.drained.clear()
        started = time.monotonic()
        try:
            out_ids, logprobs, finish = await self._decode(input_ids, sp, state)
        finally:
            del self.running[rid]
            if not self.running:
                self.drained.set()
        meta = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - started,
        }
        if body.get("return_logprob"):
            pairs = zip(logprobs, out_ids, strict=True)
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in pairs]
            start = body.get("logprob_start_len", -1)
            if start >= 0:  # SGLang: the prompt's own log-probs from position `start` on
                lps = await self.run(self._prompt_logprobs, input_ids, sp["lora"])
                meta["input_token_logprobs"] = [
                    [lp, t, None] for lp, t in list(zip(lps, input_ids, strict=True))[start:]
                ]
        text = self.tokenizer.decode(out_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    async def _decode(self, input_ids: list[int], sp: dict, state: dict):
        max_new = sp.get("max_new_tokens", 128)
        stop_ids = set(sp.get("stop_token_ids") or [])
        if not sp.get("ignore_eos", False):
            stop_ids |= self.eos_ids
        cache = None
        next_input = list(input_ids)
        out_ids: list[int] = []
        logprobs: list[float] = []
        while True:
            # Paused in place/retract: wait; paused with abort: return what we have.
            if self.paused and self.pause_mode != "abort" and not state["abort"]:
                await self.unpaused.wait()
            if state["abort"]:
                return out_ids, logprobs, {"type": "abort", "message": "Abort in waiting queue"}
            if len(out_ids) >= max_new:
                return out_ids, logprobs, {"type": "length", "length": max_new}
            token, lp, cache = await self.run(self._step, next_input, cache, sp)
            out_ids.append(token)
            logprobs.append(lp)
            state["tokens"] += 1
            next_input = [token]
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            if token in stop_ids:
                return out_ids, logprobs, {"type": "stop", "matched": token}

    @torch.no_grad()
    def _step(self, ids: list[int], cache, sp: dict):
        """One forward pass and one sampled token, with its log-prob as SGLang reports it:
        ``log_softmax(logits / T)`` before top-k/top-p/min-p truncation (greedy: ``T = 1``)."""
        self._activate(sp.get("lora", ""))
        logits, cache = forward_step(self.model, ids, cache)
        logits = logits.float()
        temperature = float(sp.get("temperature", 1.0))
        if temperature < 1e-5:
            token = int(torch.argmax(logits))
            return token, float(torch.log_softmax(logits, -1)[token]), cache
        logits = logits / temperature
        logprobs = torch.log_softmax(logits, -1)
        keep = torch.ones_like(logits, dtype=torch.bool)
        top_k = int(sp.get("top_k", -1))
        if top_k > 0:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            keep &= logits >= kth
        top_p = float(sp.get("top_p", 1.0))
        if top_p < 1.0:
            probs, order = torch.sort(logprobs.exp(), descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least one token).
            keep[order[(torch.cumsum(probs, -1) - probs) >= top_p]] = False
        min_p = float(sp.get("min_p", 0.0))
        if min_p > 0.0:
            probs = logprobs.exp()
            keep &= probs >= min_p * probs.max()
        weights = logprobs.exp().masked_fill(~keep, 0.0)
        token = int(torch.multinomial(weights, 1, generator=self.generator))
        return token, float(logprobs[token]), cache

    @torch.no_grad()
    def _prompt_logprobs(self, ids: list[int], lora: str = "") -> list[float | None]:
        """log_softmax of one teacher-forced pass: entry i scores ids[i] given ids[:i]."""
        self._activate(lora)
        logits = self.model(torch.tensor([ids])).logits[0].float()
        lps = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])
        return [None, *(float(x) for x in lps[:, 0])]

    # ---- pause / continue -------------------------------------------------------------------

    async def pause(self, body: dict) -> dict:
        body = _check(body or {}, {"mode": str}, (), "/pause_generation")
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"/pause_generation: mode {mode!r} is not abort|retract|in_place")
        self.paused, self.pause_mode = True, mode
        self.unpaused.clear()
        if mode == "abort":
            # Like SGLang: abort everything running and return only once none is left.
            for state in self.running.values():
                state["abort"] = True
            await self.drained.wait()
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_(self, body: dict) -> dict:
        _check(body or {}, {}, (), "/continue_generation")
        self.paused = False
        self.unpaused.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    # ---- weights ----------------------------------------------------------------------------

    async def update_from_disk(self, body: dict) -> tuple[dict, int]:
        schema = {
            "model_path": str,
            "load_format": str,
            "abort_all_requests": bool,
            "weight_version": str,
            "flush_cache": bool,
        }
        body = _check(body, schema, ("model_path",), "/update_weights_from_disk")
        if body.get("abort_all_requests"):
            for state in self.running.values():
                state["abort"] = True
        # SGLang takes the model-update writer lock: running requests finish first.
        await self.drained.wait()
        if IGNORE_UPDATES_ENV in os.environ:  # a broken server, for tests of verification
            log.warning("%s is set: answering success without loading", IGNORE_UPDATES_ENV)
            return {"success": True, "message": "Succeeded to update model weights."}, 200
        try:
            await self.run(self._load_from_disk, body["model_path"])
        except Exception as exc:  # noqa: BLE001 - reported to the client like SGLang does
            msg = f"Failed to update weights: {exc}. Rolling back to the original weights."
            return {"success": False, "message": msg, "num_paused_requests": 0}, 400
        self.model_path = body["model_path"]
        msg = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            self.weight_version = body["weight_version"]
            msg += f" Weight version updated to {self.weight_version}."
        return {"success": True, "message": msg, "num_paused_requests": 0}, 200

    def _load_from_disk(self, path: str) -> None:
        from transformers import AutoModelForCausalLM

        new = AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype)
        self.model.load_state_dict(new.state_dict(), strict=True)

    # ---- LoRA and memory ---------------------------------------------------------------------

    async def load_lora(self, body: dict) -> tuple[dict, int]:
        body = _check(
            body,
            {"lora_name": str, "lora_path": str, "pinned": bool},
            ("lora_name", "lora_path"),
            "/load_lora_adapter",
        )
        name = body["lora_name"]
        if name in self.adapters:
            return {"success": False, "error_message": f"adapter {name!r} is already loaded"}, 400
        await self.run(self._load_lora, name, body["lora_path"])
        return {"success": True, "loaded_adapters": sorted(self.adapters)}, 200

    def _load_lora(self, name: str, path: str) -> None:
        from arl.engines.lora import add_lora, load_adapter, lora_tensors

        tensors, config = load_adapter(path)
        if not hasattr(self, "_base_adapter"):  # inject the peft layers, B zero: the base
            targets = config["target_modules"]
            lora = {
                "rank": config["r"],
                "alpha": config["lora_alpha"],
                "target_modules": [targets] if isinstance(targets, str) else sorted(targets),
            }
            add_lora(self.model, lora)
            self.model.requires_grad_(False)
            self._base_adapter = {
                n: torch.zeros_like(t) if ".lora_B." in n else t.clone()
                for n, t in lora_tensors(self.model)
            }
        self.adapters[name] = {n: t.to(self.dtype) for n, t in tensors.items()}
        self.active_adapter = None  # reload on the next step

    def _activate(self, name: str) -> None:
        """Hold adapter ``name``'s tensors ("" : the base) in the model (compute thread)."""
        if name == self.active_adapter or not self.adapters:
            return
        tensors = self.adapters[name] if name else self._base_adapter
        self.model.load_state_dict(tensors, strict=False)
        self.active_adapter = name

    async def unload_lora(self, body: dict) -> tuple[dict, int]:
        body = _check(body, {"lora_name": str}, ("lora_name",), "/unload_lora_adapter")
        if self.adapters.pop(body["lora_name"], None) is None:
            return {"success": False, "error_message": f"no adapter {body['lora_name']!r}"}, 400
        self.active_adapter = None
        return {"success": True, "loaded_adapters": sorted(self.adapters)}, 200

    async def release_memory(self, body: dict) -> dict:
        _check(body or {}, {"tags": list}, (), "/release_memory_occupation")
        self.asleep = True
        return {}

    async def resume_memory(self, body: dict) -> dict:
        _check(body or {}, {"tags": list}, (), "/resume_memory_occupation")
        self.asleep = False
        return {}

    def close(self) -> None:
        self.compute.shutdown(wait=False, cancel_futures=True)


def forward_step(model, ids: list[int], cache):
    """Feed ``ids`` after ``cache``; return the last position's logits and the grown cache.

    transformers 5.24 renamed the ``past_key_values`` argument and output to ``cache``.
    """
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(torch.tensor([ids]), use_cache=True, **{name: cache})
    return out.logits[0, -1], getattr(out, name)


def _maybe_tokenizer(model_path: str):
    """The model's tokenizer if the folder has one (the stand-in works on ids without it)."""
    import os

    if not any(
        os.path.exists(os.path.join(model_path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def build_app(server: StandinServer) -> web.Application:
    """The aiohttp routes, named and shaped like SGLang's."""

    def route(handler):
        async def wrapped(request: web.Request) -> web.Response:
            try:
                body = await request.json() if request.can_read_body else {}
                result = await handler(body)
            except BadRequest as exc:
                # SGLang answers validation errors with 400 and an error object.
                return web.json_response(
                    {"object": "error", "message": str(exc), "type": "Bad Request", "code": 400},
                    status=400,
                )
            payload, status = result if isinstance(result, tuple) else (result, 200)
            return web.json_response(payload, status=status)

        return wrapped

    async def health(_: web.Request) -> web.Response:
        return web.Response(status=200)

    async def flush_cache(_: web.Request) -> web.Response:
        if server.running:
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def model_info(_: web.Request) -> web.Response:
        info = {
            "model_path": server.model_path,
            "tokenizer_path": server.model_path,
            "is_generation": True,
            "weight_version": server.weight_version,
        }
        return web.json_response(info)

    async def get_load(_: web.Request) -> web.Response:
        # SGLang's /get_load shape (one entry per data-parallel rank); tests poll it to know
        # that a request is decoding.
        tokens = sum(state["tokens"] for state in server.running.values())
        load = {"dp_rank": 0, "num_reqs": len(server.running), "num_waiting_reqs": 0}
        return web.json_response([{**load, "num_tokens": tokens}])

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health)
    app.router.add_get("/get_model_info", model_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_route("*", "/flush_cache", flush_cache)
    app.router.add_post("/generate", route(server.generate))
    app.router.add_post("/pause_generation", route(server.pause))
    app.router.add_post("/continue_generation", route(server.continue_))
    app.router.add_post("/update_weights_from_disk", route(server.update_from_disk))
    app.router.add_post("/load_lora_adapter", route(server.load_lora))
    app.router.add_post("/unload_lora_adapter", route(server.unload_lora))
    app.router.add_post("/release_memory_occupation", route(server.release_memory))
    app.router.add_post("/resume_memory_occupation", route(server.resume_memory))
    return app


async def serve(args: argparse.Namespace) -> None:
    """Load the model, then listen (so /health answers only once the model is ready)."""
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else torch.float32
    server = StandinServer(args.model_path, dtype, args.random_seed)
    runner = web.AppRunner(build_app(server), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    log.info("sglang stand-in serving %s on %s:%d", args.model_path, args.host, args.port)
    try:
        await asyncio.Event().wait()  # until SIGTERM/SIGINT
    finally:
        await runner.cleanup()
        server.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.support.sglang_standin --model-path DIR --port P``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="auto", help="auto (float32 here), float32, bfloat16")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument(
        "--tp-size", type=int, default=1, help="accepted; the stand-in is one process"
    )
    parser.add_argument("--enable-lora", action="store_true", help="accepted; always on")
    parser.add_argument("--max-lora-rank", type=int, default=0, help="accepted")
    parser.add_argument("--lora-target-modules", nargs="*", default=[], help="accepted")
    parser.add_argument("--enable-memory-saver", action="store_true", help="accepted")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)  # test machines are small and shared
    import signal

    loop = asyncio.new_event_loop()
    task = loop.create_task(serve(args))
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    finally:
        loop.close()


if __name__ == "__main__":
    main()
