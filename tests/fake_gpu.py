"""A simulated GPU device for CPU tests of the GPU runtime (runtime/gpu.py GpuModel)."""

from __future__ import annotations

import numpy as np


class FakeDevice:
    """Enough of runtime/device.Device for GpuModel to load an artifact and launch without a GPU: every
    kernel launch goes to `on_launch` (by default: recorded by name in `launched`); uploads do nothing,
    downloads give zeros."""

    arch = "sm90"

    def __init__(self):
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

            def prepared_async_call(self, *_, **__):
                dev.on_launch(self.name)

        self.ops: list[tuple] = []  # stream operations of the pipelined calls (GpuModel.submit), in order

        class Event:
            def record(self, stream):
                dev.ops.append(("event", id(self), stream.name))

            def synchronize(self):
                dev.ops.append(("sync", id(self)))

        self.cuda = SimpleNamespace(
            LogicError=KeyError, Error=RuntimeError,
            function_attribute=SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=0),
            memset_d8_async=lambda *a: None,
            memcpy_htod_async=lambda dst, src, stream=None: self.ops.append(("htod", dst, src)),
            memcpy_dtod_async=lambda dst, src, n, stream=None: self.ops.append(("dtod", dst, src, n)),
            memcpy_dtoh_async=lambda dst, src, stream=None: self.ops.append(("dtoh", dst, src, stream.name)),
            pagelocked_zeros=lambda n, dt: np.zeros(n, dt), Event=Event, Stream=Stream)
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

    def synchronize(self):
        pass
