"""The host-to-device link: asynchronous expert copies and the compute-stream clock.

Owns: the streams / threads and events of host-to-device (H2D) copies, the clock of the
compute stream, and the H2D-hiding bookkeeping (docs/paper-notes.md, "H2D hiding"): the busy
intervals of the copy engine, the intervals the compute stream waited on a copy, and from
them `h2d_s`, `exposed_wait_s` and `hidden_frac`.
Does not own: which experts to move, when, or into which slot (the residency and prefetch
policies decide; they call `copy` and `wait`), pinning host memory (the caller pins), or the
cost of compute steps (the cost model supplies the seconds passed to `compute`).
It moves bytes and keeps time; it decides nothing.

Three kinds behind one interface, chosen once by `make_link` (clock/timing.py; docs/clocks.md):
- `virtual` (clock/observer.py `VirtualLink`, with the clock that charges it): a simulated clock with two
  resources, the compute stream (time `tc`) and one copy engine (free at `te`). Data is copied
  for real at issue; time moves only by the model, so results are deterministic and exact.
- `wall`: a background copy-engine thread that completes each transfer no earlier than
  bytes / bandwidth + latency after it starts (sleeping, never spinning); waits are measured
  in wall-clock time. A sanity check of real overlap on a CPU machine.
- `cuda`: a dedicated copy stream, `non_blocking` copies and CUDA events; times are read from
  the events. The profile is not used for timing: the real PCIe link is measured.

`copy(dst, src, nbytes=None, after=None)` charges `nbytes` to the link when given (the cost
model may charge a real model's expert size while a small model's tensors are moved); by
default the size of `src`. `after` is a fence (`fence()`: a point on the compute stream, taken
after the last kernel that reads `dst` was queued): the copy waits for it and for nothing
else, so a prefetch into one slot never waits for compute that reads other slots.

The decode path never waits for the whole device. It takes `mark()`s (a CUDA event recorded
on the compute stream; the clock's value on the other kinds) and turns them into seconds with
`elapsed` / `timestamp` once the device has passed them: `elapsed(..., wait=False)` answers
None until then, and a request's marks are read after its last token, when the host waits on
the compute stream's last event alone. `now()` on CUDA synchronizes the device: it is for
code outside decoding (calibration, the transformers baseline's own clock). Decisions made on
the host (host-computed misses) read `host_now()`, the host's own clock, which never waits.
"""

from __future__ import annotations

import math
import queue
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass

import torch

from specter.counting import expert_copy
from specter.clock.intervals import Interval, intersection_length, union_length
from specter.offload.host import HostJob, HostQueue, sleep_until

@dataclass(frozen=True)
class LinkProfile:
    bandwidth_Bps: float  # H2D bytes per second
    latency_s: float  # fixed cost per transfer

    def __post_init__(self) -> None:
        if not (self.bandwidth_Bps > 0 and math.isfinite(self.bandwidth_Bps)):
            raise ValueError(f"bandwidth_Bps must be positive and finite, got {self.bandwidth_Bps}")
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"latency_s must be >= 0 and finite, got {self.latency_s}")

    def transfer_s(self, nbytes: int) -> float:
        """Seconds the copy engine is busy with one transfer of `nbytes`."""
        return nbytes / self.bandwidth_Bps + self.latency_s


@dataclass
class LinkStats:
    n_transfers: int
    h2d_bytes: int  # bytes charged to the link
    h2d_s: float  # measure of the union of transfer busy intervals [start, end]
    exposed_wait_s: float  # measure of the union of the compute stream's wait intervals
    hidden_frac: float  # (h2d_s - |H2D ∩ waits|) / h2d_s; nan when h2d_s == 0


class Transfer(ABC):
    """Handle of one issued copy. `start` / `end` are seconds on the link's clock once known."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.start: float | None = None
        self.end: float | None = None
        self.seq = 0  # issue order on its link (`Link.copy`): copies complete in this order

    @abstractmethod
    def done(self) -> bool:
        """Whether the copy has completed as seen from the compute stream / host now."""

    def release(self) -> None:
        """Waited for: drop what kept its tensors alive (real links)."""


def copy_data(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> None:
    """dst <- src, element for element (shapes may differ when the element counts agree)."""
    view = src if src.shape == dst.shape else src.reshape(dst.shape)
    dst.copy_(view, non_blocking=non_blocking)


def _charged_bytes(dst: torch.Tensor, src: torch.Tensor, nbytes: int | None) -> int:
    if dst.numel() != src.numel() or dst.dtype != src.dtype:
        raise ValueError(f"copy needs the same element count and dtype: dst {tuple(dst.shape)} "
                         f"{dst.dtype}, src {tuple(src.shape)} {src.dtype}")
    if nbytes is None:
        return src.numel() * src.element_size()
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return int(nbytes)


def check_compute(seconds: float) -> None:
    if not seconds >= 0:  # also rejects nan
        raise ValueError(f"compute seconds must be >= 0, got {seconds}")


class Link(ABC):
    """One H2D link and the compute-stream clock; subclasses are the three kinds.

    Stats cover the transfers issued and the waits made since the last `reset_stats()`
    (construction counts as one).
    """

    kind: str = ""
    charged = False  # time moves only by the cost model's charges (the virtual link)

    def __init__(self, profile: LinkProfile, device: torch.device) -> None:
        self.profile = profile
        self.device = device
        self._transfers: list[Transfer] = []
        self._waits: list[Interval] = []
        self._pending: deque[Transfer] = deque()  # real links: copies maybe not finished
        self._seq = 0  # copies issued (Transfer.seq)
        self._host: HostQueue | None = None
        # the host's busy seconds (modelled on the virtual clock, added by the host thread on
        # real ones) and their total at the last reset
        self._host_busy, self._host_busy_base = [0.0], 0.0
        self.host_wait_s = 0.0

    # --- the interface -------------------------------------------------------------------
    def copy(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int | None = None,
             after=None) -> Transfer:
        """Issue an asynchronous copy of `src` into `dst`; the data really moves. `after`: the
        fence of the last compute that reads `dst` (None: nothing queued reads it)."""
        expert_copy()
        transfer = self._issue(dst, src, _charged_bytes(dst, src, nbytes), after)
        self._seq += 1
        transfer.seq = self._seq
        self._transfers.append(transfer)
        if not self.charged:
            self._prune_pending()
            self._pending.append(transfer)
        return transfer

    def _prune_pending(self) -> None:
        while self._pending and self._pending[0].done():  # one FIFO engine: in order
            self._pending.popleft()

    @abstractmethod
    def now(self) -> float:
        """Compute-stream time in seconds."""

    def mark(self):
        """A point on the compute timeline, taken without waiting for the device; `elapsed`
        reads the span between two marks later, `timestamp` one mark's time."""
        return self.now()

    def elapsed(self, start, end, wait: bool = False) -> float | None:
        """Seconds from mark `start` to mark `end`, or None while the device has not reached
        `end` (asking does not wait unless `wait`)."""
        return end - start

    def timestamp(self, mark) -> float:
        """Mark `mark` in seconds on this link's clock (the value `now()` had there); on CUDA
        it waits for the compute stream to reach the mark: read a request's marks after it."""
        return mark

    def span(self, t: Transfer) -> tuple[float, float] | None:
        """(start, end) of copy `t` on this link's clock once it has completed, else None
        (asking never waits)."""
        return (t.start, t.end) if t.done() and t.start is not None else None

    def fence(self):
        """A point on the compute stream after everything queued so far, for `copy(after=)`:
        None where compute runs before the host goes on (virtual, wall)."""
        return None

    def host_now(self) -> float:
        """The host's clock for host-side estimates (real links: `perf_counter`, never a
        device wait; virtual: the compute clock)."""
        return self.now()

    @abstractmethod
    def wait(self, t: Transfer) -> None:
        """The compute stream waits until `t` has completed; a real stall is recorded."""

    @abstractmethod
    def compute(self, seconds: float) -> None:
        """A modelled compute step of `seconds` (advances only the virtual clock)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait for every issued transfer (end of a request); not counted as exposed wait."""

    def stats(self) -> LinkStats:
        """H2D totals since the last reset; waits for issued transfers first (wall, cuda)."""
        self._settle()
        busy = [(t.start, t.end) for t in self._transfers]
        waits = self._wait_intervals()
        h2d = union_length(busy)
        hidden = (h2d - intersection_length(busy, waits)) / h2d if h2d > 0 else math.nan
        return LinkStats(n_transfers=len(self._transfers),
                         h2d_bytes=sum(t.nbytes for t in self._transfers),
                         h2d_s=h2d, exposed_wait_s=union_length(waits), hidden_frac=hidden)

    def reset_stats(self) -> None:
        self._transfers = []
        self._waits = []
        self._prune_pending()
        self._host_busy_base, self.host_wait_s = self._host_busy[0], 0.0

    @property
    def host_busy_s(self) -> float:
        """Seconds the host spent on expert jobs since the last reset."""
        return self._host_busy[0] - self._host_busy_base

    # --- the host CPU's expert jobs (host-computed misses) ----------------------------------
    # One FIFO queue of jobs beside the copy engine. Virtual: a job's function runs at issue
    # and its modelled seconds go on the host's own timeline. Real (wall, cuda): a host thread
    # runs the jobs in order, concurrently with device compute and copies; on the emulated
    # clock (`time_scale` != 1) a job also lasts at least its modelled seconds, scaled.
    time_scale: float = 1.0  # real seconds per modelled second (the emulated clock's scale)

    def host(self, fn, seconds: float) -> HostJob:
        """Queue `fn()` on the host CPU, modelled to take `seconds`; `wait_host` returns its value."""
        check_compute(seconds)
        if self._host is None:
            self._host = HostQueue(hold=self.time_scale != 1.0, busy=self._host_busy)
        job = HostJob(seconds * self.time_scale)
        self._host.submit(job, fn)
        return job

    def wait_host(self, job: HostJob):
        """The compute stream waits for host job `job` (counted as a host wait, not an H2D
        one); returns its value."""
        if not job.done():
            t0 = time.perf_counter()
            job.finished.wait()
            self.host_wait_s += time.perf_counter() - t0
        if job.error is not None:
            raise RuntimeError(f"host expert job failed: {job.error}") from job.error
        return job.value

    def host_free(self) -> float:
        """When the host's queue is empty, on this link's clock (real links: now plus the
        estimated seconds of the jobs not finished)."""
        now = self.host_now()
        return now + (self._host.pending_s() if self._host is not None else 0.0)

    def copy_engine_free(self) -> float:
        """When the copy engine's queue is empty (real links: now plus the profile's time for
        the bytes of the copies not finished: an estimate, the clock is real)."""
        self._prune_pending()
        return self.host_now() + sum(self.profile.transfer_s(t.nbytes) for t in self._pending)

    def close(self) -> None:
        """Release threads / streams; the link cannot copy afterwards."""
        if self._host is not None:
            self._host.stop()
            self._host = None

    def __del__(self) -> None:
        # a link dropped without close() still stops its host thread (without joining it)
        host = getattr(self, "_host", None)
        if host is not None:
            self._host = None
            host.stop(join=False)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- per kind ------------------------------------------------------------------------
    @abstractmethod
    def _issue(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, after=None) -> Transfer:
        """Start one copy charged `nbytes`, after fence `after`, and return its handle."""

    def _settle(self) -> None:
        """Make `start` / `end` of every transfer in the window known."""

    def _wait_intervals(self) -> list[Interval]:
        return list(self._waits)


# ======================================================================================
# wall
# ======================================================================================
class WallTransfer(Transfer):
    def __init__(self, nbytes: int, issued: float) -> None:
        super().__init__(nbytes)
        self.issued = issued  # perf_counter at issue
        self.error: BaseException | None = None
        self.finished = threading.Event()  # set by the engine thread after start/end

    def done(self) -> bool:
        return self.finished.is_set()


def _engine_loop(jobs: queue.SimpleQueue, profile: LinkProfile) -> None:
    """The copy engine: FIFO, one transfer at a time, until it dequeues None.

    Each transfer starts at max(its issue time, end of the previous transfer), copies the data,
    and completes at max(start + bytes / bandwidth + latency, the moment the real copy
    finished). Chaining from the previous modelled end (not from the late wake-up) keeps
    queued transfers free of drift from sleep overshoot.
    """
    engine_free = -math.inf
    while True:
        job = jobs.get()
        if job is None:
            return
        t, dst, src = job
        job = None
        start = max(t.issued, engine_free)
        try:
            copy_data(dst, src)
        except Exception as exc:  # surfaced to the caller by wait / synchronize
            t.error = exc
        dst = src = None  # do not keep the caller's tensors alive while sleeping
        end = max(start + profile.transfer_s(t.nbytes), time.perf_counter())
        sleep_until(end)
        t.start, t.end = start, end
        engine_free = end
        t.finished.set()
        t = None


def _raise_failed(t: WallTransfer) -> None:
    if t.error is not None:
        raise RuntimeError(f"wall link copy failed: {t.error}") from t.error


class WallLink(Link):
    """Real overlap on a CPU: a daemon copy-engine thread, compute waiting on its events."""

    kind = "wall"

    def __init__(self, profile: LinkProfile, device: torch.device,
                 time_scale: float = 1.0) -> None:
        super().__init__(profile, device)
        self.time_scale = time_scale  # the emulated clock's: host jobs last their scaled seconds
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last: WallTransfer | None = None
        self._closed = False
        # the thread gets the queue and profile, not self, so the link can be collected
        self._thread = threading.Thread(target=_engine_loop, args=(self._jobs, profile),
                                        name="specter-wall-copy-engine", daemon=True)
        self._thread.start()

    def now(self) -> float:
        return time.perf_counter()

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, after=None) -> Transfer:
        # compute ran on this thread before the host went on: every read of dst is done
        if self._closed:
            raise RuntimeError("wall link is closed")
        t = WallTransfer(nbytes, time.perf_counter())
        self._jobs.put((t, dst, src))
        self._last = t
        return t

    def wait(self, t: Transfer) -> None:
        # record [t0, t1] only when the compute thread actually blocked
        if not t.done():
            t0 = time.perf_counter()
            t.finished.wait()
            self._waits.append((t0, time.perf_counter()))
        _raise_failed(t)

    def compute(self, seconds: float) -> None:
        check_compute(seconds)  # the real compute already took real time

    def synchronize(self) -> None:
        # FIFO engine: the last issued transfer completes after every earlier one
        if self._last is not None:
            self._last.finished.wait()
        for t in self._transfers:
            _raise_failed(t)

    def _settle(self) -> None:
        for t in self._transfers:
            t.finished.wait()

    def close(self) -> None:
        super().close()
        if not self._closed:
            self._closed = True
            self._jobs.put(None)  # queued transfers finish first
            self._thread.join()

    def __del__(self) -> None:
        # a link dropped without close() still stops its threads (without joining them)
        super().__del__()
        if not getattr(self, "_closed", True):
            self._closed = True
            self._jobs.put(None)


# ======================================================================================
# cuda
# ======================================================================================
class CudaTransfer(Transfer):
    def __init__(self, nbytes: int, start_event: torch.cuda.Event, end_event: torch.cuda.Event,
                 dst: torch.Tensor, src: torch.Tensor) -> None:
        super().__init__(nbytes)
        self.start_event = start_event
        self.end_event = end_event
        # keep both tensors alive until the compute stream or the host has waited on the copy
        self._tensors: tuple[torch.Tensor, ...] = (dst, src)

    def done(self) -> bool:
        return self.end_event.query()

    def release(self) -> None:
        self._tensors = ()


class CudaLink(Link):
    """A dedicated copy stream; times are CUDA event timestamps relative to a base event.

    What the host waits for, and nothing more: a copy waits on the copy stream for the fence
    of the last compute reading its destination (`copy(after=)`); the compute stream waits for
    a copy on the GPU (`wait`: an event wait, no host block); marks are events read once the
    device has passed them; `stats` (after a request) waits on the copy stream's and the
    compute stream's last events. `cuda` is the `torch.cuda` module, or a stand-in with its
    Stream / Event / current_stream / stream / synchronize (tests/fake_cuda.py counts the
    waits a run makes on the CPU)."""

    kind = "cuda"

    def __init__(self, profile: LinkProfile, device: torch.device, cuda=None) -> None:
        super().__init__(profile, device)
        self._cuda = cuda if cuda is not None else torch.cuda
        self._stream = self._cuda.Stream(device=device)
        self._event_waits: list[tuple[torch.cuda.Event, CudaTransfer]] = []
        self._warned_pageable = False
        self._base: torch.cuda.Event  # recorded by reset_stats
        self.reset_stats()

    def _compute_stream(self) -> torch.cuda.Stream:
        return self._cuda.current_stream(self.device)

    def _timing_event(self) -> torch.cuda.Event:
        return self._cuda.Event(enable_timing=True)

    def now(self) -> float:
        self._cuda.synchronize(self.device)  # a device-wide wait: never on the decode path
        return time.perf_counter()

    def host_now(self) -> float:
        return time.perf_counter()

    def mark(self) -> torch.cuda.Event:
        event = self._timing_event()
        event.record(self._compute_stream())
        return event

    def fence(self) -> torch.cuda.Event:
        event = self._cuda.Event()
        event.record(self._compute_stream())
        return event

    def elapsed(self, start, end, wait: bool = False) -> float | None:
        if wait:
            end.synchronize()
        elif not end.query():
            return None
        return start.elapsed_time(end) / 1e3

    def timestamp(self, mark) -> float:
        if not mark.query():
            mark.synchronize()  # the compute stream's event: no wait on the copy stream
        return self._seconds(mark)

    def span(self, t: Transfer) -> tuple[float, float] | None:
        if not t.done():  # the end event's query: no wait
            return None
        return self._seconds(t.start_event), self._seconds(t.end_event)

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, after=None) -> Transfer:
        if src.device.type == "cpu" and not src.is_pinned() and not self._warned_pageable:
            warnings.warn("cuda link: src is pageable host memory; the copy will not overlap "
                          "compute (pin expert storage)", stacklevel=3)
            self._warned_pageable = True
        # the destination may still be read by compute queued before this call: the copy
        # waits for that compute's fence, not for everything queued on the compute stream
        if after is not None:
            self._stream.wait_event(after)
        start, end = self._timing_event(), self._timing_event()
        with self._cuda.stream(self._stream):
            start.record(self._stream)
            copy_data(dst, src, non_blocking=True)
            end.record(self._stream)
        return CudaTransfer(nbytes, start, end, dst, src)

    def wait(self, t: Transfer) -> None:
        # no host block: the compute stream waits on the copy's end event; the ready event
        # marks when compute reached this point, so the stall is [ready, end] if end > ready
        compute = self._compute_stream()
        ready = self._timing_event()
        ready.record(compute)
        compute.wait_event(t.end_event)
        self._event_waits.append((ready, t))
        t.release()

    def compute(self, seconds: float) -> None:
        check_compute(seconds)  # real kernels take real time

    def synchronize(self) -> None:
        self._stream.synchronize()
        # later compute is ordered after every copy too (no stall is recorded for this)
        self._compute_stream().wait_stream(self._stream)
        for t in self._transfers:
            t.release()

    def reset_stats(self) -> None:
        super().reset_stats()
        self._event_waits = []
        self._base = self._timing_event()
        self._base.record(self._compute_stream())

    def _seconds(self, event: torch.cuda.Event) -> float:
        return self._base.elapsed_time(event) / 1e3  # ms -> s since the base event

    def _settle(self) -> None:
        # after a request: the copy stream's work, then the compute stream's (its stall
        # events); each stream's own wait, never the whole device
        self._stream.synchronize()
        self.mark().synchronize()
        for t in self._transfers:
            t.start, t.end = self._seconds(t.start_event), self._seconds(t.end_event)
            t.release()

    def _wait_intervals(self) -> list[Interval]:
        stalls = []
        for ready, t in self._event_waits:
            r, e = self._seconds(ready), self._seconds(t.end_event)
            if e > r:
                stalls.append((r, e))
        return stalls
