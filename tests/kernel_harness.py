"""Run an IR graph's generated kernels on the GPU and compare with the reference interpreter.

Used by the `gpu`-marked kernel tests. The memory plan here is the simplest one (every value its own
buffer), so kernel bugs show up independently of the planner. Outputs are poisoned (0xFF bytes,
NaN in floats) before the run so that unwritten elements fail the comparison. A `plan_fn` may give
values strided placements (views): inputs are then scattered and outputs gathered through the strides.
"""

from __future__ import annotations

import functools

import numpy as np

from atlasc.codegen import generate_module
from atlasc.codegen.nvcc import compile_cubins
from atlasc.ir import interpret, symbolic as S
from atlasc.ir.dtypes import to_numpy
from atlasc.ir.interpreter import bind_symbols
from atlasc.ir.memory import MemoryPlan, Placement, align


def trivial_plan(graph, upper: dict[str, int], kv_cache: np.ndarray | None = None) -> tuple[MemoryPlan, int]:
    """Every value (constants included) in its own aligned buffer sized at the symbols' maxima."""
    plan = MemoryPlan(symbols=tuple(graph.symbols))
    off = 0
    plan.dims_offset = 0
    off = align(8 * max(1, len(plan.symbols)))
    kv_offset = None
    if kv_cache is not None:
        kv_offset = off
        off = align(off + kv_cache.nbytes)
    for v in graph.all_values():
        if v.name in plan.placements:
            continue
        n = int(np.prod([S.evaluate(d, upper) for d in v.shape], dtype=np.int64)) * to_numpy(v.dtype).itemsize
        plan.placements[v.name] = Placement("activations", off, n)
        off = align(off + max(n, 1))
    plan.arena_bytes = off
    return plan, kv_offset


def _strides(placement: Placement, env) -> list[int]:
    return [S.evaluate(s, env) for s in placement.strides]


def _span(shape, strides) -> int:
    """Elements from a strided view's first element to its last, inclusive (0 if empty)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides))


def _upload(dev, arena, placement: Placement, data: np.ndarray, env) -> None:
    """Upload data at placement, scattering through its element strides when it has them."""
    if placement.strides is None:
        dev.upload(arena, placement.offset, data)
        return
    strides = _strides(placement, env)
    buf = np.zeros(_span(data.shape, strides), data.dtype)
    np.lib.stride_tricks.as_strided(buf, data.shape, [s * data.itemsize for s in strides])[...] = data
    dev.upload(arena, placement.offset, buf)


@functools.cache
def device():
    from atlasc.runtime.device import Device

    return Device()


def run_on_gpu(graph, inputs: dict[str, np.ndarray], upper: dict[str, int] | None = None,
               state: dict | None = None, symbols: dict | None = None, arch: str | None = None,
               plan_fn=None, repeat: int = 1, archs: tuple[str, ...] = (),
               lower: dict[str, int] | None = None, decode_steps: dict[str, str] | None = None,
               grid_cap: int = 0) -> dict[str, np.ndarray]:
    """Generate, compile and run `graph` on the GPU (its launches `repeat` times over, in one arena:
    kernels must leave their scratch ready for the next launch); return its outputs by name. `archs`, `lower` and
    `decode_steps` go to generate_module (the compile's targets; symbol values the kernels run only above; {"run":
    batch symbol} to treat the graph as a decode step, e.g. for quant_chain.py's chains). The kernels whose blocks
    must all be resident (a chain's) launch on at most grid_cap blocks (as on a GPU of that many SMs), by default
    the device's SM count (runtime/gpu.py co_resident_caps)."""
    from atlasc.runtime.device import KernelTable

    dev = device()
    env = bind_symbols(graph, inputs, symbols)
    upper = upper or env
    kv = None if state is None else state["kv_cache"]
    plan, kv_offset = (plan_fn or trivial_plan)(graph, upper, kv)
    kv_spec = None
    if kv is not None:
        kv_spec = {"offset": kv_offset, "layers": kv.shape[0], "max_batch": kv.shape[2], "kv_heads": kv.shape[3],
                   "max_seq": kv.shape[4], "head_dim": kv.shape[5], "dtype": str(kv.dtype)}
    mod = generate_module({"run": (graph, plan)}, {"run": upper}, kv_spec, archs=archs,
                          lower={"run": lower} if lower else None, decode_steps=decode_steps)
    cubin = compile_cubins(mod.source, (arch or dev.arch,))[arch or dev.arch]
    module = dev.load_module(cubin)
    launches = [launch for launch in mod.launches["run"] if launch.kernel]  # "": a chain's later node
    table = KernelTable(dev, module, [launch.kernel for launch in launches])
    table.grid_cap = {launch.kernel: grid_cap or dev.sms for launch in launches if launch.co_resident}
    arena = dev.alloc_arena(mod.arena_bytes)
    dev.upload(arena, 0, np.full(mod.arena_bytes, 0xFF, np.uint8))  # poison everything but the scratch
    if mod.scratch_bytes:  # kernels' counters start at 0 (GeneratedModule)
        dev.upload(arena, mod.scratch_offset, np.zeros(mod.scratch_bytes, np.uint8))
    dev.upload(arena, plan.dims_offset, np.array([env[s] for s in plan.symbols], np.int64))
    if kv is not None:
        dev.upload(arena, kv_offset, kv)
    for c in graph.constants():
        _upload(dev, arena, plan.placement(c), c.data, env)
    for v in graph.inputs:
        _upload(dev, arena, plan.placement(v), np.asarray(inputs[v.name]), env)
    if mod.tensor_maps:  # the copy engine's maps of this arena (codegen/linear_tma.py)
        from atlasc.runtime.tensor_maps import write_tensor_maps

        write_tensor_maps(dev, arena, mod.tensor_maps)
    for _ in range(repeat):
        for launch in launches:
            table.launch(launch.kernel, launch.grid, launch.block, launch.smem, arena, node=launch.node,
                         args=launch.args)
    dev.synchronize()
    out = {}
    for v in graph.outputs:
        shape = tuple(S.evaluate(d, env) for d in v.shape)
        dt = to_numpy(v.dtype)
        placement = plan.placement(v)
        if placement.strides is not None:  # a view (e.g. of the KV cache): gather through its strides
            strides = _strides(placement, env)
            raw = dev.download(arena, placement.offset, _span(shape, strides) * dt.itemsize).view(dt)
            out[v.name] = np.lib.stride_tricks.as_strided(raw, shape, [s * dt.itemsize for s in strides]).copy()
            continue
        n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        out[v.name] = dev.download(arena, placement.offset, n).view(dt).reshape(shape)
    if kv is not None:
        state["kv_cache"][...] = dev.download(arena, kv_offset, kv.nbytes).view(kv.dtype).reshape(kv.shape)
    arena.free()
    return out


def check_against_reference(graph, inputs, rtol=1e-5, atol=1e-6, **kw):
    """Run graph on the GPU and with `interpret`; assert every output matches."""
    want = interpret(graph, inputs, state=kw.get("state_ref"), symbols=kw.get("symbols"))
    kw.pop("state_ref", None)
    got = run_on_gpu(graph, inputs, **kw)
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape and g.dtype == w.dtype, name
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol, err_msg=name)
    return got
