"""A loopback forwarder of ZMQ events for routers whose subscriber connects (vllm-router's):
a member's PUB connects to `inbound`, the router's SUB to `outbound`, all on 127.0.0.1; and
HTTP on loopback that no proxy setting reaches. For tests/server/test_vllm_router_events.py
and bench/gateway.py."""

from __future__ import annotations

import threading
import urllib.request

import zmq

DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, no proxy


class Forwarder:
    """A loopback XSUB/XPUB pair on a thread: a member's PUB connects to `inbound`, the
    router's SUB to `outbound`; frames and subscriptions pass through unchanged."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.xsub, self.xpub = self.ctx.socket(zmq.XSUB), self.ctx.socket(zmq.XPUB)
        self.xsub.bind("tcp://127.0.0.1:*")
        self.xpub.bind("tcp://127.0.0.1:*")
        self.inbound = self.xsub.LAST_ENDPOINT.decode()
        self.outbound = self.xpub.LAST_ENDPOINT.decode()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="forwarder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        other = {self.xsub: self.xpub, self.xpub: self.xsub}
        for sock in other:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                other[sock].send_multipart(sock.recv_multipart())  # type: ignore[index]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in (self.xsub, self.xpub):
            sock.close(linger=0)
        self.ctx.term()


def healthy(url: str) -> bool:
    try:
        with DIRECT.open(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
