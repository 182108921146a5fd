"""The virtual clock's link: time that moves only by the cost model's charges.

Owns: `VirtualLink`, a simulated clock with three timelines, all from 0: the compute stream
(`tc`), one FIFO copy engine (free at `te`) and the host CPU's expert jobs (free at `th`).
A copy's data moves for real at issue (so results are exact); its time is the profile's
bytes / bandwidth + latency on the copy engine. A wait on an unfinished copy moves `tc` to its
end (an exposed stall); `compute(seconds)` is what the clock observer charges (observer.py).
Deterministic: the same run gives the same times on any machine.
Does not own: the interface and the H2D-hiding bookkeeping (offload/link.py `Link`), the real
links (`WallLink`, `CudaLink` there), what a step costs (costmodel.py).
"""

from __future__ import annotations

import torch

from specter.offload.host import HostJob
from specter.offload.link import Link, LinkProfile, Transfer, check_compute, copy_data


class VirtualTransfer(Transfer):
    def __init__(self, nbytes: int, start: float, end: float, link: VirtualLink) -> None:
        super().__init__(nbytes)
        self.start, self.end = start, end
        self._link = link

    def done(self) -> bool:
        # complete once the compute clock has reached its end
        return self.end <= self._link.now()


class VirtualLink(Link):
    """Simulated clock: compute time `tc`, one FIFO copy engine free at `te`, both from 0."""

    kind = "virtual"
    charged = True

    def __init__(self, profile: LinkProfile, device: torch.device) -> None:
        super().__init__(profile, device)
        self._tc = 0.0
        self._te = 0.0
        self._th = 0.0  # the host CPU's expert jobs

    def now(self) -> float:
        return self._tc

    def mark(self) -> float:  # the clock's value: a mark is known at once
        return self._tc

    def host_free(self) -> float:
        return self._th

    def copy_engine_free(self) -> float:
        return self._te

    def host(self, fn, seconds: float) -> HostJob:
        # the data now (the same arithmetic as later), the time on the host's own timeline
        check_compute(seconds)
        job = HostJob(seconds)
        job.start = max(self._tc, self._th)
        job.end = self._th = job.start + seconds
        self._host_busy[0] += seconds
        job.value = fn()
        job.finished.set()
        return job

    def wait_host(self, job: HostJob):
        if job.end > self._tc:
            self.host_wait_s += job.end - self._tc
            self._tc = job.end
        return job.value

    def _issue(self, dst: torch.Tensor, src: torch.Tensor, nbytes: int, after=None) -> Transfer:
        # issued at tc, it starts when the engine is free and occupies it for the modelled time
        start = max(self._tc, self._te)
        end = start + self.profile.transfer_s(nbytes)
        self._te = end
        copy_data(dst, src)  # data correctness now; time moves only by the model
        return VirtualTransfer(nbytes, start, end, self)

    def wait(self, t: Transfer) -> None:
        # a wait on an unfinished copy moves compute time to its end: an exposed stall
        if t.end > self._tc:
            self._waits.append((self._tc, t.end))
            self._tc = t.end

    def compute(self, seconds: float) -> None:
        check_compute(seconds)
        self._tc += seconds

    def synchronize(self) -> None:
        # every copy's data is already in place and its times known; the compute clock is
        # left alone (the engine may be ahead of it, which is fine between requests)
        return None
