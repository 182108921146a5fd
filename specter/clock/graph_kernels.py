"""Kernels inside a compiled step: what one replay of a captured graph runs on the device.

A captured CUDA graph is one launch for the host, but the device still runs its kernels one
after another, each with a floor of a few microseconds (docs/clocks.md, "The kernel floor").
So the clock needs to know how many kernels a captured step holds. They are counted when the
step is compiled or captured, never while it runs:

- `KernelTally` wraps torch.compile's backend (`tally.backend(compiler)`) and records each
  compiled graph's kernels: with inductor, the scheduler's nodes after fusion (each fused or
  single node one generated kernel, each extern call, a GEMM or attention, one library
  kernel; no-op nodes, a multi-output's unpacking and fallback views none; a custom op,
  one opaque fallback, what `DEVICE_LAUNCHES` says it launches on a GPU), as inductor generates them for this machine's device (on the CPU
  an estimate of what its Triton code on a GPU launches: the same graph, fused by the same
  scheduler); with any other backend (`eager`, the tests' graph check), the graph's
  operations unfused (every call that is not a view or an item read: an upper bound).
  A graph inductor finds in its on-disk caches skips the scheduler, so each count is also
  stored beside those caches (`CountStore`, keyed by the graph's code, its inputs' shapes,
  dtypes, strides and devices, and torch's version); a cached graph whose count is not there
  (compiled before the store existed) is compiled again with the caches off and counted.
- `cuda_graph_kernels(graph)` (specter/counting.py, re-exported): on CUDA, the kernel nodes
  of a captured graph itself (`torch.cuda.CUDAGraph.debug_dump`, read back), the count that
  settles the estimate.

Does not own: what a kernel costs (costmodel.py `HardwareProfile.kernel_floor_s`), when a
step is charged (observer.py `ComputeClock.captured_step`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

# Kernels a custom op launches on a GPU, by its qualified name (counting.py owns the table:
# the op counter counts an eager call by it too).
from specter.counting import DEVICE_LAUNCHES, cuda_graph_kernels, dot_kernels  # noqa: F401 (re-exported)

# calls in a dynamo graph that launch nothing: views, shape reads and Python glue
_NO_KERNEL = {"getitem", "size", "dim", "view", "reshape", "unsqueeze", "squeeze", "transpose",
              "permute", "expand", "flatten", "unflatten", "unbind", "split", "chunk", "narrow",
              "select", "t", "contiguous", "detach", "type_as", "numel", "stride", "item",
              "view_as", "expand_as", "is_floating_point", "movedim", "_assert", "getattr",
              "sym_size", "sym_numel", "sym_stride", "_set_grad_enabled", "dtype"}


def _fx_kernels(gm: torch.fx.GraphModule) -> int:
    """The operations of a dynamo graph that run a kernel when executed eagerly (unfused)."""
    n = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        target = node.target
        name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
        if name.split(".")[-1] not in _NO_KERNEL:
            n += 1
    return n


def _is_view(op) -> bool:
    """An aten overload that returns an alias of its input without writing it (a view)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(
        r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)




def _op_name(op) -> str:
    schema = getattr(op, "_schema", None)
    return schema.name if schema is not None else ""


def _launches(node) -> int:
    """Kernels a scheduler node launches: none for a no-op, for a multi-output's unpacking
    (`MultiOutput`) and for a fallback that is a view (view_as_real, unsqueeze: aliases);
    a custom op's `DEVICE_LAUNCHES`; one for every other node (a generated kernel, fused or
    single, or a library call)."""
    from torch._inductor import ir
    from torch._inductor import scheduler as sched

    if isinstance(node, sched.NopKernelSchedulerNode):
        return 0
    buf = getattr(node, "node", None)
    if isinstance(buf, ir.MultiOutput):
        return 0
    if isinstance(buf, ir.FallbackKernel):
        op = getattr(buf, "op_overload", None)
        if _is_view(op):
            return 0
        return DEVICE_LAUNCHES.get(_op_name(op), 1)
    return 1


def node_label(node) -> str:
    """A scheduler node as one line: what it is (a generated kernel, or the library call or
    custom op it falls back to) and the graph's operations it was made from."""
    buf = getattr(node, "node", None)
    op = getattr(buf, "op_overload", None) or getattr(buf, "python_kernel_name", None)
    kind = str(op) if op is not None else "generated"
    origins = set()
    for part in (node.get_nodes() if hasattr(node, "get_nodes") else [node]):
        for origin in getattr(getattr(part, "node", None), "origins", None) or ():
            origins.add(str(origin.target).replace("aten.", "").replace(".default", ""))
    return f"{kind}: {' '.join(sorted(origins))}"


@contextlib.contextmanager
def _scheduler_tally(into: list, labels: list | None = None):
    """While inductor compiles: each graph's kernels after fusion appended to `into` (and,
    given `labels`, each launching node's `node_label`)."""
    from torch._inductor import scheduler as sched

    codegen = sched.Scheduler.codegen

    def counted(self, *a, **k):
        into.append(sum(_launches(n) for n in self.nodes))
        if labels is not None:
            labels.extend(node_label(n) for n in self.nodes for _ in range(_launches(n)))
        return codegen(self, *a, **k)

    sched.Scheduler.codegen = counted
    try:
        yield
    finally:
        sched.Scheduler.codegen = codegen


# what the count of a graph depends on beyond its code and inputs: this module's rules
_COUNT_RULES = "launches-v1:" + json.dumps(sorted(DEVICE_LAUNCHES.items()))


def graph_key(gm: torch.fx.GraphModule, example_inputs) -> str:
    """A compiled graph's identity for its kernel count: its code, its inputs' shapes, strides,
    dtypes and devices, torch's version and the counting rules."""
    inputs = [(tuple(t.shape), tuple(t.stride()), str(t.dtype), t.device.type)
              if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
    text = json.dumps([gm.code, inputs, torch.__version__, _COUNT_RULES], default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class CountStore:
    """Kernel counts of compiled graphs on disk, beside inductor's caches (its cache_dir, or
    `root`), one small JSON file a graph."""

    def __init__(self, root: Path | None = None):
        if root is None:
            from torch._inductor.runtime.cache_dir_utils import cache_dir
            root = Path(cache_dir())
        self.root = Path(root) / "specter_kernel_counts"

    def get(self, key: str) -> list[int] | None:
        try:
            return json.loads((self.root / f"{key}.json").read_text())["graphs"]
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put(self, key: str, graphs: list[int]) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"graphs": graphs}, f)
            os.replace(tmp, self.root / f"{key}.json")
        except OSError:
            pass  # a count not stored is counted again next time


class KernelTally:
    """The kernels of each graph a torch.compile call compiled (`graphs`, in compile order);
    `kernels` is the latest full set's total (a step that compiles again, for new buffers,
    replaces it). `store`: where counts persist across processes (`CountStore`)."""

    def __init__(self, store: CountStore | None = None, labels: bool = False):
        self.graphs: list[int] = []
        self.how = ""
        self.store = store
        # each kernel's `node_label` (lowered afresh, the caches off), or None
        self.labels: list[str] | None = [] if labels else None

    @property
    def kernels(self) -> int:
        return sum(self.graphs)

    def backend(self, compiler: str):
        """A torch.compile backend: `compiler` ("inductor", "eager", ...) that records each
        compiled graph's kernels here."""
        def compile_counted(gm: torch.fx.GraphModule, example_inputs):
            self.graphs = []
            if compiler != "inductor":
                self.graphs.append(_fx_kernels(gm))
                self.how = f"{compiler}: the graph's operations, unfused"
                from torch._dynamo.backends.registry import lookup_backend
                return lookup_backend(compiler)(gm, example_inputs)
            self.how = f"inductor ({_device_of(example_inputs)}): kernels after fusion"
            store = self.store or CountStore()
            key = graph_key(gm, example_inputs)
            found: list[int] = []
            if self.labels is None:
                with _scheduler_tally(found):  # the caches on: a hit lowers nothing
                    compiled = _compile_quietly(gm, example_inputs)
                if not found:  # a cached graph: its count as stored
                    found = store.get(key) or []
            else:
                self.labels.clear()  # listed: always lowered afresh (below)
            if not found:  # counted afresh, the caches off
                from torch._functorch import config as functorch_config
                from torch._inductor import config as inductor_config
                with _scheduler_tally(found, self.labels), \
                        inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False), \
                        functorch_config.patch(enable_autograd_cache=False):
                    compiled = _compile_quietly(gm, example_inputs)
            if found:
                store.put(key, found)
            self.graphs.extend(found)
            return compiled
        return compile_counted


def _compile_quietly(gm, example_inputs):
    from torch._inductor.compile_fx import compile_fx

    with warnings.catch_warnings():  # a graph lowered again repeats its once-a-graph notes
        warnings.filterwarnings("ignore", message="Torchinductor does not")
        return compile_fx(gm, example_inputs)


def _device_of(example_inputs) -> str:
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cpu"
