"""A simulated GPU device for CPU tests of the GPU runtime (runtime/gpu.py GpuModel)."""

from __future__ import annotations

import numpy as np


class PinnedBytes(bytearray):
    """The host allocation behind a fake pinned array (its .base), with a made-up device address."""

    def get_device_pointer(self):
        return 0x7F0000000000 + id(self) % (1 << 32) * 16


class FakeDevice:
    """Enough of runtime/device.Device for GpuModel to load an artifact and launch without a GPU: every
    kernel launch goes to `on_launch` (by default: recorded by name in `launched`); uploads do nothing,
    downloads give zeros. mapped=True: the device can map host memory, so GpuModel loads the staging kernels
    (runtime/staging.py); their launches are recorded in `ops` with their arguments, and `pinned` maps a mapped
    buffer's device address to its array."""

    arch = "sm90"

    def __init__(self, mapped: bool = False):
        from types import SimpleNamespace

        self.launched: list[str] = []
        self.on_launch = self.launched.append
        dev = self

        class Stream:  # records its event waits in ops
            def __init__(self, name="copy"):
                self.name, self.handle = name, 0

            def synchronize(self):
                pass

            def wait_for_event(self, event):
                dev.ops.append(("wait", self.name, id(event)))

        self.stream = Stream("main")

        class Func:
            def __init__(self, name):
                self.name = name

            shared_size_bytes = 0

            def prepare(self, _):
                pass

            def set_attribute(self, *_):
                pass

            def prepared_async_call(self, grid, block, stream, *args, **__):
                if self.name.startswith("atlas_stage"):
                    dev.ops.append((self.name, grid, *(int(a) for a in args)))
                dev.on_launch(self.name)

        self.ops: list[tuple] = []  # stream operations of the pipelined calls (GpuModel.submit), in order

        class Event:
            def record(self, stream):
                dev.ops.append(("event", id(self), stream.name))

            def synchronize(self):
                dev.ops.append(("sync", id(self)))

        self.pinned: dict[int, np.ndarray] = {}

        def pagelocked_zeros(n, dt, mem_flags=0):
            a = np.ndarray((int(n),), dt, buffer=PinnedBytes(int(n) * np.dtype(dt).itemsize))  # base: the bytes
            self.pinned[a.base.get_device_pointer()] = a
            return a

        self.device = SimpleNamespace(get_attribute=lambda attr: mapped)
        self.cuda = SimpleNamespace(
            device_attribute=SimpleNamespace(CAN_MAP_HOST_MEMORY=0, UNIFIED_ADDRESSING=1),
            host_alloc_flags=SimpleNamespace(DEVICEMAP=2), module_from_buffer=lambda _: self.module,
            LogicError=KeyError, Error=RuntimeError,
            function_attribute=SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=0),
            memset_d8_async=lambda *a: None,
            memcpy_htod_async=lambda dst, src, stream=None: self.ops.append(("htod", dst, src)),
            memcpy_dtod_async=lambda dst, src, n, stream=None: self.ops.append(("dtod", dst, src, n)),
            memcpy_dtoh_async=lambda dst, src, stream=None: self.ops.append(("dtoh", dst, src, stream.name)),
            pagelocked_zeros=pagelocked_zeros, Event=Event, Stream=Stream)
        self.module = SimpleNamespace(get_function=Func)

    def load_module(self, cubin):
        return self.module

    def alloc_arena(self, nbytes):
        dev = self

        class Arena(int):  # device pointer 0, freed once
            def free(self):
                dev.freed += 1

        self.freed = 0
        return Arena(0)

    def upload(self, arena, offset, data, stream=None):
        pass

    def download(self, arena, offset, nbytes, stream=None):
        return np.zeros(nbytes, np.uint8)

    def encode_tensor_map(self, base, spec):  # the driver's encoding is not modelled: the bytes are never read
        self.ops.append(("tensor_map", spec.slot))
        return bytes(128)

    def synchronize(self):
        pass
