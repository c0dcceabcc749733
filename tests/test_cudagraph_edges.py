"""runtime/cudagraph.py without a GPU: make_programmatic against a fake libcuda that keeps a graph's
edges in Python, so the edge selection and the driver calls' arguments are checked on the CPU (the GPU
test test_gpu_runtime.py::test_programmatic_dependent_launch_keeps_the_tokens runs the real driver)."""

from __future__ import annotations

import ctypes

import pytest

from atlasc.runtime import cudagraph
from atlasc.runtime.cudagraph import (
    CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC,
    CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC,
    CU_GRAPH_NODE_TYPE_KERNEL,
    CudaGraphError,
    make_programmatic,
)

MEMCPY = 2  # any node type other than CU_GRAPH_NODE_TYPE_KERNEL


class FakeDriver:
    """The four driver calls make_programmatic uses, over edges (from, to, (from_port, to_port, type))."""

    def __init__(self, kinds: dict[int, int], edges: list[tuple[int, int, tuple[int, int, int]]]):
        self.kinds, self.edges = kinds, list(edges)

    def cuGraphGetEdges_v2(self, graph, frm, to, data, count):
        n = ctypes.cast(count, ctypes.POINTER(ctypes.c_size_t))
        if frm is None:
            n[0] = len(self.edges)
            return 0
        for i, (a, b, (fp, tp, ty)) in enumerate(self.edges[: n[0]]):
            frm[i], to[i] = a, b
            data[i].from_port, data[i].to_port, data[i].type = fp, tp, ty
        return 0

    def cuGraphNodeGetType(self, node, kind):
        ctypes.cast(kind, ctypes.POINTER(ctypes.c_int))[0] = self.kinds[node.value]
        return 0

    def cuGraphRemoveDependencies_v2(self, graph, frm, to, data, n):
        for i in range(n.value):
            key = (frm[i], to[i], (data[i].from_port, data[i].to_port, data[i].type))
            if key not in self.edges:
                return 1  # CUDA_ERROR_INVALID_VALUE: no such edge
            self.edges.remove(key)
        return 0

    def cuGraphAddDependencies_v2(self, graph, frm, to, data, n):
        for i in range(n.value):
            self.edges.append((frm[i], to[i], (data[i].from_port, data[i].to_port, data[i].type)))
        return 0

    def cuGetErrorString(self, result, msg):
        return 0


def _with(monkeypatch, driver) -> None:
    monkeypatch.setattr(cudagraph, "_libcuda", lambda: driver)


PROGRAMMATIC = (CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)


def test_kernel_chain_edges_become_programmatic(monkeypatch):
    k = CU_GRAPH_NODE_TYPE_KERNEL
    kinds = {0x10: MEMCPY, 0x20: k, 0x30: k, 0x40: k, 0x50: k}
    already = (CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC, 0, CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC)
    edges = [(0x10, 0x20, (0, 0, 0)),  # memcpy -> kernel: stays a full dependency
             (0x20, 0x30, (0, 0, 0)), (0x30, 0x40, (0, 0, 0)),  # kernel -> kernel: programmatic
             (0x40, 0x50, already)]  # already annotated: left alone
    driver = FakeDriver(kinds, edges)
    _with(monkeypatch, driver)
    assert make_programmatic(ctypes.c_void_p(1)) == 2
    assert sorted(driver.edges) == sorted([(0x10, 0x20, (0, 0, 0)), (0x20, 0x30, PROGRAMMATIC),
                                           (0x30, 0x40, PROGRAMMATIC), (0x40, 0x50, already)])


def test_plain_ends_keep_the_staging_kernels_edges_plain(monkeypatch):
    """A staged step's graph (runtime/staging.py): stage_in -> k1 -> k2 -> k3 -> stage_out. With plain_ends only the
    inner kernel edges become programmatic: the staging kernels do not wait in pdl_enter."""
    k = CU_GRAPH_NODE_TYPE_KERNEL
    chain = [0x1, 0x2, 0x3, 0x4, 0x5]
    driver = FakeDriver({n: k for n in chain}, [(a, b, (0, 0, 0)) for a, b in zip(chain, chain[1:])])
    _with(monkeypatch, driver)
    assert make_programmatic(ctypes.c_void_p(1), plain_ends=True) == 2
    assert sorted(driver.edges) == sorted([(0x1, 0x2, (0, 0, 0)), (0x2, 0x3, PROGRAMMATIC), (0x3, 0x4, PROGRAMMATIC),
                                           (0x4, 0x5, (0, 0, 0))])


def test_no_edges_and_no_kernel_edges(monkeypatch):
    _with(monkeypatch, FakeDriver({}, []))
    assert make_programmatic(ctypes.c_void_p(1)) == 0
    driver = FakeDriver({1: MEMCPY, 2: CU_GRAPH_NODE_TYPE_KERNEL}, [(1, 2, (0, 0, 0))])
    _with(monkeypatch, driver)
    assert make_programmatic(ctypes.c_void_p(1)) == 0 and driver.edges == [(1, 2, (0, 0, 0))]


def test_a_driver_without_edge_data_is_a_graph_error(monkeypatch):
    """Drivers before CUDA 12.3 lack the _v2 edge calls: a CudaGraphError (the runtime then captures plain
    graphs), not an AttributeError."""

    class Old:
        pass

    _with(monkeypatch, Old())
    with pytest.raises(CudaGraphError, match="cuGraphGetEdges_v2"):
        make_programmatic(ctypes.c_void_p(1))


def test_edge_data_is_the_drivers_8_byte_struct():
    assert ctypes.sizeof(cudagraph.EdgeData) == 8
    assert [f[0] for f in cudagraph.EdgeData._fields_] == ["from_port", "to_port", "type", "reserved"]
