"""A vLLM engine (`vllm.LLM`, offline) in its own process, driven over stdin/stdout: loaded once,
asked many times (tests and bench/vllm_ttft.py run it with the vLLM venv's python; `Driver` is
the parent's side and imports no vLLM).

    python -m radixkv.integrations.vllm.driver --model DIR [--connector JSON] [--no-prefix-cache]

Each stdin line is a JSON command, answered by one JSON line on stdout (after a first
{"ready": ...} line once the engine is up):

    {"op": "generate", "prompts": [[ids...], ...], "max_tokens": N, "salt": S (optional)}
        -> {"outputs": [[ids...]], "cached": [num_cached_tokens...], "s": seconds,
            "ttft": [vLLM's time to first token per request, seconds (null if not measured)],
            "queued": [queued -> scheduled, s], "prefill": [scheduled -> first token, s]}
    {"op": "metrics"}  -> {"metrics": {name: value}} (vLLM's counters, e.g. external hits)
    {"op": "quit"}     -> exits
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO


class Driver:
    """The parent's side: starts the driver with `python` (the vLLM venv's), sends commands,
    reads answers (each within a timeout); vLLM's output goes to `log`."""

    def __init__(self, python: str, model: str, log: Path, connector: dict[str, Any] | None,
                 cpu: str = "0", extra: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 start_timeout: float = 240.0) -> None:
        self.log = log
        args = [python, "-m", "radixkv.integrations.vllm.driver", "--model", model, *extra]
        if connector is not None:
            args += ["--connector", json.dumps(connector)]
        repo = str(Path(__file__).resolve().parents[3])
        full_env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=cpu, PYTHONPATH=repo,
                        **(env or {}))
        self._stderr: TextIO = open(log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._stderr, text=True, env=full_env)
        try:
            self.ready = self._read(start_timeout)
        except BaseException:
            self.close()
            raise

    def _read(self, timeout: float) -> dict[str, Any]:
        out = self.proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout)  # answers are whole lines
        if not ready:
            raise AssertionError(f"vLLM gave no answer within {timeout:g} s:\n"
                                 f"{self.stderr()[-4000:]}")
        line = out.readline()
        if not line:
            raise AssertionError(f"vLLM exited {self.proc.wait()}:\n{self.stderr()[-4000:]}")
        return dict(json.loads(line))

    def ask(self, timeout: float = 300.0, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def generate(self, *prompts: list[int], max_tokens: int = 8,
                 salt: str | None = None) -> dict[str, Any]:
        """Greedy completions; `salt` is vLLM's cache_salt for every prompt (a salted prompt
        shares no cached blocks with unsalted ones, neither vLLM's nor radixkv's)."""
        return self.ask(op="generate", prompts=list(prompts), max_tokens=max_tokens, salt=salt)

    def external_hits(self) -> float:
        metrics = self.ask(op="metrics")["metrics"]
        return float(metrics.get("vllm:external_prefix_cache_hits", 0))

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")

    def quit(self) -> None:
        """Ask it to quit, not waiting (engines stopped together shut down side by side)."""
        if self.proc.poll() is None and self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        """Ask it to quit; kill it after 60 s."""
        self.quit()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.close()


def _ttft(result: Any) -> float | None:
    metrics = getattr(result, "metrics", None)
    latency = getattr(metrics, "first_token_latency", 0.0) if metrics is not None else 0.0
    return float(latency) if latency else None


def _span(result: Any, start: str, end: str) -> float | None:
    """Seconds between two of vLLM's per-request engine timestamps (None if not recorded)."""
    metrics = getattr(result, "metrics", None)
    t0, t1 = (getattr(metrics, name, 0.0) for name in (start, end))
    return float(t1 - t0) if t0 and t1 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
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
            salt = {"cache_salt": cmd["salt"]} if cmd.get("salt") else {}
            prompts = [{"prompt_token_ids": list(p), **salt} for p in cmd["prompts"]]
            t = time.perf_counter()
            results = llm.generate(prompts, params, use_tqdm=False)
            answer: dict[str, Any] = {
                "outputs": [list(r.outputs[0].token_ids) for r in results],
                "cached": [r.num_cached_tokens for r in results],
                "s": time.perf_counter() - t,
                "ttft": [_ttft(r) for r in results],
                "queued": [_span(r, "queued_ts", "scheduled_ts") for r in results],
                "prefill": [_span(r, "scheduled_ts", "first_token_ts") for r in results]}
        elif op == "metrics":
            answer = {"metrics": {m.name: getattr(m, "value", None) for m in llm.get_metrics()
                                  if hasattr(m, "value")}}
        else:
            answer = {"error": f"unknown op {op!r}"}
        out.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
