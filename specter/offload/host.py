"""The host CPU's side of offloading: its job queue and its compute copies of experts.

Owns: `HostQueue`, the host CPU's FIFO of expert jobs on a real clock (one daemon thread that
runs host-computed misses beside the device's compute and copies; a link holds one, and the
virtual link models the same queue on its own timeline, clock/virtual_link.py), `HostJob`, one
job's handle, and `HostWeights`, which copy of an expert the host computes from. On a CPU run
the host computes in the store's own dtype from the store's own buffers (the same arithmetic as
the device: lossless). Beside a GPU the store holds fp16/bf16 and the host computes in fp32
(CPUs lack fast half-precision kernels): a converted copy is made on the host thread, kept
most-recent-first up to `capacity` experts, so an expert the host computes again is converted
once, and one the draft's lookahead predicts and the plan could not load is converted during
the draft (`prepare`), before verification needs it.
Does not own: the decision to compute a miss on the host (runtime.py `_host_side`), the
link's clock (offload/link.py, clock/virtual_link.py).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict, deque

import torch

from specter.offload.store import HostExpertStore


def sleep_until(deadline: float) -> None:
    """Sleep (never spin: a spinning thread holds the GIL) until perf_counter >= deadline."""
    while (remaining := deadline - time.perf_counter()) > 0:
        time.sleep(remaining)


class HostJob:
    """Handle of one host-CPU expert job: `value` once `finished` (or `error`); `estimate_s`:
    its modelled seconds on this link's clock."""

    def __init__(self, estimate_s: float) -> None:
        self.start: float | None = None  # seconds on the link's clock, once known
        self.end: float | None = None
        self.estimate_s = estimate_s
        self.value = None
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def done(self) -> bool:
        # virtual jobs are finished at issue (their data); their time is `end`
        return self.finished.is_set()


class HostQueue:
    """The host CPU's FIFO of expert jobs on a real clock: one daemon thread runs each job's
    function (torch releases the GIL in its kernels, so it overlaps the launching thread),
    holding it to at least its `estimate_s` when the link's clock is emulated. The thread
    gets the queue and a counter, not the link, so a dropped link can be collected."""

    def __init__(self, hold: bool, busy: list[float]) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queued: deque[HostJob] = deque()
        self._thread = threading.Thread(target=_host_loop, args=(self._jobs, hold, busy),
                                        name="specter-host-experts", daemon=True)
        self._thread.start()

    def submit(self, job: HostJob, fn) -> None:
        self._queued.append(job)
        self._jobs.put((job, fn))

    def pending_s(self) -> float:
        while self._queued and self._queued[0].done():
            self._queued.popleft()
        return sum(j.estimate_s for j in self._queued)

    def stop(self, join: bool = True) -> None:
        self._jobs.put(None)
        if join:
            self._thread.join()


def _host_loop(jobs: queue.SimpleQueue, hold: bool, busy: list[float]) -> None:
    while (item := jobs.get()) is not None:
        job, fn = item
        item = None
        job.start = time.perf_counter()
        try:
            job.value = fn()
        except Exception as exc:  # surfaced to the caller by wait_host
            job.error = exc
        fn = None
        if hold:
            sleep_until(job.start + job.estimate_s)
        job.end = time.perf_counter()
        busy[0] += job.end - job.start
        job.finished.set()
        job = None


class HostWeights:
    def __init__(self, store: HostExpertStore, dtype: torch.dtype, capacity: int):
        self.store, self.dtype, self.capacity = store, dtype, capacity
        self.same = dtype == store.layout.dtype  # compute from the store's buffers
        self._copies: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()  # the host thread converts while the decoder reads
        self._queued: set[tuple[int, int]] = set()  # conversions queued, not yet made
        self.ready_hits = 0  # host jobs whose converted copy was already there
        self.prepares = 0  # conversions queued ahead of need by the lookahead

    def get(self, l: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) of expert `e` of MoE layer `l` in the host's dtype (converting now
        if no copy is kept). Runs on the host thread, inside a host job."""
        views = self.store.layout.views(self.store.flat[l][e])
        if self.same:
            return views
        with self._lock:
            w = self._copies.get((l, e))
            if w is not None:
                self._copies.move_to_end((l, e))
                self.ready_hits += 1
                return w
        w = tuple(t.to(self.dtype) for t in views)
        with self._lock:
            self._copies[(l, e)] = w
            self._queued.discard((l, e))
            while len(self._copies) > self.capacity:
                self._copies.popitem(last=False)
        return w

    def prepare(self, link, l: int, e: int, seconds: float) -> bool:
        """Queue expert `e`'s conversion on the host thread (modelled `seconds` for the host
        queue's estimate); False when there is nothing to convert."""
        with self._lock:
            if self.same or (l, e) in self._copies or (l, e) in self._queued:
                return False
            self._queued.add((l, e))
        self.prepares += 1

        def convert() -> None:
            self.get(l, e)

        link.host(convert, seconds)
        return True

    def reset_stats(self) -> None:
        self.ready_hits = self.prepares = 0
