"""The GPU side of the runtime, kept small: a CUDA context, one arena, modules loaded from bytes,
launches of argument-less kernels (each takes only the arena base pointer).

pycuda is imported lazily so that importing atlasc.runtime never needs it; a missing pycuda is a
one-line RuntimeUnavailableError suggesting the `gpu` extra (`pip install -e '.[gpu]'` in the checkout).
"""

from __future__ import annotations

import atexit

import numpy as np

from atlasc.errors import AtlasError


class RuntimeUnavailableError(AtlasError):
    """pycuda or a CUDA device is missing."""


class DeviceOutOfMemoryError(AtlasError):
    """The arena does not fit in the GPU's free memory."""


class KernelLaunchError(AtlasError):
    """A CUDA driver call failed; the message names the kernel and its node."""


def _pycuda():
    try:
        import pycuda.driver as cuda
    except ImportError:
        raise RuntimeUnavailableError("pycuda is not installed: the GPU runtime needs it",
                                      hint="in the atlasc checkout: pip install -e '.[gpu]' (pycuda builds against the "
                                           "CUDA toolkit: set CUDA_ROOT if it cannot find cuda.h)") from None
    return cuda


class Device:
    """One CUDA device with a context made current on the calling thread."""

    def __init__(self, ordinal: int = 0):
        cuda = _pycuda()
        self.cuda = cuda
        try:
            cuda.init()
            if cuda.Device.count() == 0:
                raise RuntimeUnavailableError("no CUDA device found")
            self.device = cuda.Device(ordinal)
            self.context = self.device.make_context()
        except cuda.Error as e:
            raise RuntimeUnavailableError(f"CUDA is not usable: {e}") from None
        major, minor = self.device.compute_capability()
        self.arch = f"sm{major}{minor}"
        self.name = self.device.name()
        self.sms = int(self.device.get_attribute(cuda.device_attribute.MULTIPROCESSOR_COUNT))
        self.stream = cuda.Stream()
        atexit.register(self.close)  # pycuda aborts at exit if a context is still on the stack

    def close(self) -> None:
        if getattr(self, "context", None) is not None:
            self.context.pop()
            self.context.detach()
            self.context = None

    def free_memory(self) -> tuple[int, int]:
        """(free, total) bytes."""
        return self.cuda.mem_get_info()

    def alloc_arena(self, nbytes: int):
        """The one device allocation of a run: raises DeviceOutOfMemoryError with the numbers."""
        free, total = self.free_memory()
        if nbytes > free:
            raise DeviceOutOfMemoryError(f"the model needs {nbytes / 2**30:.2f} GiB of device memory, "
                                         f"the GPU has {free / 2**30:.2f} GiB free of {total / 2**30:.2f} GiB",
                                         hint="compile with a smaller --max-batch / --max-seq, or quantize")
        try:
            return self.cuda.mem_alloc(max(nbytes, 1))
        except self.cuda.MemoryError:
            raise DeviceOutOfMemoryError(f"cudaMalloc of {nbytes} bytes failed") from None

    def load_module(self, cubin: bytes):
        return self.cuda.module_from_buffer(cubin)

    def upload(self, arena, offset: int, data, stream=None) -> None:
        buf = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
        if buf.size:
            self.cuda.memcpy_htod_async(int(arena) + offset, buf, stream or self.stream)

    def download(self, arena, offset: int, nbytes: int, stream=None) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        if nbytes:
            self.cuda.memcpy_dtoh_async(out, int(arena) + offset, stream or self.stream)
        (stream or self.stream).synchronize()
        return out

    def synchronize(self) -> None:
        self.stream.synchronize()

    def encode_tensor_map(self, base: int, spec) -> bytes:
        """The 128 bytes of a copy-engine tensor map (TensorMapSpec) for an arena at `base` (runtime/tensor_maps.py)."""
        from atlasc.runtime.tensor_maps import encode

        return encode(base, spec)


class KernelTable:
    """The kernels of a module, or of the modules of a chunked build (each name is looked up in each,
    in order), each prepared for its arguments (the arena pointer, and the arena offsets of a kernel shared
    by several nodes: codegen/share.py) at its first launch."""

    def __init__(self, device: Device, module, names: list[str]):
        self.device = device
        modules = module if isinstance(module, (list, tuple)) else [module]
        self.funcs = {}
        for name in names:
            f = None
            for mod in modules:
                try:
                    f = mod.get_function(name)
                    break
                except device.cuda.LogicError:
                    continue
            if f is None:
                raise KernelLaunchError(f"kernel {name} is missing from the cubin") from None
            self.funcs[name] = f
        # static shared memory of each kernel: the 48 KB a launch gets without opting in counts it too
        self.static_smem = {name: int(getattr(f, "shared_size_bytes", 0) or 0) for name, f in self.funcs.items()}
        self.dynamic_opt_in: dict[str, int] = {}  # name -> dynamic bytes already allowed
        self.formats: dict[str, str] = {}  # name -> the argument format it is prepared for
        # name -> the most blocks its launch may have: a kernel whose blocks must all be resident at once (a chain's
        # grid barrier, codegen/quant_chain.py) gets at most one block per SM of this GPU (set by the model)
        self.grid_cap: dict[str, int] = {}

    def launch(self, name: str, grid, block, smem: int, arena, stream=None, node: str = "",
               args: tuple[int, ...] = ()) -> None:
        """Launch `name` on the stream with the arena pointer and `args` (int64 arena offsets) as arguments."""
        cap = self.grid_cap.get(name)
        if cap is not None and grid[0] > cap:
            grid = (cap, *tuple(grid)[1:])
        try:
            fmt = "P" + "q" * len(args)
            if self.formats.get(name) != fmt:
                self.funcs[name].prepare(fmt)
                self.formats[name] = fmt
            if smem + self.static_smem[name] > 48 * 1024 and self.dynamic_opt_in.get(name, 0) < smem:
                self.funcs[name].set_attribute(
                    self.device.cuda.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                self.dynamic_opt_in[name] = smem
            self.funcs[name].prepared_async_call(tuple(grid), tuple(block), stream or self.device.stream,
                                                 np.uintp(int(arena)), *args, shared_size=smem)
        except self.device.cuda.Error as e:
            raise KernelLaunchError(f"launch of {name} (node {node}) failed: {e}") from None
