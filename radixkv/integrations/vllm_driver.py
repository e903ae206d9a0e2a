"""A vLLM engine (`vllm.LLM`, offline) in its own process, driven over stdin/stdout: loaded once,
asked many times (tests and bench/vllm_ttft.py run it with the vLLM venv's python).

    python -m radixkv.integrations.vllm_driver --model DIR [--connector JSON] [--no-prefix-cache]

Each stdin line is a JSON command, answered by one JSON line on stdout (after a first
{"ready": ...} line once the engine is up):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": N}
        -> {"outputs": [[ids...]], "cached": [num_cached_tokens...], "s": seconds}
    {"op": "metrics"}  -> {"metrics": {name: value}} (vLLM's counters, e.g. external hits)
    {"op": "quit"}     -> exits
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF folder vLLM loads")
    p.add_argument("--connector", default=None, help="kv_transfer_config as JSON")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="turn vLLM's own (in-process) prefix cache off")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the answers go to stdout: everything vLLM prints goes to stderr
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {}
    if args.connector:
        kwargs["kv_transfer_config"] = json.loads(args.connector)
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype="bfloat16", enforce_eager=True, seed=0,
              max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_cache,
              disable_log_stats=False, **kwargs)
    out.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            break
        if op == "generate":
            params = SamplingParams(temperature=0.0, max_tokens=int(cmd.get("max_tokens", 8)),
                                    ignore_eos=bool(cmd.get("ignore_eos", False)))
            prompts = [{"prompt_token_ids": list(p)} for p in cmd["prompts"]]
            t = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            answer: dict[str, Any] = {
                "outputs": [list(r.outputs[0].token_ids) for r in results],
                "cached": [r.num_cached_tokens for r in results],
                "s": time.perf_counter() - t}
        elif op == "metrics":
            answer = {"metrics": {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                                  if hasattr(m, "value")}}
        else:
            answer = {"error": f"unknown op {op!r}"}
        out.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
