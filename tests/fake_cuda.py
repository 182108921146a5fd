"""A stand-in for `torch.cuda` on the CPU that logs every wait a CUDA run would make.

`CudaLink(profile, cpu, cuda=FakeCuda())` runs the real CUDA link's code (its copy stream, its
events, its waits) over CPU tensors, so a CPU test can count what the decode path asks of a
GPU: device-wide synchronizes, stream and event synchronizes (by the stream they wait on), and
cross-stream waits (which stream waits, on which stream's event, or on a whole stream).
Copies still run at once on the CPU (the data is right); times are `perf_counter` readings
taken at each event's `record`.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class WaitLog:
    device_syncs: int = 0  # torch.cuda.synchronize: the host waits for every stream
    stream_syncs: Counter = field(default_factory=Counter)  # Stream.synchronize, by stream
    event_syncs: Counter = field(default_factory=Counter)  # Event.synchronize, by recording stream
    # stream -> what it was made to wait on: "<stream>" (an event recorded there) or
    # "<stream>:all" (wait_stream: everything queued there)
    stream_waits: list[tuple[str, str]] = field(default_factory=list)

    def host_waits_on(self, stream: str) -> int:
        """Host blocks that cover `stream`'s work: its syncs, its events' syncs, and every
        device-wide sync."""
        return self.stream_syncs[stream] + self.event_syncs[stream] + self.device_syncs

    def snapshot(self) -> "WaitLog":
        return WaitLog(self.device_syncs, Counter(self.stream_syncs), Counter(self.event_syncs),
                       list(self.stream_waits))

    def since(self, earlier: "WaitLog") -> "WaitLog":
        return WaitLog(self.device_syncs - earlier.device_syncs,
                       self.stream_syncs - earlier.stream_syncs,
                       self.event_syncs - earlier.event_syncs,
                       self.stream_waits[len(earlier.stream_waits):])


class FakeStream:
    def __init__(self, cuda: "FakeCuda", name: str):
        self.cuda, self.name = cuda, name

    def wait_event(self, event: "FakeEvent") -> None:
        self.cuda.log.stream_waits.append((self.name, event.stream))

    def wait_stream(self, other: "FakeStream") -> None:
        self.cuda.log.stream_waits.append((self.name, f"{other.name}:all"))

    def synchronize(self) -> None:
        self.cuda.log.stream_syncs[self.name] += 1


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", enable_timing: bool = False):
        self.cuda, self.timing = cuda, enable_timing
        self.stream: str | None = None
        self.t: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = (stream or self.cuda.current).name
        self.t = time.perf_counter()

    def query(self) -> bool:
        return self.t is not None

    def synchronize(self) -> None:
        self.cuda.log.event_syncs[self.stream] += 1

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.timing and end.timing):
            raise RuntimeError("elapsed_time needs two timing events")
        if self.t is None or end.t is None:
            raise RuntimeError("elapsed_time of an event not recorded")
        return (end.t - self.t) * 1e3


class FakeCuda:
    """The parts of `torch.cuda` the CUDA link uses. The compute stream is "compute"; each
    `Stream()` made is "copy", "copy1", ..."""

    def __init__(self):
        self.log = WaitLog()
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self._made = 0

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 (torch.cuda's name)
        name = "copy" if self._made == 0 else f"copy{self._made}"
        self._made += 1
        return FakeStream(self, name)

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802
        return FakeEvent(self, enable_timing)

    def current_stream(self, device=None) -> FakeStream:
        return self.current

    @contextlib.contextmanager
    def stream(self, s: FakeStream):
        before, self.current = self.current, s
        try:
            yield
        finally:
            self.current = before

    def synchronize(self, device=None) -> None:
        self.log.device_syncs += 1

    # -- a captured step (specter.quant.kernels.capture_graph's stand-in) ---------------------
    captures = replays = 0
    capturing = False

    def capture_graph(self, fn, warm):
        """`capture_graph(fn, warm)` on the CPU: `warm()` twice (it must leave the state as it
        found it, as before a real capture), the device sync `torch.cuda.graph` makes, and a
        replay that runs `fn()` again, as under a capture: `is_current_stream_capturing()` is
        true and a host read raises (`no_host_reads`), as CUDA raises for one inside a
        capture (fn's Python runs at each replay here, once at the capture on a GPU: the
        same code). Its outputs are static, as a graph's: the first replay's tensors, each
        later replay's results copied into them (a caller that reads an output after the
        next replay reads the next one's, as on a GPU)."""
        for _ in range(2):
            warm()
        self.synchronize()
        self.captures += 1
        static = []

        def replay():
            self.replays += 1
            before, self.capturing = self.capturing, True
            try:
                with no_host_reads():
                    out = fn()
            finally:
                self.capturing = before
            if not static:
                static.append(out)
                return out
            from specter.decoding.verify_pieces import copy_into

            copy_into(static[0], out)
            return static[0]
        return replay

    def is_current_stream_capturing(self) -> bool:
        return self.capturing


# Tensor methods that read a value on the host: inside a CUDA graph capture each is an error
# ("operation not permitted when stream is capturing")
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_reads():
    """Inside the block every tensor host read (`HOST_READS`) raises, as inside a capture on
    a GPU: a CPU test of a captured path fails where the GPU would."""
    import torch

    own = {name: torch.Tensor.__dict__[name] for name in HOST_READS if name in torch.Tensor.__dict__}

    def refused(name):
        def read(self, *args, **kwargs):
            raise RuntimeError(f"a host read inside a CUDA graph capture: Tensor.{name} "
                               "(operation not permitted when stream is capturing)")
        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, refused(name))
    try:
        yield
    finally:
        for name in HOST_READS:
            if name in own:
                setattr(torch.Tensor, name, own[name])
            else:
                delattr(torch.Tensor, name)


class CountedCuda:
    """The real `torch.cuda`, with every host wait logged as `FakeCuda` logs them (a CUDA
    test's counter): `torch.cuda.synchronize`, `Stream.synchronize`, `Event.synchronize` (by
    the stream the event was recorded on) and cross-stream waits, patched on entry and
    restored on exit. `names` maps a stream's id to the name the log uses ("compute",
    "copy"); other streams log as "other"."""

    def __init__(self, names: dict[int, str] | None = None):
        self.log = WaitLog()
        self.names = dict(names or {})
        self._saved: list = []

    def name(self, stream) -> str:
        return self.names.get(getattr(stream, "cuda_stream", id(stream)), "other")

    def __enter__(self) -> "CountedCuda":
        import torch

        cuda, log, counter = torch.cuda, self.log, self
        saved = [(cuda, "synchronize", cuda.synchronize),
                 (cuda.Stream, "synchronize", cuda.Stream.synchronize),
                 (cuda.Stream, "wait_event", cuda.Stream.wait_event),
                 (cuda.Stream, "wait_stream", cuda.Stream.wait_stream),
                 (cuda.Event, "record", cuda.Event.record),
                 (cuda.Event, "synchronize", cuda.Event.synchronize)]
        self._saved = saved
        fns = {(owner, attr): fn for owner, attr, fn in saved}
        recorded_on: dict[int, str] = {}

        def synchronize(*a, **k):
            log.device_syncs += 1
            return fns[(cuda, "synchronize")](*a, **k)

        def stream_sync(self_):
            log.stream_syncs[counter.name(self_)] += 1
            return fns[(cuda.Stream, "synchronize")](self_)

        def wait_event(self_, event):
            log.stream_waits.append((counter.name(self_), recorded_on.get(id(event), "other")))
            return fns[(cuda.Stream, "wait_event")](self_, event)

        def wait_stream(self_, other):
            log.stream_waits.append((counter.name(self_), f"{counter.name(other)}:all"))
            return fns[(cuda.Stream, "wait_stream")](self_, other)

        def record(self_, stream=None):
            recorded_on[id(self_)] = counter.name(stream or cuda.current_stream())
            return fns[(cuda.Event, "record")](self_, stream)

        def event_sync(self_):
            log.event_syncs[recorded_on.get(id(self_), "other")] += 1
            return fns[(cuda.Event, "synchronize")](self_)

        for (owner, attr), fn in zip(((o, a) for o, a, _ in saved),
                                     (synchronize, stream_sync, wait_event, wait_stream, record,
                                      event_sync)):
            setattr(owner, attr, fn)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in self._saved:
            setattr(owner, attr, fn)

