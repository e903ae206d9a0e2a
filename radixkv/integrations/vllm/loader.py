"""Layer-wise loads for the vLLM connector's worker: the copy overlaps the forward.

`start` (from `start_load_kv`, before the step's forward) hands the step's loads to a thread of
their own, which copies layer 0 of every load, then the next layers in groups of doubling size
(`layer_groups`: fewer, larger copies), marking each layer done once its group is copied;
vLLM's attention of layer i waits for layer i only (`wait_layer`, from `wait_for_layer_load`),
so the forward of the first layers runs while the later ones are copied. After the last layer
the thread ends each load's lease (Release): a lease that ended before means the blocks may have
been reused while being copied, and the load's pages are reported failed, as are those of a
copy that raised (vLLM then discards the
request's output of this step and recomputes them). `finish` (after the forward, before the
step's saves and its report of failed blocks) waits for the thread.

The thread runs on the CPUs the engine's own thread is not bound to (`cpus="auto"`: vLLM's CPU
worker binds its threads with VLLM_CPU_OMP_THREADS_BIND), so that the copy runs beside the
forward rather than taking turns with it; where the engine has every CPU it shares them. Each
layer of a load is one call of the native page copy (pages_kernel.py: single-threaded, no
OpenMP); where that kernel is unavailable, vLLM's (parallel) cache-write op copies, and OpenMP
moves the thread onto the engine's first CPU when it first runs it: `_pin` puts it back after
each layer. The copies release the GIL (the native copy, torch ops, vLLM's cache-write op).
Only the thread touches the radixkv client between `start` and `finish` (the engine's thread
does not use it during the forward).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixkv.client import Client
from radixkv.integrations.layout import Pages
from radixkv.integrations.link import Down, Link
from radixkv.integrations.vllm.messages import Load
from radixkv.protocol.errors import LeaseExpired, NotFound


def release_after_copy(client: Client, lease_id: int) -> bool:
    """End a load's lease once its blocks are copied: False when the pins had already ended
    (the blocks may have been reused meanwhile, so the copy is not to be trusted)."""
    try:
        client.release(lease_id)
    except (LeaseExpired, NotFound):
        return False
    return True


def layer_groups(count: int) -> list[tuple[int, int]]:
    """The loader's copies, as [first, end) layer ranges: layer 0 alone, then groups doubling
    in size (1, 1, 2, 4, 8, ...). The forward needs layer 0 at once and each later layer only
    after the forward of those before it, which outlasts their copy many times over; fewer,
    larger calls cost less per byte (docs/vllm.md, "The page copy")."""
    groups: list[tuple[int, int]] = []
    first, size = 0, 1
    while first < count:
        end = min(count, first + size)
        groups.append((first, end))
        first = end
        if len(groups) > 1:
            size *= 2
    return groups


def parse_cpus(setting: str, engine: set[int]) -> set[int] | None:
    """The loader's CPUs: "auto" (those the engine's thread is not bound to; None, i.e. the
    engine's, if it has them all), "engine" (None), or a list such as "1,3-4"."""
    setting = setting.strip()
    if setting == "engine":
        return None
    if setting == "auto":
        others = set(range(os.cpu_count() or 1)) - engine
        return others or None
    cpus: set[int] = set()
    try:
        for part in setting.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"load_cpus {setting!r} is not 'auto', 'engine' or a CPU list such as "
                         "'1,3-4'") from None
    return cpus


@dataclass
class Job:
    """One step's loads, each with the pool view of its lease's epoch."""

    loads: list[tuple[Load, torch.Tensor]]
    layers: list[torch.Tensor]
    pages: Pages
    done_layers: list[threading.Event]
    done: threading.Event = field(default_factory=threading.Event)
    failed: set[int] = field(default_factory=set)  # loads (their index) that failed
    cpu_s: float = 0.0  # the thread's CPU time on this job
    copy_s: float = 0.0  # the thread's wall time on this job (copies and Releases)
    ran_on: list[int] = field(default_factory=list)  # the thread's CPUs at the job's end


@dataclass(frozen=True)
class Finished:
    """A finished step's loads: which failed, and what they cost."""

    loads: list[Load]
    failed: list[Load]
    wait_s: float  # the engine's thread, blocked on the loads (start + waits + finish)
    waited_layers: int  # layers the forward waited for (vLLM's wait_for_layer_load)
    cpu_s: float
    copy_s: float
    ran_on: list[int]


class LayerLoader:
    def __init__(self, link: Link, names: Sequence[str], cpus: str = "auto") -> None:
        self.link = link
        self.index = {name: i for i, name in enumerate(names)}
        self.cpus_setting = cpus
        self.cpus: set[int] | None = None
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._job: Job | None = None
        self._wait_s = 0.0
        self._waited = 0

    def _ensure_thread(self) -> None:
        if self._thread is None:
            # the engine's thread is bound by now (its first step runs after the binding)
            self.cpus = parse_cpus(self.cpus_setting, os.sched_getaffinity(0))
            self._thread = threading.Thread(target=self._run, name="radixkv-loader", daemon=True)
            self._thread.start()

    def start(self, loads: list[tuple[Load, torch.Tensor]], layers: list[torch.Tensor],
              pages: Pages) -> None:
        """Start copying `loads` (each with its pool view) into `layers`, layer by layer."""
        t0 = time.perf_counter()
        self.finish_if_pending()
        self._ensure_thread()
        job = Job(loads, layers, pages, [threading.Event() for _ in layers])
        self._job = job
        self._queue.put(job)
        self._wait_s, self._waited = time.perf_counter() - t0, 0

    @property
    def pending(self) -> bool:
        return self._job is not None

    def wait_layer(self, name: str) -> None:
        """Until layer `name` of the step's loads is copied (at once if there are none)."""
        job, i = self._job, self.index.get(name)
        if job is None or i is None:
            return
        t0 = time.perf_counter()
        job.done_layers[i].wait()
        self._wait_s += time.perf_counter() - t0
        self._waited += 1

    def finish(self) -> Finished | None:
        """Wait for the step's loads (copies and Releases); None if there were none."""
        job = self._job
        if job is None:
            return None
        t0 = time.perf_counter()
        job.done.wait()  # a copy always ends: never a bound here (a late copy is wrong KV)
        self._job = None
        loads = [ld for ld, _ in job.loads]
        return Finished(loads, [loads[k] for k in sorted(job.failed)],
                        self._wait_s + time.perf_counter() - t0, self._waited, job.cpu_s,
                        job.copy_s, job.ran_on)

    def finish_if_pending(self) -> Finished | None:
        return self.finish() if self._job is not None else None

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(30)
            self._thread = None

    # ---- the loader thread -----------------------------------------------------------------

    def _pin(self) -> None:
        """Keep this thread on `cpus`. OpenMP (GOMP_CPU_AFFINITY or OMP_PLACES, as vLLM binds
        its threads) binds a thread to the first place when it first opens a parallel region,
        as vLLM's cache-write op does: the thread is put back once, after which it stays."""
        if self.cpus is None or os.sched_getaffinity(0) == self.cpus:
            return
        try:
            os.sched_setaffinity(0, self.cpus)  # this thread only
        except OSError as e:
            self.link.log.warning("radixkv: cannot pin the KV loader to CPUs %s (%s); it "
                                  "shares the engine's", sorted(self.cpus), e)
            self.cpus = None

    def _run(self) -> None:
        self._pin()
        while True:
            job = self._queue.get()
            if job is None:
                return
            c0, t0 = time.thread_time(), time.perf_counter()
            try:
                self._copy(job)
                self._release(job)
            except BaseException as e:  # noqa: BLE001 - never leave the forward waiting
                job.failed.update(range(len(job.loads)))
                self.link.log.error("radixkv: the KV loader failed: %s: %s", type(e).__name__, e)
            finally:
                for ev in job.done_layers:
                    ev.set()
                job.cpu_s, job.copy_s = time.thread_time() - c0, time.perf_counter() - t0
                job.ran_on = sorted(os.sched_getaffinity(0))
                job.done.set()

    def _copy(self, job: Job) -> None:
        for first, end in layer_groups(len(job.layers)):
            for k, (ld, view) in enumerate(job.loads):
                if k in job.failed:
                    continue
                try:
                    job.pages.from_pool(job.layers[first:end], ld.pages, view[:, first:end],
                                        ld.blocks)
                except Exception as e:  # noqa: BLE001 - this load fails, the others go on
                    job.failed.add(k)
                    self.link.log.error("radixkv: cannot copy request %s's KV into vLLM's "
                                        "pages: %s: %s", ld.req_id, type(e).__name__, e)
            for i in range(first, end):
                job.done_layers[i].set()
            self._pin()

    def _release(self, job: Job) -> None:
        """End every lease (a failed load's too: its pins are no longer needed)."""
        for k, (ld, _) in enumerate(job.loads):
            if not self._release_one(ld):
                job.failed.add(k)

    def _release_one(self, ld: Load) -> bool:
        try:
            return self.link.call(lambda client: release_after_copy(client, ld.lease_id))
        except Down:
            return False

