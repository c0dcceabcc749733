"""runtime/device.KernelTable on a fake module (no GPU): the shared-memory opt-in (a launch whose dynamic
plus static shared memory passes 48 KB must raise the kernel's dynamic limit first: the driver refuses
the launch otherwise, as quant_lab's norm-a8 down projection, 43008 dynamic + 8544 static bytes, showed),
the arguments of a kernel shared by several nodes, and the lookup across a chunked build's modules."""

from __future__ import annotations

from types import SimpleNamespace

from atlasc.runtime.device import KernelTable


class _Func:
    def __init__(self, static: int):
        self.shared_size_bytes = static
        self.attributes: list[int] = []
        self.calls = 0

        self.formats: list[str] = []
        self.args: list[tuple] = []

    def prepare(self, fmt):
        self.formats.append(fmt)

    def set_attribute(self, _attr, value):
        self.attributes.append(value)

    def prepared_async_call(self, _grid, _block, _stream, *args, **__):
        self.calls += 1
        self.args.append(args)


def _table(static: int):
    func = _Func(static)
    cuda = SimpleNamespace(LogicError=KeyError, Error=RuntimeError,
                           function_attribute=SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=8))
    device = SimpleNamespace(cuda=cuda, stream=object())
    return KernelTable(device, SimpleNamespace(get_function=lambda name: func), ["k"]), func


def test_static_shared_memory_counts_toward_the_opt_in():
    table, func = _table(static=8544)
    table.launch("k", (1, 1, 1), (256, 1, 1), 43008, 0)
    table.launch("k", (1, 1, 1), (256, 1, 1), 43008, 0)
    assert func.attributes == [43008]  # raised once, before the first launch
    assert func.calls == 2


def test_no_opt_in_under_48_kb_and_a_larger_launch_raises_it_again():
    table, func = _table(static=1024)
    table.launch("k", (1, 1, 1), (256, 1, 1), 40000, 0)
    assert func.attributes == []
    table.launch("k", (1, 1, 1), (256, 1, 1), 60000, 0)
    table.launch("k", (1, 1, 1), (256, 1, 1), 50000, 0)
    table.launch("k", (1, 1, 1), (256, 1, 1), 90000, 0)
    assert func.attributes == [60000, 90000]


def test_kernels_are_found_across_the_modules_of_a_chunked_build():
    """A chunked build loads one module per cubin part: each kernel is looked up in each module in turn;
    a kernel in none of them is a one-line KernelLaunchError naming it."""
    import pytest

    from atlasc.runtime.device import KernelLaunchError

    funcs = {"a": _Func(0), "b": _Func(0)}

    def module(*names):
        def get(name):
            if name not in names:
                raise KeyError(name)
            return funcs[name]
        return SimpleNamespace(get_function=get)

    cuda = SimpleNamespace(LogicError=KeyError, Error=RuntimeError,
                           function_attribute=SimpleNamespace(MAX_DYNAMIC_SHARED_SIZE_BYTES=8))
    device = SimpleNamespace(cuda=cuda, stream=object())
    table = KernelTable(device, [module("a"), module("b")], ["a", "b"])
    table.launch("b", (1, 1, 1), (32, 1, 1), 0, 0)
    assert table.funcs == funcs and funcs["b"].calls == 1
    with pytest.raises(KernelLaunchError, match="kernel c is missing"):
        KernelTable(device, [module("a"), module("b")], ["a", "c"])


def test_a_shared_kernel_gets_the_arena_and_its_offsets_packed_as_int64():
    """A kernel shared by several nodes (codegen/share.py) takes (arena, ArenaOffsets<N>): prepared once as
    "P" + N x "q" (pycuda packs the arguments by that format, natively aligned: the struct follows the
    pointer at byte 8), each launch passing its own offsets; a one-node kernel is prepared as "P"."""
    import struct

    table, func = _table(static=0)
    table.launch("k", (1, 1, 1), (256, 1, 1), 0, 4096, args=(16, 1 << 33, 0))
    table.launch("k", (1, 1, 1), (256, 1, 1), 0, 4096, args=(32, 48, 64))
    assert func.formats == ["Pqqq"] and [a[1:] for a in func.args] == [(16, 1 << 33, 0), (32, 48, 64)]
    assert struct.calcsize("Pqqq") == 8 + 3 * 8
    alone, one = _table(static=0)
    alone.launch("k", (1, 1, 1), (256, 1, 1), 0, 4096)
    assert one.formats == ["P"] and [a[1:] for a in one.args] == [()]
