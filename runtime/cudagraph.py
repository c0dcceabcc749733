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


class CudaGraphError(AtlasError):
    """A CUDA graph driver call failed."""


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
        raise CudaGraphError(f"{what} failed: {msg.value.decode() if msg.value else result}")


class CapturedGraph:
    """The launches issued by `record()` on `stream`, instantiated for replay."""

    def __init__(self, stream, record):
        lib = _libcuda()
        self.stream_handle = ctypes.c_void_p(stream.handle)
        begin = getattr(lib, "cuStreamBeginCapture_v2", None) or lib.cuStreamBeginCapture
        _check(begin(self.stream_handle, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture")
        graph = ctypes.c_void_p()
        try:
            record()
        finally:
            _check(lib.cuStreamEndCapture(self.stream_handle, ctypes.byref(graph)), "cuStreamEndCapture")
        self.graph = graph
        self.exec = ctypes.c_void_p()
        _check(lib.cuGraphInstantiateWithFlags(ctypes.byref(self.exec), graph, ctypes.c_ulonglong(0)),
               "cuGraphInstantiate")

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
