"""Lab: the batch-1 int4 / int8 projection with the copy engine streaming the weights (examples/w4_bulk_lab.cu).

    python3 examples/w4_bulk_lab.py                                 # 8B shapes, every configuration, K splits 1..8
    python3 examples/w4_bulk_lab.py --configs 8-6-2 --ks 1,2 --shapes "8B gate_up" --variant plain,gated --ofs 0,1
    python3 examples/w4_bulk_lab.py --quant int8 --variant plain,copy      # W8A16: int8 weights, a scale per row
    python3 examples/w4_bulk_lab.py --ptxas                         # registers / spills only (no GPU needed)

Why: quant.cu's one-row int4 kernel takes 1.5-1.8x the time of a kernel that only streams the same bytes
(examples/lab_floor.py; docs/perf.md v11, v37); ncu put it at ~46% of DRAM and ~52% of issue slots, each warp
alternating between a round of loads and a round of dequantization + MMAs. Here a producer warp keeps STAGES
stages of weights in flight through the copy engine (cp.async.bulk.tensor into shared memory) while W consumer
warps dequantize and multiply what has arrived. This lab asks whether that form reaches the floor, before any of
it goes into codegen.

A configuration W-S-B is W consumer warps (a tile of 16 W rows), S stages of 128 k (64 bytes a row) and a launch
bound of B blocks per SM; W-S-B-KW splits the warps into KW stage lanes (a tile of 16 W / KW rows, KW stages
multiplied at once; S a multiple of KW). --ks splits K across that many blocks per tile (float32 partial sums;
the tile's last block adds them in order). --variant gated: the gate/up projection with the SwiGLU epilogue (pairs
of rows j and N/2 + j, y[j] = silu(gate) * up, N/2 outputs), what a decode step runs for gate/up; plain: y = x W^T.
--ofs 1: the offset dequantization of quant.cu (ATLAS_QUANT_OFS: 5 instead of 9 instructions per 8 weights).
--quant int8: the same pipeline for quant.cu's W8A16 layout (int8 [N, K], a float16 scale per row; stages of 64 k).
--variant copy: the consumers only wait for each stage and release it (no math, nothing checked): what the copy engine
streams in that configuration, the floor of the others.
Weights are random packed nibbles with random float16 group scales (the compiler's layout: uint8 [N, K/2],
float16 [N, K/128]); each (shape, configuration, ks) is checked once against numpy
(float32; tolerance 1e-2 of max |y|), then timed as kernel_lab.py times (a captured graph of launches rotating
among arena copies, so the weights come from DRAM). GB/s counts packed weights + scales + x + y; % of 4.30 TB/s.
--floor also times lab_floor.py's read-only kernel on the same bytes. --layout chunks: the weights repacked so that
each stage is one contiguous chunk copied by one 1-D bulk copy (the chain lab's layout, scales kept apart; chunked()),
instead of the compiler's rows read by 2-D tensor-map boxes (rows, the default); rows,chunks times both.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import sys
from pathlib import Path

import numpy as np
from wgmma_lab import nvcc_sm90a

HELPERS = Path(__file__).with_name("lab_bulk.cuh")  # prepended to the lab's source
SOURCE = Path(__file__).with_name("w4_bulk_lab.cu")
PEAK = 4.30e12
GROUP = 128
SHAPES = {  # (K, N), as in kernel_lab.py
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "8B lm_head": (4096, 128256),
    "1B qkv": (2048, 3072), "1B o": (2048, 2048), "1B gate_up": (2048, 16384), "1B down": (8192, 2048),
}
CONFIGS = ("8-4-2", "8-6-2", "8-8-2", "8-6-3", "16-4-1", "16-6-1", "4-8-4")  # codegen/quant_bulk.py's: 16-11-1 (v49)
SMEM_LIMIT = 232448
TM_BYTES = 128


def parse_config(name: str) -> tuple[int, int, int, int]:
    """W-S-B or W-S-B-KW (KW stage lanes, default 1) as (W, S, B, KW)."""
    w, st, b, *kw = (int(v) for v in name.split("-"))
    return w, st, b, (kw[0] if kw else 1)


def smem_bytes(w: int, st: int, k_run: int, kw: int = 1) -> int:
    """dynamic shared memory: the stages (16 w / kw rows x 64 bytes each), the item's x (k_run halves) and its
    stages' offset sums (a float each, --ofs 1), 128 for the stages' alignment."""
    return st * 16 * (w // kw) * 64 + 2 * k_run + 4 * (k_run // GROUP) + 128


def source(configs) -> str:
    kernels = "\n".join(f"W4_BULK_LAB({', '.join(map(str, c))})" for c in configs)
    return HELPERS.read_text() + SOURCE.read_text() + kernels + "\n"


def compile_cubin(configs, ptxas: bool = False) -> bytes:
    """This lab's kernels for sm_90a (the bulk tensor copy); ptxas: print registers and spills."""
    return nvcc_sm90a(source(configs), ptxas)


def chunked(wq: np.ndarray, box: int, gated: bool) -> np.ndarray:
    """wq (uint8 [N, K/2] int4 codes or int8 [N, K]) as the CHUNK kernels stream it: for each tile, then each stage
    of 64 bytes a row, the stage's rows exactly as they lie in shared memory: `box` rows (plain: rows t box ..), or
    gated the `box` gate rows t box .. then the `box` up rows N/2 + t box .. (rows past the end zero); uint8, flat."""
    codes = wq.view(np.uint8)
    n, row_bytes = codes.shape
    steps = row_bytes // 64
    halves = (codes[:n // 2], codes[n // 2:]) if gated else (codes,)
    tiles = -(-halves[0].shape[0] // box)
    parts = []
    for h in halves:
        padded = np.zeros((tiles * box, row_bytes), np.uint8)
        padded[:h.shape[0]] = h
        parts.append(padded.reshape(tiles, box, steps, 64))
    stacked = np.stack(parts, axis=1)  # [tiles, 1 or 2, box, steps, 64]
    return np.ascontiguousarray(stacked.transpose(0, 3, 1, 2, 4)).ravel()


def encode_map(lib, buf, addr: int, rows: int, row_bytes: int, box_rows: int) -> bytes:
    """cuTensorMapEncodeTiled for a row-major uint8 [rows, row_bytes] matrix, box {64 bytes, box_rows}, no swizzle."""
    aligned = (ctypes.addressof(buf) + 63) // 64 * 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    dims, strides = (u64 * 2)(row_bytes, rows), (u64 * 1)(row_bytes)
    box, elem = (u32 * 2)(64, box_rows), (u32 * 2)(1, 1)
    # UINT8 = 0, INTERLEAVE_NONE = 0, SWIZZLE_NONE = 0, L2_PROMOTION_L2_256B = 3, OOB_FILL_NONE = 0 (zeros)
    r = lib.cuTensorMapEncodeTiled(ctypes.c_void_p(aligned), 0, 2, ctypes.c_void_p(addr), dims, strides,
                                   box, elem, 0, 0, 3, 0)
    if r != 0:
        sys.exit(f"cuTensorMapEncodeTiled failed: CUresult {r}")
    return ctypes.string_at(aligned, TM_BYTES)


def reference(wq: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    """y = x @ dequant(wq)^T in float32, chunked over rows (the LM head's dequantized matrix is 2 GB): int4 g128
    (wq uint8 [N, K/2], scale [N, K/128]) or int8 (wq int8 [N, K], scale [N])."""
    n = wq.shape[0]
    xf = x.astype(np.float32)
    y = np.empty(n, np.float32)
    for r0 in range(0, n, 8192):
        b = wq[r0:r0 + 8192]
        if wq.dtype == np.int8:
            q = b.astype(np.float32) * scale[r0:r0 + 8192, None].astype(np.float32)
        else:
            q = np.empty((b.shape[0], 2 * b.shape[1]), np.float32)
            q[:, 0::2] = (b & 15).astype(np.float32) - 8
            q[:, 1::2] = (b >> 4).astype(np.float32) - 8
            q *= np.repeat(scale[r0:r0 + 8192].astype(np.float32), GROUP, axis=1)
        y[r0:r0 + 8192] = q @ xf
    return y


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8B qkv,8B o,8B gate_up,8B down,8B lm_head")
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="W-STAGES-BLOCKS or W-STAGES-BLOCKS-KW (KW stage lanes), comma-separated")
    ap.add_argument("--ks", default="1,2,4,8", help="K splits to try (each must leave every block a stage)")
    ap.add_argument("--variant", default="plain", help="plain, gated (SwiGLU pairs), copy (no math), comma-separated")
    ap.add_argument("--ofs", default="0", help="offset dequantization off / on: 0, 1 or 0,1 (int4 only)")
    ap.add_argument("--quant", default="int4", help="int4 (g128) and / or int8 (a scale per row), comma-separated")
    ap.add_argument("--floor", action="store_true", help="also time the read-only kernel on the same bytes")
    ap.add_argument("--layout", default="rows",
                    help="rows (2-D tensor-map boxes of the compiler's rows) and / or chunks (1-D copies of repacked "
                         "stages), comma-separated")
    ap.add_argument("--ptxas", action="store_true", help="compile only; print ptxas registers and spills")
    args = ap.parse_args(argv)
    layouts = [parse_config(c) for c in args.configs.split(",")]
    variants = [v.strip() for v in args.variant.split(",")]
    ofs_list = args.ofs.split(",")
    quants = [q.strip() for q in args.quant.split(",")]
    chunks = [{"rows": 0, "chunks": 1}.get(v.strip(), -1) for v in args.layout.split(",")]
    if [v for v in variants if v not in ("plain", "gated", "copy")] or [o for o in ofs_list if o not in ("0", "1")] \
            or [q for q in quants if q not in ("int4", "int8")] or -1 in chunks:
        ap.error("--variant takes plain, gated, copy; --ofs takes 0, 1; --quant takes int4, int8; --layout takes rows, "
                 "chunks")
    configs = [(w, st, b, int(v == "gated"), int(o), int(v == "copy"), 4 if q == "int4" else 8, kw, chunk)
               for q in quants for v in variants
               for o in (ofs_list if v != "copy" and q == "int4" else ["0"]) for w, st, b, kw in layouts
               for chunk in chunks]
    for w, st, *_, kw, _ in configs:
        if 16 * w > 256 or w % kw or st % kw or smem_bytes(w, st, 14336, kw) > SMEM_LIMIT:
            sys.exit(f"configuration {w}-{st} ({kw} lanes): a tile over 256 rows, lanes that do not divide the warps "
                     f"and stages, or shared memory {smem_bytes(w, st, 14336, kw)} B")
    cubin = compile_cubin(configs, ptxas=args.ptxas)
    if args.ptxas:
        return 0

    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_lab import arena_count, time_launches

    from atlasc.runtime.device import Device, KernelTable

    dev = Device()
    module = dev.load_module(cubin)
    names = ["w4_bulk_" + "_".join(map(str, c)) for c in configs]
    table = KernelTable(dev, module, names)
    lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    buf = ctypes.create_string_buffer(TM_BYTES + 64)
    rng = np.random.default_rng(0)
    ks_list = [int(v) for v in args.ks.split(",")]
    rows, floor_bytes = [], []
    print("| shape | config (W-S-B) | ks | blocks | us | GB/s | % of 4.30 TB/s | max err / max abs |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, bits in [(s.strip(), 4 if q == "int4" else 8) for s in args.shapes.split(",") for q in quants]:
        k, n = SHAPES[shape]
        if bits == 4:
            wq = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
            scale = (rng.uniform(0.5, 1.5, (n, k // GROUP)) * (k ** -0.5) / 4).astype(np.float16)
        else:
            wq = rng.integers(-127, 128, (n, k), dtype=np.int8)
            scale = (rng.uniform(0.5, 1.5, n) * (k ** -0.5) / 64).astype(np.float16)
        x = rng.standard_normal(k, dtype=np.float32).astype(np.float16)
        ref = reference(wq, scale, x)
        h = n // 2
        f16 = ref.astype(np.float16).astype(np.float32)
        ref_gated = f16[:h] / (1 + np.exp(-f16[:h])) * f16[h:]
        nbytes = wq.nbytes + scale.nbytes + 2 * (k + n)
        floor_bytes.append(wq.nbytes + scale.nbytes)
        # one set of arena copies per shape (the configurations rewrite only the tensor map and the counters):
        # tensor map at 0, wq, scale, x, y, ws (room for every tile x split), counters
        max_ks, max_tiles = max(ks_list), max(-(-n // (16 * (w // kw))) for w, *_, kw, _ in configs)
        o_w = (TM_BYTES * len(configs) + 255) // 256 * 256  # a tensor map slot per configuration, then wq
        o_s = o_w + wq.nbytes
        o_x = (o_s + scale.nbytes + 255) // 256 * 256
        o_y = (o_x + 2 * k + 255) // 256 * 256
        o_ws = (o_y + 2 * n + 255) // 256 * 256
        o_cnt = (o_ws + max_tiles * 256 * max_ks * 4 + 255) // 256 * 256
        o_c = (o_cnt + max_tiles * 4 + 255) // 256 * 256  # --layout chunks: the configuration's repacked weights
        chunk_bytes = max_tiles * 256 * wq.view(np.uint8).shape[1] if 1 in chunks else 0
        arenas = [dev.alloc_arena(o_c + chunk_bytes + 256) for _ in range(arena_count(nbytes))]
        for a in arenas:
            dev.upload(a, o_w, wq)
            dev.upload(a, o_s, scale)
            dev.upload(a, o_x, x)
        for slot, ((w, st, b, gated, ofs, copy, cbits, kw, chunk), name) in enumerate(zip(configs, names)):
            if cbits != bits:
                continue
            rg = w // kw  # warps of a stage lane: a tile's row groups
            outs, box = (h, 8 * rg) if gated else (n, 16 * rg)  # outputs, rows a tile reads per box
            tiles = -(-outs // box)
            sk = 128 if bits == 4 else 64  # k per stage
            steps = k // sk
            want = ref_gated if gated else ref
            label = (f"int{bits} {w}-{st}-{b}{f'-{kw}' if kw > 1 else ''}{' gated' if gated else ''}"
                     f"{' ofs' if ofs else ''}{' copy' if copy else ''}{' chunks' if chunk else ''}")
            o_tw = o_c if chunk else TM_BYTES * slot
            packed = chunked(wq, box, bool(gated)) if chunk else None
            for a in arenas:
                if chunk:
                    dev.upload(a, o_c, packed)
                else:
                    dev.upload(a, o_tw, np.frombuffer(encode_map(lib, buf, int(a) + o_w, n, wq.shape[1], box),
                                                      dtype=np.uint8))
                dev.upload(a, o_cnt, np.zeros(tiles, dtype=np.uint32))
            for ks in ks_list:
                run = -(-steps // ks)
                if run * (ks - 1) >= steps:
                    continue  # a run of the split would be empty
                smem = smem_bytes(w, st, run * sk, kw)
                go_args = (o_tw, o_s, o_x, o_y, o_ws, o_cnt, n, k, ks)

                def go(a, name=name, grid=tiles * ks, block=32 * w + 32, smem=smem, go_args=go_args):
                    table.launch(name, (grid, 1, 1), (block, 1, 1), smem, a, args=go_args)

                dev.upload(arenas[0], o_y, np.full(outs, np.nan, np.float16))  # no earlier result counts
                go(arenas[0])
                dev.synchronize()
                y = dev.download(arenas[0], o_y, outs * 2).view(np.float16).astype(np.float32)
                err = float(np.nan_to_num(np.abs(y - want), nan=np.inf).max() / np.abs(want).max()) if not copy else 0.0
                us = time_launches(dev, go, arenas)
                pct = 100 * nbytes / (us * 1e-6) / PEAK
                flag = " (copy only)" if copy else "" if err < 1e-2 else "  WRONG"
                rows.append((shape, label, ks, us, pct, err))
                print(f"| {shape} | {label} | {ks} | {tiles * ks} | {us:.2f} | {nbytes / us / 1e3:.0f} | "
                      f"{pct:.1f} | {err:.1e}{flag} |", flush=True)
        for a in arenas:
            a.free()
    print("\nbest per shape:")
    best = {}
    for r in rows:
        if "copy" in r[1]:
            continue
        key = (r[0], r[1].split()[0], "gated" in r[1], "chunks" in r[1])
        if r[5] < 1e-2 and (key not in best or r[3] < best[key][3]):
            best[key] = r
    for (shape, quant, gated, chunk), r in best.items():
        kind = f"{quant}{' gated' if gated else ''}{' chunks' if chunk else ''}"
        print(f"  {shape} {kind}: {r[3]:.2f} us ({r[4]:.1f}%), config {r[1]}, ks {r[2]}")
    if args.floor:
        from lab_floor import floor_rows, print_floor

        print_floor(floor_rows(dev, floor_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
