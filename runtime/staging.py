"""Mapped staging: a pipelined decode step's inputs and tokens cross PCIe in two small kernels of its CUDA graph.

A copy-engine copy on the stream costs ~7-13 us between two steps, whatever its size (docs/perf.md v22, v24).
With ATLAS_MAPPED_STAGING=1 (default) GpuModel.submit instead writes a step's inputs (dims first) into mapped
pinned host memory, and the step's graph begins with `atlas_stage_in`, which reads them over PCIe into the
arena, and ends with `atlas_stage_out`, which writes next_tokens into the stage's mapped tokens buffer. The
kernels are PTX (below), JIT-compiled by the driver at load, so every artifact gets them without nvcc.

The pinned input buffer of a stage: a 16-byte header (u64 word count n16, u64 arena offset) and then the bytes
of the span, arena layout. Thread i of atlas_stage_in moves 16-byte word i; block 0 reads its words together
with the header (one PCIe round trip for a step's first 4 KB: a batch-1 step), the other blocks after it.
"""

from __future__ import annotations

import os

import numpy as np

from atlasc.errors import UsageError

MAPPED_ENV = "ATLAS_MAPPED_STAGING"
HEADER = 16  # bytes before the span in a stage's pinned input buffer
BLOCK = 256  # threads of atlas_stage_in (each moves one 16-byte word)
MAX_BYTES = 64 * 1024  # a span up to this goes through atlas_stage_in (more: the copy engine, GpuModel.submit)

PTX = r"""
.version 7.0
.target sm_75
.address_size 64

// atlas_stage_in(arena, host): host[0] = n16, host[1] = arena offset (u64 each); word i of the n16 16-byte words
// at host + 16 goes to arena + offset + 16 i. Block 0 loads its word before the header arrives (always inside the
// pinned buffer: GpuModel sizes it for one block's words at least). Weak loads: the host's writes before the launch
// are visible to it (.relaxed.sys loads measured ~120 us for 4 KB: one PCIe read at a time, docs/perf.md v24).
.visible .entry atlas_stage_in(.param .u64 arena, .param .u64 host)
{
  .reg .pred %p<3>;
  .reg .b32 %r<10>;
  .reg .b64 %rd<12>;
  ld.param.u64 %rd1, [arena];
  ld.param.u64 %rd2, [host];
  mov.u32 %r1, %ctaid.x;
  mov.u32 %r2, %ntid.x;
  mov.u32 %r3, %tid.x;
  mad.lo.u32 %r4, %r1, %r2, %r3;
  mul.wide.u32 %rd3, %r4, 16;
  add.s64 %rd4, %rd2, %rd3;
  setp.ne.u32 %p1, %r1, 0;
  ld.v2.u64 {%rd5, %rd6}, [%rd2];
  @!%p1 ld.v4.u32 {%r5, %r6, %r7, %r8}, [%rd4+16];
  cvt.u64.u32 %rd7, %r4;
  setp.ge.u64 %p2, %rd7, %rd5;
  @%p2 bra DONE;
  @%p1 ld.v4.u32 {%r5, %r6, %r7, %r8}, [%rd4+16];
  add.s64 %rd8, %rd1, %rd6;
  add.s64 %rd9, %rd8, %rd3;
  st.v4.u32 [%rd9], {%r5, %r6, %r7, %r8};
DONE:
  ret;
}

// atlas_stage_out(dst, src, n16): n16 16-byte words from src (the arena) to dst (mapped host memory)
.visible .entry atlas_stage_out(.param .u64 dst, .param .u64 src, .param .u32 n16)
{
  .reg .pred %p<2>;
  .reg .b32 %r<10>;
  .reg .b64 %rd<8>;
  ld.param.u64 %rd1, [dst];
  ld.param.u64 %rd2, [src];
  ld.param.u32 %r1, [n16];
  mov.u32 %r2, %ctaid.x;
  mov.u32 %r3, %ntid.x;
  mov.u32 %r4, %tid.x;
  mad.lo.u32 %r5, %r2, %r3, %r4;
  setp.ge.u32 %p1, %r5, %r1;
  @%p1 bra DONE;
  mul.wide.u32 %rd3, %r5, 16;
  add.s64 %rd4, %rd2, %rd3;
  add.s64 %rd5, %rd1, %rd3;
  ld.v4.u32 {%r6, %r7, %r8, %r9}, [%rd4];
  st.v4.u32 [%rd5], {%r6, %r7, %r8, %r9};
DONE:
  ret;
}
"""


def mapped_setting() -> bool:
    """ATLAS_MAPPED_STAGING (default 1): pipelined decode steps stage through mapped memory; UsageError for a
    value not 0 or 1."""
    value = os.environ.get(MAPPED_ENV, "") or "1"
    if value not in ("0", "1"):
        raise UsageError(f"{MAPPED_ENV}={value!r} is not 0 or 1")
    return value == "1"


def blocks_for(nbytes: int) -> int:
    """Blocks of atlas_stage_in that cover a span of nbytes (at least one)."""
    return max(1, -(-nbytes // (16 * BLOCK)))


def mapped_span(spans: list[list[int]], base: int, capacity: int) -> int | None:
    """The bytes atlas_stage_in must move for a call whose staged upload is `spans` (GpuModel._stage_inputs:
    arena [start, end) ranges), rounded up to 16; None when the call cannot take the mapped path: not exactly one
    span, a span not starting at the stage's first slot (`base`, where the pinned data begins), or one longer than
    `capacity` bytes (the words the graph's atlas_stage_in covers)."""
    if len(spans) != 1 or spans[0][0] != base:
        return None
    n = -(-(spans[0][1] - spans[0][0]) // 16) * 16
    return n if n <= capacity else None


def write_header(raw: np.ndarray, nbytes: int, offset: int) -> None:
    """The header of a stage's pinned input buffer (raw: its uint8 view, header first)."""
    raw[:HEADER].view(np.uint64)[:] = (nbytes // 16, offset)


class Staging:
    """The two staging kernels, JIT-compiled from PTX by the driver (pycuda module_from_buffer)."""

    def __init__(self, cuda):
        self.cuda = cuda
        module = cuda.module_from_buffer(PTX.encode())
        self.stage_in = module.get_function("atlas_stage_in")
        self.stage_in.prepare("PP")
        self.stage_out = module.get_function("atlas_stage_out")
        self.stage_out.prepare("PPI")
        self.module = module

    def copy_in(self, arena, host_pointer: int, blocks: int, stream) -> None:
        """Launch atlas_stage_in over `blocks` blocks (it reads the span's size from the header at run time)."""
        self.stage_in.prepared_async_call((blocks, 1, 1), (BLOCK, 1, 1), stream, np.uintp(int(arena)),
                                          np.uintp(host_pointer))

    def copy_out(self, host_pointer: int, src: int, nbytes: int, stream) -> None:
        """Launch atlas_stage_out: nbytes (a multiple of 16) from device address src to mapped host memory."""
        n16 = nbytes // 16
        self.stage_out.prepared_async_call((max(1, -(-n16 // 128)), 1, 1), (128, 1, 1), stream,
                                           np.uintp(host_pointer), np.uintp(src), np.uint32(n16))


def load_staging(cuda, device) -> tuple[Staging | None, str]:
    """(the staging kernels, "") or (None, why not): the device (a pycuda Device) cannot map host memory, or the
    driver refused the PTX (a driver older than PTX ISA 7.0 / CUDA 11.0)."""
    try:
        if not device.get_attribute(cuda.device_attribute.CAN_MAP_HOST_MEMORY) or \
                not device.get_attribute(cuda.device_attribute.UNIFIED_ADDRESSING):
            return None, "the device cannot map host memory"
        return Staging(cuda), ""
    except cuda.Error as e:
        return None, f"the driver did not load the staging kernels: {e}"
