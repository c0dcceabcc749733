"""Decode projections with int8 activations (act_int8.cu): the statements that quantize x's rows to int8
in shared memory and run the dp4a GEMV, W4A8 for LinearQ4 and W8A8 for LinearQ8, alone (quant.py) or in
NormLinearQ / NormLinearRotary (linear_prologue.py), for nodes whose attribute act is "int8" (set by
passes/choose_decode_path.py at decode).

The int8 rows take M x K bytes of dynamic shared memory after whatever the kernel already keeps there
(the fused kernels' staged x); the GEMV is compiled for MT = 1, 2, 4, 8 up to the rows' upper bound
and picked by M at run time. ACT8_U chunks of 16 bytes per lane are in flight (512 bytes per warp each).
Measured on sm90 (docs/perf.md): slower than the float-activation kernels, so choose-decode-path's table
leaves them off there; ATLAS_INT4_PATH=w4a8 / ATLAS_INT8_PATH=w8a8 force them.
"""

from __future__ import annotations

from atlasc.codegen.generate import CodegenError
from atlasc.ir.ops.quant import ACT8_MAX_M, act8_why_not

ACT8_U = 2


def act8_smem(m_upper: int, k: int) -> int:
    """Dynamic shared memory bytes of the int8 rows (M x K, rounded up to 16)."""
    return -(-m_upper * k // 16) * 16


def act8_calls(name: str, t: str, r: int, bits: int, group: int, zp: bool, has_bias: str, k_static, m_upper: int,
               x: str, dyn_offset: int, epi: str = "") -> list[str]:
    """Statements quantizing the View `x` into lin_dyn + dyn_offset and running linear_w4a8 / linear_w8a8
    (expects N, K, M, wq, wscale, wzero, bias, bias_stride, y and the unsigned char array lin_dyn declared)."""
    why = act8_why_not(bits, group, k_static, m_upper)
    if why:
        raise CodegenError(f"{name}: int8 activations: {why}")
    if dyn_offset % 16:
        raise CodegenError(f"{name}: the int8 rows must start 16-byte aligned in shared memory (offset {dyn_offset})")
    lines = [
        f"  int* act8_x = reinterpret_cast<int*>(lin_dyn + {dyn_offset});",
        f"  __shared__ float act8_sx[{ACT8_MAX_M}];",
        f"  atlas::act8_quantize<{t}, {r}, {str(bits == 4).lower()}>({x}, M, K, act8_x, act8_sx);",
    ]
    variants = sorted({mt for mt in (1, 2, 4, 8) if mt < m_upper} | {min(8, 1 << (max(1, m_upper) - 1).bit_length())})
    for i, mt in enumerate(variants):
        cond = "" if i == len(variants) - 1 else f"if (M <= {mt}) "
        prefix = "  " if i == 0 else "  else "
        if bits == 4:
            call = (f"atlas::linear_w4a8<{t}, {r}, {mt}, {group}, {ACT8_U}, {has_bias}, {str(zp).lower()}>(act8_x, "
                    f"act8_sx, wq, wscale, bias, bias_stride, y, M, N, K, {'wzero' if zp else 'nullptr'}"
                    f"{', ' + epi if epi else ''});")
        else:
            call = (f"atlas::linear_w8a8<{t}, {r}, {mt}, {ACT8_U}, {has_bias}>(act8_x, act8_sx, "
                    f"reinterpret_cast<const signed char*>(wq), wscale, bias, bias_stride, y, M, N, K"
                    f"{', ' + epi if epi else ''});")
        lines.append(f"{prefix}{cond}{call}")
    return lines
