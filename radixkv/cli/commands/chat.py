"""`radixkv chat`: a tiny serving front end. One engine (this process) runs the real model over a
running radixkv service; every turn re-sends the whole conversation, so the KV of earlier turns
(and of a system prompt that other engines already used) comes back from the pool.

    radixkv serve --preset smollm2-135m &
    radixkv chat                                     # interactive; /reset, /quit
    radixkv chat --message "What is a generator?" --message "Show one." --json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from radixkv.cli.flags import add_connection_flags
from radixkv.engines.models import MODELS, REAL_MODEL

CHAT_MODELS = [name for name, spec in MODELS.items() if spec.tiny is None]


def register(sub: Any) -> None:
    """Add `radixkv chat`."""
    p = sub.add_parser("chat", help="chat with the real model, reusing KV through the service",
                       description="A tiny serving front end: one engine (SmolLM2-135M, CPU) "
                       "over a running service (`radixkv serve --preset smollm2-135m`). Each "
                       "turn re-sends the whole chat; prints the answer and 'reused N of M "
                       "prompt tokens, TTFT x ms (no cache: y ms)'.")
    add_connection_flags(p, "the service's Unix socket (default: $RADIXKV_SOCKET, else the "
                         "per-user socket)")
    p.add_argument("--model", default=REAL_MODEL, choices=CHAT_MODELS,
                   help=f"the model (default {REAL_MODEL}); the service must hold its KV "
                   f"layout: `radixkv serve --preset {REAL_MODEL}`")
    p.add_argument("--system", metavar="TEXT",
                   help="system prompt (default: the model's chat template's own)")
    p.add_argument("--system-file", metavar="PATH",
                   help="read the system prompt from a file (a long shared prefix)")
    p.add_argument("--message", "-m", action="append", default=[], metavar="TEXT",
                   help="a user turn; repeat for a multi-turn chat. Without it, read turns "
                   "from stdin (one line each; /reset starts over, /quit or EOF ends)")
    p.add_argument("--max-new-tokens", type=int, default=64,
                   help="longest answer in tokens (64); greedy decoding")
    p.add_argument("--namespace", default=None,
                   help="radixkv namespace (default: names the model's exact weights)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the no-cache prefill that gives the 'no cache' TTFT")
    p.add_argument("--verify", action="store_true",
                   help="also generate each answer without radixkv and say whether the "
                   "tokens are identical")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (default: torch's, one per core; 1 keeps TTFTs steady "
                   "when other work shares the cores)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object with every turn at the end (and nothing else "
                   "on stdout)")
    p.set_defaults(func=run)


def _turns(args: argparse.Namespace) -> Iterator[str]:
    if args.message:
        yield from args.message
        return
    interactive = sys.stdin.isatty() and not args.json
    while True:
        if interactive:
            print("you> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            return
        if line.strip():
            yield line.rstrip("\n")


def _check_layout(target: str | None, model: str) -> None:
    """InvalidArgument, saying how to start a fitting service, unless the service's pool holds
    the model's KV layout."""
    from kvpool.layout import KVLayout
    from radixkv.client import Client
    from radixkv.engines.models import get_spec
    from radixkv.protocol.errors import InvalidArgument, Unavailable

    preset = get_spec(model).preset
    assert preset is not None
    with Client(target) as kv:
        try:
            kv.wait_ready(timeout=5)
        except Unavailable as e:
            raise Unavailable(f"{e}: start one with `radixkv serve --preset {preset}`") from None
        have = kv.pool_info().layout
    want = KVLayout.from_preset(preset, block_size=have.block_size)
    if have != want:
        raise InvalidArgument(f"the service at {kv.target} holds KV layout {have}, but {model} "
                              f"needs {want}: start one with `radixkv serve --preset {preset}`")


def run(args: argparse.Namespace) -> int:
    """Chat over the service; 1 if a verified answer differed from the no-cache one."""
    from radixkv.engines import models
    from radixkv.engines.chat import Conversation, answer_turn
    from radixkv.engines.hf import Engine

    if args.max_new_tokens < 1:
        raise SystemExit("--max-new-tokens must be at least 1")
    system = args.system
    if args.system_file:
        try:
            with open(args.system_file) as f:
                system = f.read()
        except OSError as e:
            raise SystemExit(f"radixkv chat: cannot read --system-file: {e}") from None
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    _check_layout(args.target or args.socket, args.model)  # before the seconds of loading
    loaded = models.load(args.model, notify=lambda m: print(m, file=sys.stderr))
    engine = Engine(loaded.model, args.target or args.socket, args.namespace or loaded.namespace)
    assert engine.kv is not None
    engine.prefill_no_cache(list(range(32)))  # warm-up: first-call costs out of the TTFTs
    engine.prefill(list(range(32)), store=False)
    say(f"{args.model} ({loaded.load_s:.1f} s to load) over radixkv at {engine.kv.target}, "
        f"namespace {engine.namespace}")
    chat = Conversation(system)
    turns: list[dict[str, Any]] = []
    try:
        for user in _turns(args):
            if user.strip() == "/reset":
                chat.reset()
                say("(conversation reset)")
                continue
            result = chat.ask(user, lambda messages: answer_turn(
                engine, loaded.tokenizer, messages, args.max_new_tokens,
                baseline=not args.no_baseline, verify=args.verify))
            turns.append({"user": user, **result.to_dict()})
            say(f"assistant: {result.answer.strip()}")
            say(f"  {result.summary()}")
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"model": args.model, "namespace": engine.namespace,
                          "target": engine.kv.target, "turns": turns}, indent=2))
    return 0 if all(t["identical"] is not False for t in turns) else 1
