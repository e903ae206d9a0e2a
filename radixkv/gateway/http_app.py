"""`radixkv gateway`: an OpenAI-compatible front end for N engine servers (vLLM's `vllm serve`,
each with the radixkv connector on its host's member).

    POST /v1/completions, /v1/chat/completions
        -> the body checked (JSON, model, context) and tokenized as the engine will (prompts.py)
        -> the engines ranked by cached prefix and load (choice.py, over the cluster index)
        -> passed to the best one up; the next if it cannot be reached (proxy.py)
    GET /v1/models, /health, /metrics (Prometheus)

With a token (`--auth-token-file`) every path but /health needs `Authorization: Bearer TOKEN`;
the caller's header is not passed on to the engines."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import prometheus_client as prom
from aiohttp import web

from radixkv.cluster.router import Router
from radixkv.gateway.choice import choose
from radixkv.gateway.engines import Engines
from radixkv.gateway.prompts import BadRequest, Prompts
from radixkv.gateway.proxy import CutOff, Unreachable, error_body, forward

log = logging.getLogger("radixkv.gateway")

BANNER = "radixkv gateway listening on"
PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}
STOP_GRACE_S = 5.0  # at SIGTERM, how long answers under way may go on before they are cut


@dataclass(frozen=True)
class GatewayConfig:
    engines: list[tuple[str, str]]  # (url, node id); empty: from the members' records
    tokenizer: str
    namespace: str  # the engines' connector namespace (without a request's |salt=)
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_model_len: int = 0  # 0: as the engines' /v1/models say
    read_timeout_s: float = 600.0


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.requests = prom.Counter("radixkv_gateway_requests", "Requests answered",
                                     ["path", "status"], registry=r)
        self.decisions = prom.Counter("radixkv_gateway_route_decisions",
                                      "Routing decisions by reason and engine",
                                      ["reason", "engine"], registry=r)
        self.upstream_errors = prom.Counter("radixkv_gateway_upstream_errors",
                                            "Engines unreachable or cut off", ["engine"],
                                            registry=r)
        self.decision_s = prom.Histogram(
            "radixkv_gateway_decision_seconds", "Time to rank the engines for a prompt",
            buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2), registry=r)
        self.prompt_tokens = prom.Counter("radixkv_gateway_prompt_tokens",
                                          "Prompt tokens routed", registry=r)
        self.cached_tokens = prom.Counter(
            "radixkv_gateway_cached_prompt_tokens",
            "Prompt tokens the chosen engine's member held cached (by the index)", registry=r)


def failure(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, kind, param),
                        content_type="application/json")


class Gateway:
    def __init__(self, config: GatewayConfig, router: Router | None, prompts: Prompts) -> None:
        self.config = config
        self.router = router
        self.prompts = prompts
        self.engines = Engines(config.engines, router)
        self.metrics = GatewayMetrics()
        self._session_now: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session_now is not None, "the app is not running"
        return self._session_now

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.cleanup_ctx.append(self._session)
        return app

    async def _session(self, app: web.Application) -> Any:
        session = self._session_now = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0))
        checks = asyncio.create_task(self.engines.check_forever(session))
        yield
        checks.cancel()
        await session.close()

    @web.middleware
    async def guard(self, request: web.Request,
                    handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                    ) -> web.StreamResponse:
        """The token check, and the request counter by path and status."""
        token = self.config.token
        if token and request.path != "/health":
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                response: web.StreamResponse = failure(
                    401, "missing or wrong API key: send 'Authorization: Bearer TOKEN' with the "
                    "gateway's token", "AuthenticationError")
                self.metrics.requests.labels(request.path, "401").inc()
                return response
        try:
            response = await handler(request)
        except web.HTTPException as e:
            response = failure(e.status, e.reason, type(e).__name__)
        self.metrics.requests.labels(request.path if request.path in PATHS or request.path in (
            "/v1/models", "/health", "/metrics") else "other", str(response.status)).inc()
        return response

    async def health(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        engines = self.engines.current()
        up = [e for e in engines if e.up(now) and e.models]
        body = {"engines": len(engines), "engines_up": len(up)}
        return web.json_response(body, status=200 if up else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(body=prom.generate_latest(self.metrics.registry),
                            content_type="text/plain", charset="utf-8")

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "radixkv-gateway",
                 **({"max_model_len": n} if n else {})} for m, n in self.engines.models().items()]
        return web.json_response({"object": "list", "data": data})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError as e:
            return failure(400, f"the body is not JSON: {e}", "BadRequestError")
        if not isinstance(body, dict):
            return failure(400, "the body must be a JSON object", "BadRequestError")
        models = self.engines.models()
        model = body.get("model")
        if models and model is not None and model not in models:
            return failure(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        chat = PATHS[request.path] == "chat"
        tokenize = self.prompts.chat if chat else self.prompts.completion
        try:
            tokens = await asyncio.get_running_loop().run_in_executor(None, tokenize, body)
        except BadRequest as e:
            return failure(400, str(e), "BadRequestError", e.param)
        limit = self.config.max_model_len or models.get(str(model), 0) or min(
            (n for n in models.values() if n), default=0)
        if limit and len(tokens) >= limit:
            return failure(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, your request has {len(tokens)} input tokens. Please "
                           "reduce the length of the input.", "BadRequestError",
                           "messages" if chat else "prompt")
        return await self.route(request, raw, body, tokens)

    async def route(self, request: web.Request, raw: bytes, body: dict[str, Any],
                    tokens: list[int]) -> web.StreamResponse:
        namespace = self.config.namespace
        if body.get("cache_salt"):
            namespace += f"|salt={body['cache_salt']}"
        started = time.perf_counter()
        choice = choose(self.engines.current(), self.router, namespace, tokens)
        self.metrics.decision_s.observe(time.perf_counter() - started)
        if not choice.ranked:
            return failure(503, "no engine is configured or advertised yet", "ServiceUnavailable")
        self.metrics.prompt_tokens.inc(len(tokens))
        for n, engine in enumerate(choice.ranked):
            name = engine.node_id or engine.url
            self.metrics.decisions.labels(choice.reason if n == 0 else "failover", name).inc()
            if n == 0:
                self.metrics.cached_tokens.inc(choice.cached_tokens[engine.url])
            engine.inflight += 1
            try:
                return await forward(request, self.session, engine.url + request.path, name,
                                     raw, self.config.read_timeout_s)
            except Unreachable as e:
                self.metrics.upstream_errors.labels(name).inc()
                self.engines.failed(engine, f"unreachable: {e}")
            except CutOff as e:
                self.metrics.upstream_errors.labels(name).inc()
                self.engines.failed(engine, f"cut off mid-answer: {e}")
                return e.response
            finally:
                engine.inflight -= 1
        return failure(503, f"no engine could take the request (tried {len(choice.ranked)})",
                       "ServiceUnavailable")


async def serve(gateway: Gateway, ready: Callable[[str], None]) -> None:
    """Serve until SIGTERM or SIGINT; then stop listening, give the answers under way
    STOP_GRACE_S to finish, and close."""
    config = gateway.config
    context = None
    if config.tls_cert:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(config.tls_cert, config.tls_key)
    runner = web.AppRunner(gateway.app(), access_log=None, handle_signals=False,
                           shutdown_timeout=STOP_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port, ssl_context=context)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    port = runner.addresses[0][1]
    ready(f"{'https' if context else 'http'}://{config.host}:{port}")
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
