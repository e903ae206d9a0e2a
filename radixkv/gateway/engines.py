"""The engines behind the gateway: each an OpenAI server URL and the radixkv member beside it
(its node id in the cluster), from `--engine URL=NODE_ID` flags or from the members' records in
etcd (`radixkv serve --engine-url URL`). Each engine's health is checked; one that fails (a
refused connection, a stream cut, a failed check) is left out for a backoff that grows with its
failures in a row, and a passed check takes it back."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from radixkv.cluster.follower import backoff_s
from radixkv.cluster.router import Router

log = logging.getLogger("radixkv.gateway")

CHECK_EVERY_S = 1.0


@dataclass(eq=False)
class EngineServer:
    url: str  # http://host:port, no trailing slash
    node_id: str  # its member's node id ("" if it has none)
    inflight: int = 0  # requests this gateway sent it that have not finished
    failures: int = 0  # failures in a row
    down_until: float = 0.0  # monotonic time; left out until then
    error: str = ""
    models: dict[str, int] = field(default_factory=dict)  # model id -> max_model_len (0: unknown)

    def up(self, now: float) -> bool:
        return now >= self.down_until


def parse_engine(text: str) -> tuple[str, str]:
    """`URL=NODE_ID` (or a bare URL: no member) -> (url, node id)."""
    url, _, node = text.partition("=")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--engine {text!r}: expected URL=NODE_ID with an http(s) URL")
    return url.rstrip("/"), node


class Engines:
    """The engine set. Used from the event loop only (not thread-safe)."""

    def __init__(self, fixed: list[tuple[str, str]], router: Router | None) -> None:
        self.router = router
        self._fixed = fixed
        self._all: dict[str, EngineServer] = {url: EngineServer(url, node) for url, node in fixed}

    def current(self) -> list[EngineServer]:
        """The engines now: the flags', else those the members advertise in etcd."""
        if self._fixed or self.router is None:
            return list(self._all.values())
        seen = []
        for f in self.router.followers():
            url = f.info.engine_url.rstrip("/")
            if url:
                engine = self._all.get(url)
                if engine is None or engine.node_id != f.node_id:
                    engine = self._all[url] = EngineServer(url, f.node_id)
                seen.append(engine)
        return seen

    def failed(self, engine: EngineServer, why: str) -> None:
        engine.failures += 1
        engine.error = why
        engine.down_until = time.monotonic() + backoff_s(engine.failures)
        if engine.failures == 1:
            log.warning("engine %s (%s) left out: %s", engine.url, engine.node_id or "-", why)

    def passed(self, engine: EngineServer) -> None:
        if engine.failures:
            log.info("engine %s (%s) is back", engine.url, engine.node_id or "-")
        engine.failures, engine.error, engine.down_until = 0, "", 0.0

    def models(self) -> dict[str, int]:
        """Every model an engine serves, with the smallest max_model_len known for it."""
        out: dict[str, int] = {}
        for e in self.current():
            for model, length in e.models.items():
                known = [n for n in (out.get(model, 0), length) if n]
                out[model] = min(known) if known else 0
        return out

    async def check_forever(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.gather(*(self.check(session, e) for e in self.current()))
            await asyncio.sleep(CHECK_EVERY_S)

    async def check(self, session: aiohttp.ClientSession, engine: EngineServer) -> None:
        """GET /health, then /v1/models (once) for the served models and their context."""
        timeout = aiohttp.ClientTimeout(total=5)
        try:
            async with session.get(engine.url + "/health", timeout=timeout) as r:
                if r.status != 200:
                    raise aiohttp.ClientError(f"/health answered {r.status}")
            if not engine.models:
                async with session.get(engine.url + "/v1/models", timeout=timeout) as r:
                    body: Any = await r.json()
                engine.models = {str(m["id"]): int(m.get("max_model_len") or 0)
                                 for m in body.get("data", [])}
        except (TimeoutError, aiohttp.ClientError, ValueError, KeyError) as e:
            if engine.up(time.monotonic()) or engine.failures == 0:
                self.failed(engine, f"health check: {e or type(e).__name__}")
            return
        self.passed(engine)
