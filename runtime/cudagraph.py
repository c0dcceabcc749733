"""CUDA graphs through the driver API (PyCUDA 2026.1 has none): capture a stream's launches once,
replay them with one call.

Uses libcuda via ctypes on the pycuda stream's handle: cuStreamBeginCapture, cuStreamEndCapture,
cuGraphInstantiateWithFlags, cuGraphLaunch, cuGraphExecDestroy, cuGraphDestroy. Kernels read every
run-time size from the dims buffer in the arena, so one captured graph replays any step.
"""

from __future__ import annotations

import ctypes
import ctypes.util

from atlasc.errors import AtlasError

CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC = 1
CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC = 1
PDL_ENV = "ATLAS_PDL"


class EdgeData(ctypes.Structure):
    """CUgraphEdgeData (cuda.h): from_port, to_port, type, 5 reserved bytes."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


CUDA_ERROR_OUT_OF_MEMORY = 2


class CudaGraphError(AtlasError):
    """A CUDA graph driver call failed; `code` is its CUresult (0 when no driver call gave one)."""

    code = 0


_lib = None


def _libcuda():
    global _lib
    if _lib is None:
        name = ctypes.util.find_library("cuda") or "libcuda.so.1"
        try:
            _lib = ctypes.CDLL(name)
        except OSError as e:
            raise CudaGraphError(f"cannot load libcuda for CUDA graphs: {e}") from None
    return _lib


def _check(result: int, what: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(msg))
        error = CudaGraphError(f"{what} failed: {msg.value.decode() if msg.value else result}")
        error.code = result
        raise error


def chain_ends(frm: list, to: list) -> set:
    """The nodes of a graph's edges (frm[i] -> to[i]) with no edge in or no edge out: a captured chain's first
    and last node."""
    sources, targets = set(frm), set(to)
    return (sources - targets) | (targets - sources)


def make_programmatic(graph, plain_ends: bool = False) -> int:
    """Turn every plain kernel -> kernel edge of an (uninstantiated) graph into a programmatic one
    (from port CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC): the downstream kernel's blocks may be scheduled
    once every upstream block has run griddepcontrol.launch_dependents, and its griddepcontrol.wait
    holds it until the upstream grid has completed with its writes visible (atlasc kernels wait before they
    read what an earlier kernel wrote and trigger at their end, or earlier with early weights: atlas::pdl_enter /
    pdl_leave in codegen/common.cuh, codegen/linear.py). plain_ends: the edges out of the graph's first node and
    into its last one stay plain (the staging kernels of runtime/staging.py, which do not wait). Returns how many
    edges changed."""
    lib = _libcuda()
    calls = {}
    for name in ("cuGraphGetEdges_v2", "cuGraphRemoveDependencies_v2", "cuGraphAddDependencies_v2"):
        calls[name] = getattr(lib, name, None)
        if calls[name] is None:  # drivers before CUDA 12.3 have no edge data
            raise CudaGraphError(f"this CUDA driver has no {name}: no programmatic graph edges")
    get_edges = calls["cuGraphGetEdges_v2"]
    count = ctypes.c_size_t(0)
    _check(get_edges(graph, None, None, None, ctypes.byref(count)), "cuGraphGetEdges")
    n = count.value
    if n == 0:
        return 0
    frm, to, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (EdgeData * n)()
    _check(get_edges(graph, frm, to, data, ctypes.byref(count)), "cuGraphGetEdges")

    def is_kernel(node) -> bool:
        kind = ctypes.c_int(-1)
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        return kind.value == CU_GRAPH_NODE_TYPE_KERNEL

    ends = chain_ends(list(frm), list(to)) if plain_ends else set()
    picked = [i for i in range(n) if data[i].from_port == 0 and data[i].type == 0
              and is_kernel(frm[i]) and is_kernel(to[i]) and frm[i] not in ends and to[i] not in ends]
    if not picked:
        return 0
    m = len(picked)
    sel_from = (ctypes.c_void_p * m)(*[frm[i] for i in picked])
    sel_to = (ctypes.c_void_p * m)(*[to[i] for i in picked])
    _check(calls["cuGraphRemoveDependencies_v2"](graph, sel_from, sel_to, (EdgeData * m)(), ctypes.c_size_t(m)),
           "cuGraphRemoveDependencies")
    new = (EdgeData * m)()
    for e in new:
        e.from_port, e.type = CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    _check(calls["cuGraphAddDependencies_v2"](graph, sel_from, sel_to, new, ctypes.c_size_t(m)),
           "cuGraphAddDependencies")
    return m


class CapturedGraph:
    """The launches issued by `record()` on `stream`, instantiated and uploaded for replay (the device memory
    the driver needs for it is allocated here, not at the first launch); with programmatic=True
    its kernel-to-kernel edges become programmatic first (make_programmatic; self.programmatic counts
    them)."""

    def __init__(self, stream, record, programmatic: bool = False, plain_ends: bool = False):
        lib = _libcuda()
        self.stream_handle = ctypes.c_void_p(stream.handle)
        begin = getattr(lib, "cuStreamBeginCapture_v2", None) or lib.cuStreamBeginCapture
        _check(begin(self.stream_handle, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            record()
        except BaseException:
            lib.cuStreamEndCapture(self.stream_handle, ctypes.byref(graph))
            if graph:
                lib.cuGraphDestroy(graph)
            raise
        _check(lib.cuStreamEndCapture(self.stream_handle, ctypes.byref(graph)), "cuStreamEndCapture")
        self.graph = graph
        self.programmatic = 0
        self.exec = ctypes.c_void_p()
        try:
            if programmatic:
                self.programmatic = make_programmatic(graph, plain_ends)
            _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), graph, ctypes.c_ulonglong(0)),
                   "cuGraphInstantiate")
            # the graph's device-side resources now, not at its first launch
            _check(lib.cuGraphUpload(self.exec, self.stream_handle), "cuGraphUpload")
        except CudaGraphError:
            if self.exec:
                lib.cuGraphExecDestroy(self.exec)
                self.exec = ctypes.c_void_p()
            lib.cuGraphDestroy(graph)
            self.graph = ctypes.c_void_p()
            raise

    def launch(self) -> None:
        _check(_libcuda().cuGraphLaunch(self.exec, self.stream_handle), "cuGraphLaunch")

    def close(self) -> None:
        lib = _libcuda()
        if self.exec:
            lib.cuGraphExecDestroy(self.exec)
            self.exec = ctypes.c_void_p()
        if self.graph:
            lib.cuGraphDestroy(self.graph)
            self.graph = ctypes.c_void_p()


CU_EVENT_RECORD_EXTERNAL = 0x1


class GraphEvents:
    """count CUDA events to record inside a stream capture as event-record nodes (cuEventRecordWithFlags
    with CU_EVENT_RECORD_EXTERNAL): replaying the graph then times each segment between consecutive
    events on the GPU alone, with the kernels running back to back (no host launch in between)."""

    def __init__(self, count: int):
        lib = _libcuda()
        self.events = []
        for _ in range(count):
            ev = ctypes.c_void_p()
            _check(lib.cuEventCreate(ctypes.byref(ev), ctypes.c_uint(0)), "cuEventCreate")
            self.events.append(ev)

    def record(self, stream, i: int) -> None:
        """Record event i on stream (a pycuda Stream) as a node of the graph being captured."""
        _check(_libcuda().cuEventRecordWithFlags(self.events[i], ctypes.c_void_p(stream.handle),
                                                 ctypes.c_uint(CU_EVENT_RECORD_EXTERNAL)), "cuEventRecordWithFlags")

    def elapsed_ms(self) -> list[float]:
        """Milliseconds between event i and i + 1, for every i, after the last one has completed."""
        lib = _libcuda()
        _check(lib.cuEventSynchronize(self.events[-1]), "cuEventSynchronize")
        elapsed = getattr(lib, "cuEventElapsedTime_v2", None) or lib.cuEventElapsedTime
        out = []
        for a, b in zip(self.events, self.events[1:]):
            ms = ctypes.c_float()
            _check(elapsed(ctypes.byref(ms), a, b), "cuEventElapsedTime")
            out.append(ms.value)
        return out

    def close(self) -> None:
        lib = _libcuda()
        destroy = getattr(lib, "cuEventDestroy_v2", None) or lib.cuEventDestroy
        for ev in self.events:
            destroy(ev)
        self.events = []
