"""codegen/cubin.py reads what ptxas decided per kernel out of a cubin (registers, static shared memory),
and check_shared_memory adds the static bytes to each launch's dynamic ones once the cubins exist."""

from __future__ import annotations

import shutil

import pytest

from atlasc.codegen.cubin import kernel_registers, static_shared_bytes
from atlasc.codegen.generate import CodegenError, GeneratedModule, Launch, check_shared_memory
from atlasc.ir.archs import MAX_SMEM_PER_BLOCK

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

SOURCE = r"""
extern "C" __global__ void arrays(float* p) {
  __shared__ float a[1000];
  a[threadIdx.x] = p[threadIdx.x];
  __syncthreads();
  p[threadIdx.x] = a[999 - threadIdx.x];
}
extern "C" __global__ void dynamic_only(float* p) {
  extern __shared__ float d[];
  d[threadIdx.x] = p[threadIdx.x];
  __syncthreads();
  p[threadIdx.x] = d[5];
}
extern "C" __global__ void none(float* p) { p[0] = 1.f; }
"""


@pytest.fixture(scope="module")
def cubins():
    from atlasc.codegen.nvcc import compile_cubins

    return compile_cubins(SOURCE, ("sm80", "sm86", "sm90"))


@pytest.mark.parametrize("arch", ["sm80", "sm86", "sm90"])
def test_static_shared_bytes_are_the_kernels_arrays(cubins, arch):
    """The 4000 bytes of the array; dynamic memory and sm90's reserved KB are not counted."""
    assert static_shared_bytes(cubins[arch]) == {"arrays": 4000, "dynamic_only": 0, "none": 0}
    regs = kernel_registers(cubins[arch])
    assert set(regs) == {"arrays", "dynamic_only", "none"} and all(0 < r <= 255 for r in regs.values())


def test_not_a_cubin_is_a_value_error():
    with pytest.raises(ValueError, match="ELF"):
        static_shared_bytes(b"not an ELF file at all, not even close to one...........................")


def test_shared_memory_check_counts_static_arrays_once_compiled(cubins):
    """Dynamic bytes that fit sm86 alone, but not with the kernel's 4000 static bytes: the check before
    nvcc passes, the one with the cubins names both parts and the arch; sm90's limit holds both."""
    dynamic = MAX_SMEM_PER_BLOCK["sm86"] - 2000
    mod = GeneratedModule("", {"decode": [Launch("n0", "Linear", "arrays", (1, 1, 1), (256, 1, 1), dynamic),
                                          Launch("n1", "Linear", "none", (1, 1, 1), (256, 1, 1), 0)]})
    parts = {arch: [cubin] for arch, cubin in cubins.items()}  # compile_module's form: arch -> its cubins
    check_shared_memory(mod, ("sm86", "sm90"))
    check_shared_memory(mod, ("sm90",), parts)
    with pytest.raises(CodegenError, match=rf"^decode node n0 \(Linear, kernel arrays\) needs {dynamic + 4000} "
                                           rf"bytes of shared memory per block \({dynamic} dynamic \+ 4000 static\); "
                                           rf"sm86 allows {MAX_SMEM_PER_BLOCK['sm86']}$"):
        check_shared_memory(mod, ("sm90", "sm86"), parts)
