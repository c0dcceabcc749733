"""The Sample kernel: next-token selection on the device (greedy, temperature, top-k, top-p)."""

from __future__ import annotations

from atlasc.codegen.cexpr import c_type
from atlasc.codegen.generate import STRIDE_GRID, CodegenError, KernelCode, KernelContext, emitter
from atlasc.errors import env_switch
from atlasc.ir.graph import Node

# logits per block of a row's maximum: two 16-byte float16 loads per thread of a 1024-thread block (one block per
# row read 16 rounds of loads for a 128256-entry row: ~12 us per step, docs/perf.md v22-v23)
PART_VALUES = 16384
MAX_PARTS = 32
SPLIT_ENV = "ATLAS_SAMPLE_SPLIT"


@emitter("Sample")
def emit_sample(ctx: KernelContext, node: Node) -> KernelCode:
    logits, fparams, iparams = node.inputs
    if ctx.plan.placement(logits).strides is not None:
        raise CodegenError(f"{node.name}: Sample needs contiguous logits")
    ctx.view(logits, "logits", rank=3)
    ctx.view(fparams, "fp", rank=1)
    ctx.view(iparams, "ip", rank=1)
    ctx.view(node.outputs[0], "out", rank=1)
    rows = max(1, ctx.upper(logits.shape[0]))
    parts = sample_parts(ctx.upper(logits.shape[2]))
    t = c_type(logits.dtype)
    lines = ["  const float temperature = fp.p[0], top_p = fp.p[1];",
             "  const long long seed = ip.p[0], step = ip.p[1], top_k = ip.p[2];"]
    if parts == 1:
        lines.append(f"  atlas::smp::sample_rows<{t}>(logits, temperature, top_p, seed, step, top_k, out);")
        return KernelCode("\n".join(lines), (min(rows, STRIDE_GRID), 1, 1), (1024, 1, 1))
    # the rows' partial maxima: [rows x parts] floats, then as many int64 indices (8-byte aligned after them)
    values = -(-rows * parts * 4 // 8) * 8
    lines += [f"  float* smp_wv = reinterpret_cast<float*>({ctx.scratch_address(0)});",
              f"  long long* smp_wi = reinterpret_cast<long long*>({ctx.scratch_address(values)});",
              f"  unsigned int* smp_cnt = reinterpret_cast<unsigned int*>({ctx.counters_address()});",
              f"  atlas::smp::sample_rows_split<{t}>(logits, temperature, top_p, seed, step, top_k, out, {parts}, "
              "smp_wv, smp_wi, smp_cnt);"]
    return KernelCode("\n".join(lines), (min(rows * parts, STRIDE_GRID), 1, 1), (1024, 1, 1),
                      scratch=values + rows * parts * 8, counters=rows)


def split_setting() -> bool:
    """ATLAS_SAMPLE_SPLIT (default 1: a large vocabulary's row maximum split over blocks; 0: one block per row);
    CodegenError for another value."""
    return env_switch(SPLIT_ENV, True, CodegenError)


def sample_parts(vocab: int) -> int:
    """Blocks per row of the Sample kernel's maximum (sampling.cu sample_rows_split): one per PART_VALUES
    logits, at most MAX_PARTS; 1 (one block per row, sample_rows) for vocabularies up to PART_VALUES or with
    ATLAS_SAMPLE_SPLIT=0."""
    return max(1, min(MAX_PARTS, -(-vocab // PART_VALUES))) if split_setting() else 1
