"""Lab: decode projections at M <= 32 rows through the copy engine and wgmma (examples/wgmma_lab.cu, sm_90a).

    python3 examples/wgmma_lab.py                                  # 8B shapes, M = 32, every configuration
    python3 examples/wgmma_lab.py --ms 1,16,32 --configs 2-2-5,2-1-8 --ks 1,2 --shapes "8B gate_up"
    python3 examples/wgmma_lab.py --ptxas                          # registers / spills only (no GPU needed)

Why: torch's cuBLAS runs the 8B projections at M = 32 at 72-92% of 4.30 TB/s (examples/peer_gemm_lab.py,
docs/perf.md v30) where linear.cu's MMA decode reaches 53-77%; its kernels (nvjet_sm90_hsh_<BN>x32_64x<S>)
stream tiles of BN features x 64 k through S shared-memory stages filled by the copy engine and multiply them
with wgmma. This lab asks whether our own kernel of that form gets there, before any of it goes into codegen.

A configuration NC-CH-S is NC consumer warpgroups of CH wgmma chains of 64 features (BN = 64 CH NC features
per block) and S stages; --ks splits K across that many blocks per tile (float32 partial sums, the tile's last
block adds them in order). Each (shape, M, configuration, ks) is checked once against numpy (float32
accumulation; tolerance 2e-2 of max |y|), then timed as kernel_lab.py times (a captured graph of launches
rotating among arena copies, so the weights come from DRAM). GB/s counts weight + x + y bytes; % of 4.30 TB/s.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SOURCE = Path(__file__).with_name("wgmma_lab.cu")
PEAK = 4.30e12
SHAPES = {  # (K, N), as in kernel_lab.py
    "8B qkv": (4096, 6144), "8B o": (4096, 4096), "8B gate_up": (4096, 28672), "8B down": (14336, 4096),
    "8B lm_head": (4096, 128256),
    "1B qkv": (2048, 3072), "1B o": (2048, 2048), "1B gate_up": (2048, 16384), "1B down": (8192, 2048),
}
# NC-CH-STAGES; shared memory per block: STAGES x (64 CH NC x 128 + 4096) bytes + 1024 <= 227 KB
CONFIGS = ("1-1-8", "1-1-16", "2-1-5", "2-1-6", "2-1-10", "1-2-10", "2-2-3", "2-2-4", "2-2-6", "1-4-6")
SMEM_LIMIT = 232448
TM_BYTES = 128


def parse_config(name: str) -> tuple[int, int, int]:
    nc, ch, st = (int(v) for v in name.split("-"))
    return nc, ch, st


def smem_bytes(nc: int, ch: int, st: int) -> int:
    return st * (64 * ch * nc * 128 + 32 * 64 * 2) + 1024


def source(configs) -> str:
    lines = [SOURCE.read_text()]
    lines += [f"WGMMA_LAB({nc}, {ch}, {st})" for nc, ch, st in configs]
    return "\n".join(lines) + "\n"


def nvcc_sm90a(text: str, ptxas: bool = False) -> bytes:
    """The cubin of CUDA source text for sm_90a (wgmma and the bulk tensor copies need the arch-specific target);
    ptxas: print registers and spills. Exits with nvcc's message on a failure."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "lab.cu", Path(tmp) / "lab.cubin"
        cu.write_text(text)
        cmd = ["nvcc", "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
               "-o", str(cubin), str(cu)]
        if ptxas:
            cmd.insert(1, "-Xptxas=-v")
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"nvcc failed:\n{run.stderr}")
        if ptxas:
            for line in run.stderr.splitlines():
                if "Compiling entry" in line or "Used" in line or "spill" in line:
                    print(line.strip())
        return cubin.read_bytes()


def compile_cubin(configs, ptxas: bool = False) -> bytes:
    """This lab's kernels for sm_90a; ptxas: print registers and spills."""
    return nvcc_sm90a(source(configs), ptxas)


class TensorMaps:
    """cuTensorMapEncodeTiled (libcuda) for a row-major float16 [rows, k] matrix, 128-byte swizzle."""

    def __init__(self):
        self.lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
        self.buf = ctypes.create_string_buffer(TM_BYTES + 64)

    def encode(self, addr: int, rows: int, k: int, box_rows: int) -> bytes:
        aligned = (ctypes.addressof(self.buf) + 63) // 64 * 64
        u64, u32 = ctypes.c_uint64, ctypes.c_uint32
        dims, strides = (u64 * 2)(k, rows), (u64 * 1)(k * 2)
        box, elem = (u32 * 2)(64, box_rows), (u32 * 2)(1, 1)
        # FLOAT16 = 6, INTERLEAVE_NONE = 0, SWIZZLE_128B = 3, L2_PROMOTION_L2_256B = 3, OOB_FILL_NONE = 0 (zeros)
        r = self.lib.cuTensorMapEncodeTiled(ctypes.c_void_p(aligned), 6, 2, ctypes.c_void_p(addr), dims, strides,
                                            box, elem, 0, 3, 3, 0)
        if r != 0:
            sys.exit(f"cuTensorMapEncodeTiled failed: CUresult {r}")
        return ctypes.string_at(aligned, TM_BYTES)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="8B qkv,8B o,8B gate_up,8B down,8B lm_head")
    ap.add_argument("--ms", default="32")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="NC-CH-STAGES, comma-separated")
    ap.add_argument("--ks", default="1,2,4", help="K splits to try (each must leave every block a k step)")
    ap.add_argument("--ptxas", action="store_true", help="compile only; print ptxas registers and spills")
    args = ap.parse_args(argv)
    configs = [parse_config(c) for c in args.configs.split(",")]
    for nc, ch, st in configs:
        if 64 * ch * nc > 256 or smem_bytes(nc, ch, st) > SMEM_LIMIT:
            sys.exit(f"configuration {nc}-{ch}-{st}: BN over 256 or shared memory {smem_bytes(nc, ch, st)} B")
    cubin = compile_cubin(configs, ptxas=args.ptxas)
    if args.ptxas:
        return 0

    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_lab import arena_count, time_launches

    from atlasc.runtime.device import Device, KernelTable

    dev = Device()
    module = dev.load_module(cubin)
    names = [f"wgmma_lab_{nc}_{ch}_{st}" for nc, ch, st in configs]
    table = KernelTable(dev, module, names)
    maps = TensorMaps()
    rng = np.random.default_rng(0)
    ks_list = [int(v) for v in args.ks.split(",")]
    rows = []
    print("| shape | M | config (NC-CH-S) | BN | ks | blocks | us | GB/s | % of 4.30 TB/s | max err / max abs |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape in [s.strip() for s in args.shapes.split(",")]:
        k, n = SHAPES[shape]
        w = (rng.standard_normal((n, k), dtype=np.float32) * k ** -0.5).astype(np.float16)
        for m in [int(v) for v in args.ms.split(",")]:
            x = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
            ref = x.astype(np.float32) @ w.astype(np.float32).T
            nbytes = 2 * (n * k + m * k + m * n)
            for (nc, ch, st), name in zip(configs, names):
                bn = 64 * ch * nc
                tiles = -(-n // bn)
                for ks in ks_list:
                    if -(-(k // 64) // ks) * (ks - 1) >= k // 64:
                        continue  # a run of the split would be empty
                    # arena: tensor maps at 0 and 128, then w, x, y, ws, counters (256-aligned)
                    o_w = 256
                    o_x = o_w + n * k * 2
                    o_y = (o_x + max(m, 32) * k * 2 + 255) // 256 * 256  # x's tensor map spans 32 rows
                    o_ws = (o_y + m * n * 2 + 255) // 256 * 256
                    ws_bytes = tiles * ks * nc * ch * 16 * 128 * 4 if ks > 1 else 0
                    o_cnt = (o_ws + ws_bytes + 255) // 256 * 256
                    size = o_cnt + tiles * 4 + 256
                    arenas = [dev.alloc_arena(size) for _ in range(arena_count(nbytes))]
                    for a in arenas:
                        base = int(a)
                        head = maps.encode(base + o_w, n, k, bn) + maps.encode(base + o_x, max(m, 32), k, 32)
                        dev.upload(a, 0, np.frombuffer(head, dtype=np.uint8))
                        dev.upload(a, o_w, w)
                        dev.upload(a, o_x, x)
                        dev.upload(a, o_cnt, np.zeros(tiles, dtype=np.uint32))
                    smem = smem_bytes(nc, ch, st)
                    go_args = (0, TM_BYTES, o_y, o_ws, o_cnt, m, n, k, ks)

                    def go(a, name=name, grid=tiles * ks, block=128 * nc + 32, smem=smem, go_args=go_args):
                        table.launch(name, (grid, 1, 1), (block, 1, 1), smem, a, args=go_args)

                    go(arenas[0])
                    dev.synchronize()
                    y = dev.download(arenas[0], o_y, m * n * 2).view(np.float16).reshape(m, n).astype(np.float32)
                    err = float(np.abs(y - ref).max() / np.abs(ref).max())
                    us = time_launches(dev, go, arenas)
                    for a in arenas:
                        a.free()
                    pct = 100 * nbytes / (us * 1e-6) / PEAK
                    flag = "" if err < 2e-2 else "  WRONG"
                    rows.append((shape, m, f"{nc}-{ch}-{st}", ks, us, pct, err))
                    print(f"| {shape} | {m} | {nc}-{ch}-{st} | {bn} | {ks} | {tiles * ks} | {us:.2f} | "
                          f"{nbytes / us / 1e3:.0f} | {pct:.1f} | {err:.1e}{flag} |", flush=True)
    print("\nbest per (shape, M):")
    best = {}
    for r in rows:
        if r[6] < 2e-2 and ((r[0], r[1]) not in best or r[4] < best[(r[0], r[1])][4]):
            best[(r[0], r[1])] = r
    for (shape, m), r in best.items():
        print(f"  {shape} M={m}: {r[4]:.2f} us ({r[5]:.1f}%), config {r[2]}, ks {r[3]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
