"""Counting what decoding asks of the device: aten operations, the ones that launch kernels,
host syncs and host reads (experiments/hotpath.py reports them; a counted hardware profile,
specter/clock/counted.py, charges them to the virtual clock).

`OpCounter` is a `TorchDispatchMode`: it sees every aten operation dispatched inside it and
counts it under its current `phase`. The code under measurement says three things the
dispatcher cannot see:

- `charging_only()`: host work that exists only to price a modelled clock (reading the
  router's choice to charge its experts); a real engine, timed by its own clock, would not
  issue it: not counted.
- `host_side()`: bookkeeping on tensors that live on the host in every run (the batch cache's
  mask and position ids, built on the host and copied over once): counted apart as host-side
  work, not as kernels or syncs. On a GPU run the counter tells these apart by device anyway;
  on a CPU run every tensor is on the host, so the code says it.
- `launched(kind)`: a kernel launch that is not an aten operation (a Triton kernel, a CUDA
  graph's replay): counted as a launching operation.
- `compiled_region()`: a call of a compiled graph (the compiled draft step): one graph
  replay, not counted op by op (torch.compile runs no frame under a dispatch mode).
- `to_device()`: a copy of host-built data to the device from pinned memory, which a CPU run
  cannot see (the tensor stays where it is): counted there as the launch it is on a GPU (no
  sync: a pinned copy does not block).

Without a counter entered, each is a no-op. `cuda_graph_kernels(graph)` counts what a captured
CUDA graph launches (its kernel nodes, read back from its debug dump).

What counts as what (per phase, `Counter` keys):
- `ops`: aten operations dispatched; `launching`: the ones that are not views (a kernel on a
  GPU, or at least a dispatch), plus `launched` ones;
- `syncs`: operations that make the device wait for the host: `nonzero`, `_local_scalar_dense`
  (`.item()`, `int(t)`, `bool(t)`), data-dependent shapes (`unique`, `masked_select`,
  `bincount`, `repeat_interleave` by counts), `equal`; on a GPU run also a blocking copy from
  the host to the device (torch synchronises the stream after it) and `torch.cuda.synchronize`
  (a real clock's read), which a CPU run cannot see;
- `host_reads`: Python-level `.tolist()` and `.cpu()` calls (`.tolist()` dispatches no aten
  operation), each a sync when its tensor is on the device. On a CPU run every tensor stands
  for a device tensor: an upper bound;
- `copies`: experts' host-to-device copies issued (`expert_copy()`; each is also one of the
  launching operations: its `copy_`);
- `graph_replays`: calls of a compiled graph, each also one launching operation (on CUDA a
  captured graph's replay is one launch; on the CPU it stands for the whole compiled step);
  `graph_kernels`: the kernels those replays run, where the caller knows them
  (`graph_kernels()`: verification's pieces), so kernels = launching - graph_replays +
  graph_kernels;
- `host_side`: operations and reads on host-resident tensors (`host_side()`, or on a GPU run
  any sync or read whose tensors are all on the host): host time, no kernel, no wait.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Kernels a custom op launches on a GPU (its Triton launches; its output allocations launch
# none), by the op's qualified name. A dispatch mode sees a custom op's call as one operation
# whatever it runs inside, and inductor sees it as one fallback; on the CPU its body may be
# another implementation (torch's operations, specter/quant/kernels.py): the counters count
# what a GPU launches.
DEVICE_LAUNCHES = {"specter::int4_moe_pairs": 2, "specter::int4_moe_proj": 1,
                   "specter::route_topk": 1, "specter::mla_decode": 1,
                   "specter::add_rms_norm": 1, "specter::silu_mul_gemv": 1,
                   "specter::expert_round": 2, "specter::mla_attend": 1}

SYNC_OPS = {"nonzero", "_local_scalar_dense", "_unique2", "unique_dim", "unique_consecutive",
            "masked_select", "bincount", "repeat_interleave", "equal", "is_nonzero",
            "nonzero_static"}
# repeat_interleave syncs only with a tensor of counts (its output size); counted as one.

_ACTIVE: list["OpCounter"] = []  # entered counters, innermost last


@contextlib.contextmanager
def _every_counter(depth: str):
    with contextlib.ExitStack() as stack:
        for c in list(_ACTIVE):
            stack.enter_context(c._depth(depth))
        yield


def charging_only():
    """Host work that only charges a modelled clock: not counted."""
    return _every_counter("paused")


def routed_counts(routes: torch.Tensor) -> list[tuple[int, list[int]]]:
    """A compiled step's routing `routes` [L, T, k], read once on the host for charging only:
    per layer, its tokens and the tokens each chosen expert got (in expert order)."""
    with charging_only():
        layers = routes.tolist()  # one read of the step's routing: charging only
    out = []
    for rows in layers:
        per_expert = Counter(e for row in rows for e in row)
        out.append((len(rows), [per_expert[e] for e in sorted(per_expert)]))
    return out


class _Marks:
    """What the code says of itself, the same for every counter (and for a counter entered
    inside the block): the depth of `host_side()` blocks. Entering one costs an increment, with
    or without a counter: the batch cache enters several per forward."""
    host = 0


@contextlib.contextmanager
def host_side():
    """Operations on host-resident tensors: counted as host-side work."""
    _Marks.host += 1
    try:
        yield
    finally:
        _Marks.host -= 1


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host-built tensor on `device` without a host wait: from pinned memory, non-blocking
    on a GPU (torch's pinned-memory allocator keeps the source until the copy is done; a GPU
    run's counter sees the copy itself). The tensor itself on a CPU run, where the copy
    dispatches nothing: counted there as the launch it is on a GPU (no sync)."""
    if device.type == "cpu":
        for c in list(_ACTIVE):
            if c.cpu_run and not c.paused:
                c.count("launching")
        return host
    with host_side():
        pinned = host.pin_memory()
    return pinned.to(device, non_blocking=True)


def expert_copy() -> None:
    """An expert's host-to-device copy is about to be issued (its `copy_` is counted as the
    launching operation it is; this marks it as a copy too: the `copies` column)."""
    for c in list(_ACTIVE):
        if not c.paused:
            c.count("copy")


def graph_kernels(n: int) -> None:
    """The device kernels inside the graph replay just counted (its `compiled_region`): the
    `graph_kernels` column (a replay is one launching operation; its kernels still run)."""
    for c in list(_ACTIVE):
        if not c.paused:
            c.counts[c.phase]["graph_kernels"] += n


def launched(kind: str) -> None:
    """A kernel launch aten does not dispatch (`kind`: "triton", "graph")."""
    for c in list(_ACTIVE):
        if not c.paused:
            c.count("launched")


@contextlib.contextmanager
def compiled_region(count: bool = True):
    """Around a call of a compiled graph: counted as one graph replay; the counters and their
    dispatch modes step aside for the call (a compiled frame does not run under a mode).
    `count=False`: they step aside and count nothing (a capture: the warm-up's work)."""
    if not _ACTIVE:
        yield
        return
    from torch.utils._python_dispatch import _disable_current_modes

    for c in list(_ACTIVE):
        if count and not c.paused:
            c.count("graph")
    with _every_counter("paused"), _disable_current_modes():
        yield


def _on_device(args, kwargs) -> bool:
    """Whether any tensor argument lives off the host (a GPU's)."""
    from torch.utils._pytree import tree_leaves

    return any(isinstance(a, torch.Tensor) and a.device.type != "cpu"
               for a in tree_leaves((args, kwargs or {})))


def _blocking_upload(name: str, args, kwargs, out) -> bool:
    """A copy from a host tensor into a device tensor that is not `non_blocking`: torch waits
    for the stream after issuing it."""
    kwargs = kwargs or {}
    if kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]):
        return False
    src = args[1] if name == "copy_" else args[0]
    dst = args[0] if name == "copy_" else out
    return (isinstance(src, torch.Tensor) and src.device.type == "cpu"
            and isinstance(dst, torch.Tensor) and dst.device.type != "cpu")


class OpCounter(TorchDispatchMode):
    """Counts every aten operation dispatched inside it, and every `.tolist()`/`.cpu()` call,
    by the current `phase`. On a GPU run (`cpu_run=False`) a sync or a host read counts only
    when its tensor is on the GPU; on a CPU run every tensor stands for a device tensor.
    Subclasses act on each counted event through `count(kind)`."""

    def __init__(self, cpu_run: bool = True):
        super().__init__()
        self.cpu_run = cpu_run
        self.phase = "bookkeeping"
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.paused = 0  # depth of charging_only() (host_side()'s: `_Marks.host`)
        self._saved: dict = {}

    def count(self, kind: str) -> None:
        """One event of `kind`: "view", "launching", "launched", "sync", "host_read",
        "host_side"; "sync" comes after the operation's own "launching"."""
        c = self.counts[self.phase]
        if kind == "host_side":
            c["host_side"] += 1
            return
        if kind in ("view", "launching", "launched", "graph"):
            c["ops"] += 1
        if kind in ("launching", "launched", "graph"):
            c["launching"] += 1
        if kind == "copy":  # an expert's host-to-device copy (also a launching operation)
            c["copies"] += 1
        elif kind == "graph":
            c["graph_replays"] += 1
        elif kind == "sync":
            c["syncs"] += 1
        elif kind == "host_read":
            c["host_reads"] += 1

    @contextlib.contextmanager
    def _depth(self, which: str):
        setattr(self, which, getattr(self, which) + 1)
        try:
            yield
        finally:
            setattr(self, which, getattr(self, which) - 1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        launches = DEVICE_LAUNCHES.get(func.name())
        if launches is not None and not self.paused and not _Marks.host:
            with self._depth("paused"):  # its own `launched` marks: counted here instead
                out = func(*args, **(kwargs or {}))
            for _ in range(launches):
                self.count("launching")
            return out
        out = func(*args, **(kwargs or {}))
        if self.paused:
            return out
        if _Marks.host:
            self.count("host_side")
            return out
        self.count("view" if func.is_view else "launching")
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.count("sync" if self.cpu_run or _on_device(args, kwargs) else "host_side")
        elif not self.cpu_run and name in ("_to_copy", "copy_") \
                and _blocking_upload(name, args, kwargs, out):
            self.count("sync")
        return out

    def _read(self, tensor: torch.Tensor) -> None:
        if self.paused:
            return
        on_device = not _Marks.host and (self.cpu_run or tensor.device.type != "cpu")
        self.count("host_read" if on_device else "host_side")

    def __enter__(self):
        saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu")}

        def wrap(fn):
            def counted(tensor, *a, **k):
                self._read(tensor)
                return fn(tensor, *a, **k)
            return counted

        self._saved = saved
        for name, fn in saved.items():
            setattr(torch.Tensor, name, wrap(fn))
        self._cuda_sync = torch.cuda.synchronize
        if not self.cpu_run:
            def synchronize(*a, **k):
                if not self.paused:
                    self.count("sync")
                return self._cuda_sync(*a, **k)
            torch.cuda.synchronize = synchronize
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            _ACTIVE.remove(self)
            for name, fn in self._saved.items():
                setattr(torch.Tensor, name, fn)
            torch.cuda.synchronize = self._cuda_sync


# a node's record label opens with its type (a newline, literal or escaped, may come first)
_KERNEL_NODE = re.compile(r'label="\{?(?:\s|\\n)*(?:KERNEL|MEMSET)\b')


def dot_kernels(dot: str) -> int:
    """Kernel nodes (and memsets: each also a pass over the device) in a CUDA graph's DOT dump
    (cudaGraphDebugDotPrint's format: one record node per graph node, its label opening with
    its type: KERNEL, MEMSET, MEMCPY, EMPTY, ...)."""
    return len(_KERNEL_NODE.findall(dot))


def cuda_graph_kernels(graph) -> int | None:
    """Kernel nodes of a captured `torch.cuda.CUDAGraph` made with `enable_debug_mode()`
    before its capture (None where the dump is unavailable)."""
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        graph.debug_dump(path)
        with open(path) as f:
            return dot_kernels(f.read())
    except (RuntimeError, OSError, AttributeError):
        return None
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)
