"""The agent client as an OpenAI-compatible HTTP endpoint, for agents in other processes.

Inside a workflow's ``run(client, data)``::

    async with serve_client(client) as endpoint:
        # any OpenAI SDK: AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key)
        await run_my_agent_process(endpoint.base_url, endpoint.api_key, data)

``POST {base_url}/chat/completions`` takes the JSON body of OpenAI's chat completions API and
answers with the same JSON as `ChatCompletion.to_dict`; every call lands in ``client.records``
exactly as an in-process call does. The endpoint listens on 127.0.0.1 by default and wants the
random per-endpoint key as a bearer token. Errors answer in OpenAI's error shape: 400 for a
request the client refuses (``context_length_exceeded`` for a prompt over the budget), 401 for
a missing or wrong key.
"""

from __future__ import annotations

import json
import secrets
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
from aiohttp import web

from arl.agent.chat_format import MessageError, PromptTooLong
from arl.agent.client import ChatClient


@attrs.frozen
class Endpoint:
    """Where a served client listens: the OpenAI ``base_url`` and the key it wants."""

    base_url: str
    api_key: str


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _app(client: ChatClient, api_key: str) -> web.Application:
    async def completions(request: web.Request) -> web.Response:
        if not secrets.compare_digest(
            request.headers.get("Authorization", ""), f"Bearer {api_key}"
        ):
            return _error(401, "missing or wrong API key (Authorization: Bearer <key>)")
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return _error(400, f"the request body is not JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        try:
            response = await client.create(**body)
        except PromptTooLong as e:
            return _error(400, str(e), "context_length_exceeded")
        except (TypeError, ValueError, MessageError) as e:
            return _error(400, str(e))
        return web.json_response(response.to_dict())

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    return app


@asynccontextmanager
async def serve_client(
    client: ChatClient, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[Endpoint]:
    """Serve ``client`` over HTTP for the duration of the block (port 0: a free port)."""
    api_key = secrets.token_urlsafe(24)
    runner = web.AppRunner(_app(client, api_key), access_log=None)
    await runner.setup()
    try:
        sock = socket.create_server((host, port))  # port 0: the OS picks a free one
        await web.SockSite(runner, sock).start()
        yield Endpoint(f"http://{host}:{sock.getsockname()[1]}/v1", api_key)
    finally:
        await runner.cleanup()
