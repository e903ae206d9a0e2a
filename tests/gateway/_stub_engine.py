"""A stub OpenAI server standing for one engine in the gateway's tests: /health, /v1/models,
and /v1/completions and /v1/chat/completions answering with its own name (streamed as
server-sent events when asked). A prompt or message holding "hold" streams its first event,
then waits for POST /release before the rest; one holding "die" streams one event and exits.

    python tests/gateway/_stub_engine.py NAME [--model M] [--max-model-len N]

prints "stub NAME on PORT" once it listens on 127.0.0.1 (a free port)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from typing import Any

from aiohttp import web


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("--model", default="stub-model")
    p.add_argument("--max-model-len", type=int, default=512)
    args = p.parse_args()
    release = asyncio.Event()
    seen: list[dict[str, Any]] = []

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": args.model, "object": "model", "max_model_len": args.max_model_len}]})

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        text = json.dumps(body.get("prompt", body.get("messages")))
        chunk = {"choices": [{"index": 0, "text": args.name}], "engine": args.name}
        if not body.get("stream"):
            return web.json_response(chunk)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if "die" in text:
            os._exit(3)
        if "hold" in text:
            await release.wait()
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response

    async def do_release(request: web.Request) -> web.Response:
        release.set()
        return web.Response(text="")

    async def requests(request: web.Request) -> web.Response:
        return web.json_response(seen)

    async def run() -> None:
        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", generate)
        app.router.add_post("/v1/chat/completions", generate)
        app.router.add_post("/release", do_release)
        app.router.add_get("/requests", requests)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        print(f"stub {args.name} on {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
