"""Passing one request to one engine and its answer back: a non-streaming answer whole, a
streaming one (server-sent events) chunk by chunk as the engine writes it, never buffered.

An engine that cannot be reached before it answers is `Unreachable` (the gateway tries the next
one: nothing reached the caller yet). An engine that fails after its answer began fails that
request: a non-streaming caller gets a 502; a streaming caller gets an error event and the end
of the stream (its status line has gone already)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

ENGINE_HEADER = "x-radixkv-engine"  # the node id (or URL) of the engine that served a request


class Unreachable(Exception):
    """The engine gave no answer: nothing was sent to the caller."""


class CutOff(Exception):
    """The engine's answer broke off; the caller already got what `response` holds."""

    def __init__(self, why: str, response: web.StreamResponse) -> None:
        super().__init__(why)
        self.response = response


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """OpenAI's error object."""
    return json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}).encode()


async def forward(request: web.Request, session: aiohttp.ClientSession, url: str, name: str,
                  body: bytes, read_timeout_s: float) -> web.StreamResponse:
    """POST `body` to `url` and answer `request` with what comes back (module docstring)."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=read_timeout_s)
    try:
        upstream = await session.post(url, data=body, timeout=timeout,
                                      headers={"Content-Type": "application/json"})
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        raise Unreachable(str(e) or type(e).__name__) from None
    async with upstream:
        headers = {ENGINE_HEADER: name}
        if upstream.content_type != "text/event-stream":
            try:
                data = await upstream.read()
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                failed = web.Response(
                    status=502, content_type="application/json", headers=headers,
                    body=error_body(502, f"the engine failed mid-answer: {e}", "BadGatewayError"))
                raise CutOff(str(e) or type(e).__name__, failed) from None
            return web.Response(status=upstream.status, body=data, headers=headers,
                                content_type=upstream.content_type)
        response = web.StreamResponse(status=upstream.status, headers={
            **headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
        except (TimeoutError, aiohttp.ClientError, asyncio.IncompleteReadError) as e:
            await end_with_error(response, f"the engine failed mid-stream: {e}")
            raise CutOff(str(e) or type(e).__name__, response) from None
        await response.write_eof()
        return response


async def end_with_error(response: web.StreamResponse, message: str) -> None:
    """An error event, then the end of a stream whose status line has gone."""
    event: dict[str, Any] = json.loads(error_body(502, message, "BadGatewayError"))
    try:
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write_eof()
    except (ConnectionError, RuntimeError):
        pass  # the caller has gone too
