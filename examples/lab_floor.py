"""The kernel labs' floors: the time a kernel that only streams the same bytes takes, and an empty kernel.

A lab kernel that reads B bytes cannot beat `lab_read` on B bytes (lab_floor.cu: 16-byte streaming
loads, 4 in flight per thread, LAUNCH_BLOCKS blocks of 256 threads) timed the same way
(kernel_lab.time_launches: a captured graph of launches rotating among arena copies, so nothing stays
in L2); `lab_empty` is the per-launch cost left when a kernel reads nothing. `--floor` in
examples/kernel_lab.py and examples/quant_lab.py prints this table for the byte counts they timed, so a
row's distance from 4.30 TB/s splits into what any kernel of that size pays and what the kernel loses.

    python examples/lab_floor.py --mb 8.7,13,30,60,270      # alone (GPU machine)
    python examples/lab_floor.py --mb 30,60 --span-gb 6     # the same windows spread over one 6 GB allocation

--span-gb S places the windows a timing rotates among in one allocation of S GB, evenly spaced (up to
SPAN_WINDOWS of them), as a compiled model's weights lie in its arena: whether a footprint of gigabytes
(address translation) costs bandwidth that the labs' small arenas do not see.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from kernel_lab import PEAK, arena_count, time_launches

from atlasc.codegen.nvcc import compile_cubins
from atlasc.runtime.device import Device, KernelTable

SOURCE = Path(__file__).with_name("lab_floor.cu")
DATA_OFFSET = 256  # where lab_read's bytes start in the arena (n, a long long, at 0)
LAUNCH_BLOCKS = 132 * 8  # 8 blocks per H200 SM
SPAN_WINDOWS = 64  # windows of one --span-gb timing (rotated among like arena copies)


def spread_windows(dev, window: int, span: int, copies: int) -> tuple[list, list]:
    """(window addresses, allocations to free): `copies` arenas of `window` bytes when span <= 0; else up to
    SPAN_WINDOWS (at least 2) windows evenly spaced, 256-aligned, in one allocation of at least span bytes,
    so a timing rotating among them touches a footprint of span bytes as a compiled model's arena does."""
    if span <= 0:
        arenas = [dev.alloc_arena(window) for _ in range(copies)]
        return arenas, arenas
    count = max(2, min(SPAN_WINDOWS, span // window))
    big = dev.alloc_arena(count * window if span < count * window else span)
    step = (span // count) // 256 * 256 if span >= count * window else window
    return [int(big) + i * step for i in range(count)], [big]


def _windows(dev, nbytes: int, span: int) -> tuple[list, list]:
    """lab_read's windows for nbytes of data (see spread_windows)."""
    return spread_windows(dev, DATA_OFFSET + nbytes + 256, span, arena_count(nbytes))


def floor_rows(dev, sizes: list[int], span: int = 0) -> list[tuple[int, float, float, float]]:
    """(bytes, lab_read us, its GB/s, lab_empty us) for each size, on dev; span: see _windows."""
    module = dev.load_module(compile_cubins(SOURCE.read_text(), (dev.arch,))[dev.arch])
    table = KernelTable(dev, module, ["lab_read", "lab_empty"])
    rows = []
    for nbytes in sizes:
        nbytes = -(-nbytes // 16) * 16
        arenas, allocations = _windows(dev, nbytes, span)
        for a in arenas:
            dev.upload(a, 0, np.array([nbytes], np.int64))
            dev.upload(a, DATA_OFFSET, np.zeros(nbytes, np.uint8))
        dev.synchronize()
        read_us = time_launches(dev, lambda a: table.launch("lab_read", (LAUNCH_BLOCKS, 1, 1), (256, 1, 1), 0, a),
                                arenas)
        empty_us = time_launches(dev, lambda a: table.launch("lab_empty", (LAUNCH_BLOCKS, 1, 1), (256, 1, 1), 0, a),
                                 arenas)
        rows.append((nbytes, read_us, nbytes / (read_us * 1e-6) / 1e9, empty_us))
        for a in allocations:
            a.free()
    return rows


def print_floor(rows) -> None:
    """The floor table: a kernel streaming these bytes, and an empty kernel, in the labs' harness."""
    print(f"\n{'floor: MB':>10s} {'read us':>9s} {'GB/s':>7s} {'%4.3TB/s':>8s} {'empty us':>9s}")
    for nbytes, read_us, gbs, empty_us in rows:
        print(f"{nbytes / 1e6:10.1f} {read_us:9.2f} {gbs:7.0f} {100 * gbs * 1e9 / PEAK:7.1f}% {empty_us:9.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", default="8.7,13,30,60,270", help="comma-separated sizes in MB (1e6 bytes)")
    ap.add_argument("--span-gb", type=float, default=0.0,
                    help="spread the windows over one allocation of this many GB (default: small arena copies)")
    args = ap.parse_args(argv)
    print_floor(floor_rows(Device(), [int(float(s) * 1e6) for s in args.mb.split(",")], int(args.span_gb * 1e9)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
