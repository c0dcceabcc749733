"""Decode projections with int8 activations (act_int8.cu): the statements that quantize x's rows to int8
in shared memory and run the dp4a GEMV, W4A8 for LinearQ4 and W8A8 for LinearQ8, alone (quant.py) or in
NormLinearQ / NormLinearRotary (linear_prologue.py), for nodes whose attribute act is "int8" (set by
passes/choose_decode_path.py at decode).

The int8 rows take M x K bytes of dynamic shared memory after whatever the kernel already keeps there
(the fused kernels' staged x); the GEMV is compiled for MT = 1, 2, 4, 8 up to the rows' upper bound
and picked by M at run time. ACT8_U chunks of 16 bytes per lane are in flight (512 bytes per warp each).
Measured on sm90 (docs/perf.md v5): the dp4a kernels are slower than the float-activation kernels, so
choose-decode-path's table leaves them off there; ATLAS_INT4_PATH=w4a8 / ATLAS_INT8_PATH=w8a8 force them.

W4A8 with groups of 128 (or a multiple) and K % 128 == 0 also gets the tensor-core kernel linear_w4a8_mma
(int8 m16n8k32 products of the codes and x_q, split-K and steps in flight as quant.py's tensor-core path),
taken at run time on sm80+ with a 16-byte aligned wq; it quantizes x with the whole block after reading
its first weights, and runs a fused norm's staging (`pro`) there too. ATLAS_W4A8_PATH=dp4a leaves it out.
Measured on the H200 at M = 1 (docs/perf.md v11): 1.6-2.1x faster than the dp4a kernel on the 8B shapes,
and faster than the float-activation kernel on gate/up (23.2 vs 25.2 us) and the LM head (75.1 vs 87.2 us),
slower on QKV, o and down; at M = 8 slower than float activations everywhere. decode_paths.yaml still
holds the dp4a measurements (its 1B rows were not re-measured), so the table's choice is unchanged.

W8A8 of float16 x with a static K % 128 == 0 runs in its early form (ATLAS_W8A8_EARLY, default 1): each warp loads
its first round of weights (W8A8_U chunks of 16 bytes a lane), then the whole block runs the fused norm's staging
and quantizes x (act8_quantize_block, natural order) while they arrive. The v5 form quantized each row with one
warp before any weight load (every block at its start, the other warps waiting); 0 keeps that form (A/B timing).
H200 lab at M = 1 (docs/perf.md v33): the early form 1.3-1.8x faster than the v5 form on the 8B shapes, faster than
W8A16 on gate/up (33.07 vs 34.65 us) and the LM head (125.43 vs 138.46), slower on QKV, o and down.
"""

from __future__ import annotations

import os

from atlasc.codegen.generate import CodegenError
from atlasc.errors import env_switch
from atlasc.ir.ops.quant import ACT8_MAX_M, act8_why_not

ACT8_U = 2
W4A8_PATH_ENV = "ATLAS_W4A8_PATH"
W4A8_PATHS = ("mma", "dp4a")
W4A8_STEP = 128  # k per step of linear_w4a8_mma (64 bytes of a packed row)
# steps in flight per warp of linear_w4a8_mma (ATLAS_QUANT_U overrides): 4 was at least as fast as 3 on the 8B
# decode shapes at M = 1 and 2-8% faster on QKV, o and down (docs/perf.md v11); 64 registers at 3
W4A8_U = 4
W8A8_EARLY_ENV = "ATLAS_W8A8_EARLY"
W8A8_U = 4  # 16-byte chunks in flight per lane in the early W8A8 form (2 KB a warp; ATLAS_QUANT_U overrides)


def act8_smem(m_upper: int, k: int) -> int:
    """Dynamic shared memory bytes of the int8 rows (M x K, rounded up to 16)."""
    return -(-m_upper * k // 16) * 16


def w4a8_path() -> str:
    """ATLAS_W4A8_PATH (default "mma"); CodegenError for an unknown value."""
    path = os.environ.get(W4A8_PATH_ENV, "") or W4A8_PATHS[0]
    if path not in W4A8_PATHS:
        raise CodegenError(f"{W4A8_PATH_ENV}={path!r} is not a W4A8 path (expected one of: {', '.join(W4A8_PATHS)})")
    return path


def w4a8_steps() -> int:
    """W4A8_U, or ATLAS_QUANT_U when set (quant.py's override of steps in flight, 1 .. 8)."""
    from atlasc.codegen import quant  # quant.py imports this module

    return quant.steps_in_flight(4, 1) if os.environ.get(quant.U_ENV) else W4A8_U


def w8a8_early(bits: int, k_static, t: str = "__half") -> bool:
    """Whether act8_calls emits W8A8's early form (int8 weights, float16 x (t; float32's kernel spilled registers in
    ptxas), static K % 128 == 0, ATLAS_W8A8_EARLY not 0); CodegenError for a switch value other than 0 or 1."""
    if bits != 8 or t == "float":
        return False
    return env_switch(W8A8_EARLY_ENV, True, CodegenError) and isinstance(k_static, int) and k_static % W4A8_STEP == 0


def w8a8_steps() -> int:
    """W8A8_U, or ATLAS_QUANT_U when set."""
    from atlasc.codegen import quant  # quant.py imports this module

    return quant.steps_in_flight(8, 1) if os.environ.get(quant.U_ENV) else W8A8_U


def w4a8_mma_applies(bits: int, group: int, k_static) -> bool:
    """Whether act8_calls emits linear_w4a8_mma (int4, groups of a multiple of 128, static K % 128 == 0)."""
    return (bits == 4 and group % W4A8_STEP == 0 and isinstance(k_static, int) and k_static % W4A8_STEP == 0
            and w4a8_path() == "mma")


def act8_calls(name: str, t: str, r: int, bits: int, group: int, zp: bool, has_bias: str, k_static, m_upper: int,
               x: str, dyn_offset: int, epi: str = "", pro: str = "", n_upper: int = 0) -> tuple[list[str], int]:
    """(statements, blocks or 0): quantizing the View `x` into lin_dyn + dyn_offset and running linear_w4a8 /
    linear_w8a8, after the statement `pro` (a fused norm's staging, or ""); where linear_w4a8_mma applies,
    it first (blocks: its grid, from n_upper), the dp4a kernels the run-time fallback (expects N, K, M, wq,
    wscale, wzero, bias, bias_stride, y and the unsigned char array lin_dyn declared)."""
    why = act8_why_not(bits, group, k_static, m_upper)
    if why:
        raise CodegenError(f"{name}: int8 activations: {why}")
    if dyn_offset % 16:
        raise CodegenError(f"{name}: the int8 rows must start 16-byte aligned in shared memory (offset {dyn_offset})")
    lines = [
        f"  int* act8_x = reinterpret_cast<int*>(lin_dyn + {dyn_offset});",
        f"  __shared__ float act8_sx[{ACT8_MAX_M}];",
    ]
    blocks = 0
    if w4a8_mma_applies(bits, group, k_static):
        from atlasc.codegen import quant  # quant.py imports this module

        steps = k_static // W4A8_STEP
        split = quant.split_k(n_upper, steps)
        outs = n_upper // 2 if epi else n_upper
        feature_blocks = -(-outs // (8 if epi else 16))  # of 16 outputs, or 8 pairs
        blocks = -(-feature_blocks // (quant.WARPS // split))
        lines += [
            f"  if (atlas::w4a8_mma_ok<{group}>(wq, M, K)) {{",
            f"    __shared__ int act8_xs[{ACT8_MAX_M * steps}];",
            f"    __shared__ int act8_max[{ACT8_MAX_M}];",
            f"    __shared__ float act8_red[{1024 if split > 1 else 1}];",
            f"    auto act8_pro = [&]() {{ {pro.strip()} }};",
            f"    atlas::linear_w4a8_mma<{t}, {r}, {group}, {split}, {w4a8_steps()}, {has_bias}, "
            f"{str(zp).lower()}>({x}, act8_pro, act8_x, act8_xs, act8_sx, act8_max, act8_red, wq, wscale, bias, "
            f"bias_stride, y, M, N, K, {'wzero' if zp else 'nullptr'}{', ' + epi if epi else ''});",
            "  } else {",
        ]
    early = w8a8_early(bits, k_static, t)
    if early:  # the staging and the quantization run inside, after each warp's first weight loads
        body = [f"  __shared__ int act8_max[{ACT8_MAX_M}];",
                f"  auto act8_pre_f = [&]() {{ {pro.strip()} atlas::act8_quantize_block<{t}, {r}, false>({x}, M, K, "
                "act8_x, nullptr, act8_sx, act8_max); };",
                "  const atlas::LinPro<decltype(act8_pre_f), false> act8_pre{act8_pre_f};"]
    else:
        body = ([pro] if pro else []) + \
            [f"  atlas::act8_quantize<{t}, {r}, {str(bits == 4).lower()}>({x}, M, K, act8_x, act8_sx);"]
    variants = sorted({mt for mt in (1, 2, 4, 8) if mt < m_upper} | {min(8, 1 << (max(1, m_upper) - 1).bit_length())})
    for i, mt in enumerate(variants):
        cond = "" if i == len(variants) - 1 else f"if (M <= {mt}) "
        prefix = "  " if i == 0 else "  else "
        if bits == 4:
            call = (f"atlas::linear_w4a8<{t}, {r}, {mt}, {group}, {ACT8_U}, {has_bias}, {str(zp).lower()}>(act8_x, "
                    f"act8_sx, wq, wscale, bias, bias_stride, y, M, N, K, {'wzero' if zp else 'nullptr'}"
                    f"{', ' + epi if epi else ''});")
        elif early:
            call = (f"atlas::linear_w8a8<{t}, {r}, {mt}, {w8a8_steps()}, {has_bias}>(act8_x, act8_sx, "
                    f"reinterpret_cast<const signed char*>(wq), wscale, bias, bias_stride, y, M, N, K, "
                    f"{epi or 'atlas::LinNoEpi()'}, act8_pre);")
        else:
            call = (f"atlas::linear_w8a8<{t}, {r}, {mt}, {ACT8_U}, {has_bias}>(act8_x, act8_sx, "
                    f"reinterpret_cast<const signed char*>(wq), wscale, bias, bias_stride, y, M, N, K"
                    f"{', ' + epi if epi else ''});")
        body.append(f"{prefix}{cond}{call}")
    if blocks:
        return lines + ["  " + b for b in body] + ["  }"], blocks
    return lines + body, 0
