"""Lab: batch-1 int4 decode layers (their projections; with --norm and --attn their norms, residuals and attention)
in one persistent kernel (examples/chain_lab.cu) against one launch each.

    python3 examples/chain_lab.py                                   # 8 layers of Llama-3-8B shapes, every config
    python3 examples/chain_lab.py --layers 4 --configs 16-11-io --modes persistent,separate
    python3 examples/chain_lab.py --configs 16-11-io --modes flags-lean --inflight 2 --norm --attn 256 --trace
                                                                    # the best form so far (docs/perf.md v48)
    python3 examples/chain_lab.py --ptxas                           # registers / spills only (no GPU needed)

Why: the 8B int4 decode step runs each projection as its own kernel at 32-47% of the bandwidth for the narrow ones
(docs/perf.md v42: QKV 7.69 us, o 6.23, down 14.97 alone), and DRAM idles at every boundary. Here the chain
QKV (4096 -> 6144), o (4096 -> 4096, fed by QKV's first 4096 outputs: a stand-in for attention), gate/up (4096 ->
28672) and down (the SwiGLU of gate/up's outputs, 14336 -> 4096), repeated for --layers layers with their own
weights (8.7 to 60.6 MB a projection with the scales, 112.5 MB a layer, so nothing stays in L2), runs in these modes
of the same code:
  persistent: one launch for the whole chain, a grid-wide barrier between projections, the weight copies flowing
              on into the next projection while the consumers finish this one;
  hold:       the same launch, but each projection's copies start only after its barrier;
  separate:   one launch per projection (captured in one graph, plain edges): the per-kernel baseline;
  counted:    persistent, with a grid barrier of one atomic per block on a count that only grows (one round
              trip fewer than persistent's generation barrier);
  flags:      persistent with no grid barrier: each output tile counts the blocks that have added their sums to it,
              and a block of the next projection waits only for the tiles its groups of x come from;
  lean:       persistent, with the barrier of the fewest L2 round trips: a release red per block on a count that
              only grows, acquire polls, no fence by every thread (chain_lab.cu LEAN);
  flags-lean: flags with LEAN's release red per tile and acquire polls;
  copy:       the persistent launch whose consumers only wait for each stage and release it (no math): what the
              pipeline with its barriers and staging streams; copy-lean: the same with the lean barrier;
  stream:     copy with no barrier and no staging: the ring's own rate over the chain's bytes.
A configuration W-S is W consumer warps (chunks of 16 W rows x 128 k) and S ring stages, one block per SM; flags
after a third dash: i multiplies each stage as two chains of MMAs instead of one, o dequantizes by offsets
(quant.cu's OFS: 5 instructions per 8 weights instead of 9), a runs W4A8 (x quantized to int8 per group of 128 k
at staging, the codes times x_q on the int8 tensor cores: 4 MMAs a stage instead of 8; checked against x_q).
--norm adds a layer's residual stream: QKV and gate/up stage the RMSNorm (no gain) of h plus their input (down's and
o's outputs), each block storing its slice of the new h, so these phases wait for all of their input.
--attn CTX puts a decode attention phase over CTX keys between QKV and o (o otherwise reads QKV's first outputs):
each KV head's keys in runs, a block per (KV head, run) writing a partial, merged at o's staging (chain_lab.cu ATTN,
MERGE).
--inflight D[,D..] caps the copies in flight per block at D (0: every ring stage; each D a row of its own): the
queues behind a full ring may slow every other memory access, the barrier's included (chain_lab.cu INFLIGHT).
--trace times each phase inside one launch of each mode in --modes but hold and separate with the global timer:
the consumers' barrier wait, x staging and items, per projection.

Each mode's first launch is checked phase by phase against numpy (y = fp16(x) @ dequant(W)^T in float32, x the
GPU's own input to that phase, so errors do not compound; tolerance 2e-3 of max |y|), then the chain is timed
as kernel_lab.py times (a captured graph of launches, median of replays). GB/s counts the packed weights and
scales; % of 4.30 TB/s. Per layer: the chain's time / layers; the bytes of a layer are 112.5 MB (26.2 us at
4.30 TB/s).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from wgmma_lab import nvcc_sm90a

HELPERS = Path(__file__).with_name("lab_bulk.cuh")  # prepended to the lab's source
SOURCE = Path(__file__).with_name("chain_lab.cu")
PEAK = 4.30e12
GROUP = 128
HIDDEN, QKV, INTER = 4096, 6144, 14336  # Llama-3-8B
CONFIGS = ("16-8-io", "16-11-io", "16-8-ia", "16-11-ia")
MODES = ("persistent", "counted", "lean", "flags", "flags-lean", "hold", "separate", "copy", "copy-lean", "stream")
COPY_MODES = ("copy", "copy-lean", "stream")  # no math: nothing to check
TRACED = ("persistent", "counted", "lean", "flags", "flags-lean", "copy", "copy-lean", "stream")
SMEM_LIMIT = 232448 - 1280  # a block's shared memory, less the kernel's static arrays (ptxas: up to 1104 bytes)
PHASE_DTYPE = np.dtype([("w", "<i8"), ("inp", "<i8"), ("out", "<i8"), ("K", "<i4"), ("N", "<i4"),
                        ("gated", "<i4"), ("norm", "<i4"), ("out2", "<i8"), ("ready", "<i8"), ("hin", "<i8"),
                        ("hout", "<i8"), ("attn", "<i4"), ("ctx", "<i4")])
EPS = 1e-5  # chain_lab.cu NORM's
TOLERANCE = 2e-3


def parse_config(name: str) -> tuple[int, int, int, int, int]:
    """W-S or W-S-flags as (consumer warps, ring stages, ILP2, OFS, A8): flags i (the MMAs as two chains), and o
    (the offset dequantization) or a (W4A8: x quantized to int8 per group of 128, int8 tensor cores)."""
    parts = name.split("-")
    flags = parts[2] if len(parts) == 3 else ""
    if len(parts) not in (2, 3) or not parts[0].isdigit() or not parts[1].isdigit() or set(flags) - {"i", "o", "a"} \
            or len(set(flags)) != len(flags) or (len(parts) == 3 and not flags) or {"o", "a"} <= set(flags):
        raise ValueError(name)
    return int(parts[0]), int(parts[1]), int("i" in flags), int("o" in flags), int("a" in flags)


def chunk_bytes(w: int) -> int:
    """One stage: 16 w rows x 64 packed bytes, then their 16 w float16 scales."""
    return 16 * w * 66


def smem_bytes(w: int, st: int) -> int:
    """Dynamic shared memory: the ring, x of the widest K (float16), 128 for alignment."""
    return st * chunk_bytes(w) + 2 * INTER + 128


def source(configs) -> str:
    kernels = "\n".join(f"CHAIN_LAB({w}, {st}, {i}, {o}, {a})" for w, st, i, o, a in configs)
    return HELPERS.read_text() + SOURCE.read_text() + kernels + "\n"


def layer_shapes(attn: bool = False) -> list[tuple[int, int, bool]]:
    """(K, N, gated input) of a layer's phases; attn: the attention phase after QKV, as K = 0."""
    return [(HIDDEN, QKV, False)] + [(0, HIDDEN, False)] * attn + [(HIDDEN, HIDDEN, False),
                                                                   (HIDDEN, 2 * INTER, False), (INTER, HIDDEN, True)]


PART = 520  # chain_lab.cu ATTN: a run's partial, floats


def attention_runs(sms: int) -> int:
    """The runs each KV head's keys are split into: a block per (KV head, run) (chain_lab.cu `runs`)."""
    return min(sms // 8, 32)


def attention_partials(qkv: np.ndarray, kc: np.ndarray, vc: np.ndarray, runs: int) -> np.ndarray:
    """chain_lab.cu attend_run's partials, float32 [8, runs, PART]: for KV head h and run r (keys r L .. r L + L - 1,
    L = ceil(ctx / runs)), per query head i of the 4: sum exp(s - m_i) v at 128 i, m_i at 512 + i, the total at 516 + i
    (an empty run: m = -inf and zeros). The caches' last row is the new key / value as in attention()."""
    ctx = kc.shape[1]
    k, v = kc.astype(np.float32), vc.astype(np.float32)
    k[:, -1] = qkv[4096:5120].reshape(8, 128).astype(np.float16)
    v[:, -1] = qkv[5120:6144].reshape(8, 128).astype(np.float16)
    q = qkv[:4096].reshape(8, 4, 128).astype(np.float32) / np.sqrt(np.float32(128))
    run = -(-ctx // runs)
    out = np.zeros((8, runs, PART), np.float32)
    for r in range(runs):
        lo, hi = r * run, min(ctx, (r + 1) * run)
        if lo >= hi:
            out[:, r, 512:516] = -np.inf
            continue
        s = np.einsum("hid,hjd->hij", q, k[:, lo:hi])
        m = s.max(axis=2)
        e = np.exp(s - m[:, :, None])
        out[:, r, :512] = np.einsum("hij,hjd->hid", e, v[:, lo:hi]).reshape(8, 512)
        out[:, r, 512:516], out[:, r, 516:520] = m, e.sum(axis=2)
    return out


def merge_partials(parts: np.ndarray) -> np.ndarray:
    """The o phase's input from attention_partials' layout (MERGE): per query head, the runs' sums weighted by
    exp(m_r - M) over the weighted totals, float32 [4096]."""
    m, tot = parts[:, :, 512:516], parts[:, :, 516:520]  # [8, runs, 4]
    big = m.max(axis=1, keepdims=True)
    e = np.where(np.isneginf(m), 0.0, np.exp(m - big))
    w = e / (e * tot).sum(axis=1, keepdims=True)  # [8, runs, 4]
    sums = parts[:, :, :512].reshape(parts.shape[0], parts.shape[1], 4, 128)
    return np.einsum("hri,hrid->hid", w, sums).reshape(-1).astype(np.float32)


def layer_names(attn: bool = False) -> list[str]:
    return ["QKV"] + ["attention"] * attn + ["o", "gate/up", "down"]


def attention(qkv: np.ndarray, kc: np.ndarray, vc: np.ndarray) -> np.ndarray:
    """--attn: chain_lab.cu attend's result for all 8 KV heads: the 32 query heads qkv[:4096] over the caches kc,
    vc (float16 [8, ctx, 128]) whose last row becomes the new key qkv[4096:5120] and value qkv[5120:6144] rounded to
    float16; softmax(q k / sqrt(128)) v per head, float32 [4096]."""
    k, v = kc.astype(np.float32), vc.astype(np.float32)
    k[:, -1] = qkv[4096:5120].reshape(8, 128).astype(np.float16)
    v[:, -1] = qkv[5120:6144].reshape(8, 128).astype(np.float16)
    q = qkv[:4096].reshape(8, 4, 128).astype(np.float32) / np.sqrt(np.float32(128))
    s = np.einsum("hid,hjd->hij", q, k)
    w = np.exp(s - s.max(axis=2, keepdims=True))
    w /= w.sum(axis=2, keepdims=True)
    return np.einsum("hij,hjd->hid", w, v).reshape(-1).astype(np.float32)


def chunked(wq: np.ndarray, scale: np.ndarray, rows: int) -> np.ndarray:
    """wq uint8 [N, K/2] and scale float16 [N, K/128] as the lab's chunks (tile-major, group-minor): bytes."""
    n, half_k = wq.shape
    tiles, groups = n // rows, half_k // 64
    w = wq.reshape(tiles, rows, groups, 64).transpose(0, 2, 1, 3).reshape(tiles, groups, rows * 64)
    s = scale.reshape(tiles, rows, groups).transpose(0, 2, 1).copy().view(np.uint8).reshape(tiles, groups, rows * 2)
    return np.ascontiguousarray(np.concatenate([w, s], axis=2)).reshape(-1)


def phase_input(prev: np.ndarray, k: int, gated: bool, int8: bool = False) -> np.ndarray:
    """The x a phase stages from its float32 input (gated: silu(in[:k]) * in[k:2k]): float16, or (int8) the values
    its int8 codes stand for, x_q * s with s = max |x| / 127 per group of 128 (float32)."""
    v = prev[:k].astype(np.float32)
    if gated:
        v = v / (1 + np.exp(-v)) * prev[k:2 * k].astype(np.float32)
    if not int8:
        return v.astype(np.float16)
    g = v.reshape(-1, GROUP)
    m = np.abs(g).max(axis=1, keepdims=True)
    s = np.where(m > 0, m / np.float32(127), np.float32(1)).astype(np.float32)
    return (np.clip(np.rint(g / s), -127, 127) * s).astype(np.float32).reshape(-1)


def normed(h_prev: np.ndarray, acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """--norm: the residual stream after a phase's input is added (h = h_prev + acc, float32) and the RMSNorm of it
    (no gain) that the phase stages."""
    h = h_prev.astype(np.float32) + acc.astype(np.float32)
    return h, (h / np.sqrt(np.mean(h * h, dtype=np.float64) + EPS)).astype(np.float32)


def trace_table(t: np.ndarray, layers: int, names: list[str]) -> list[str]:
    """Per projection of a layer: medians over blocks and layers (phases after the first) of the consumers' barrier
    wait, staging and items (us), the spread of the blocks' ends, and how far the producer's first copy of the
    phase ran ahead of the consumers' barrier (the attention phase's items: the slowest block's, since only 8 blocks
    attend). t: u64 [blocks, P, 6] (chain_lab.cu o_times); names: a layer's phases."""
    t = t.astype(np.int64)
    per = len(names)
    out = ["| projection | barrier wait us | staging us | items us | ends spread us | producer ahead us |",
           "|---|---|---|---|---|---|"]
    for j, name in enumerate(names):
        ps = [per * layer + j for layer in range(layers) if per * layer + j > 0]
        sel = t[:, ps, :]
        wait = np.median(sel[:, :, 1] - sel[:, :, 0]) / 1e3
        stage = np.median(sel[:, :, 2] - sel[:, :, 1]) / 1e3
        items = np.median((sel[:, :, 3] - sel[:, :, 2]).max(axis=0) if name == "attention"
                          else sel[:, :, 3] - sel[:, :, 2]) / 1e3
        spread = np.median(sel[:, :, 3].max(axis=0) - sel[:, :, 3].min(axis=0)) / 1e3
        ahead = "-" if name == "attention" else f"{np.median(sel[:, :, 1] - sel[:, :, 4]) / 1e3:.2f}"  # no copies
        out.append(f"| {name} | {wait:.2f} | {stage:.2f} | {items:.2f} | {spread:.2f} | {ahead} |")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help="W-S (consumer warps, ring stages) or W-S-flags, flags of i (the MMAs as two chains) and "
                         "o (the offset dequantization) or a (W4A8), comma-separated")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}, comma-separated")
    ap.add_argument("--trace", action="store_true", help="also time each phase inside one launch of each mode "
                    "but hold and separate per configuration (globaltimer) and print where a layer goes")
    ap.add_argument("--floor", action="store_true", help="also time lab_floor.py's read-only kernel on the chain's "
                    "bytes and on one layer's")
    ap.add_argument("--inflight", default="0", help="copies in flight per block, below the stages (0: no cap), "
                    "comma-separated: each value runs every mode")
    ap.add_argument("--norm", action="store_true", help="a layer's residual stream: QKV and gate/up stage the RMSNorm "
                    "of h + their input (o's and down's outputs added to h), so they wait for all of it")
    ap.add_argument("--attn", type=int, default=0, metavar="CTX", help="a decode attention phase over CTX keys "
                    "(2 .. 1024; a block per KV head and run of keys, merged at o's staging) between QKV and o, "
                    "instead of o reading QKV's first outputs")
    ap.add_argument("--attn-hold", action="store_true", help="with --attn: each block's producer starts o's copies "
                    "only once its consumers are done with their attention item (chain_lab.cu ATTN_HOLD; the "
                    "one-launch modes but hold, whose own hold covers it; separate launches o on its own anyway)")
    ap.add_argument("--attn-prefetch", action="store_true", help="with --attn: each attending block asks L2 for its "
                    "run's cached keys and values before it waits for QKV (chain_lab.cu ATTN_PREFETCH)")
    ap.add_argument("--ptxas", action="store_true", help="compile only; print ptxas registers and spills")
    args = ap.parse_args(argv)
    try:
        configs = [parse_config(c) for c in args.configs.split(",")]
    except ValueError as e:
        ap.error(f"--configs: W-S or W-S-flags (i, and o or a), not {e}")
    modes = [m.strip() for m in args.modes.split(",")]
    try:
        inflights = [int(d) for d in args.inflight.split(",")]
    except ValueError:
        ap.error(f"--inflight: comma-separated integers, not {args.inflight!r}")
    if [m for m in modes if m not in MODES] or args.layers < 1:
        ap.error(f"--modes takes {', '.join(MODES)}; --layers at least 1")
    for w, st, *_ in configs:
        if w < 1 or 16 * w > 256 or st < 2 or smem_bytes(w, st) > SMEM_LIMIT:
            ap.error(f"configuration {w}-{st}: 1..16 warps, 2+ stages, shared memory {smem_bytes(w, st)} B "
                     f"(limit {SMEM_LIMIT})")
        if [d for d in inflights if not 0 <= d < st]:
            ap.error(f"--inflight: 0 (no cap) or 1 .. {st - 1} for configuration {w}-{st}, not {args.inflight}")
    if args.attn and not 2 <= args.attn <= 1024:
        ap.error(f"--attn: 2 .. 1024 keys (chain_lab.cu ATTN_CTX_MAX), not {args.attn}")
    if (args.attn_hold or args.attn_prefetch) and not args.attn:
        ap.error("--attn-hold and --attn-prefetch need --attn")
    cubin = nvcc_sm90a(source(configs), args.ptxas)
    if args.ptxas:
        return 0

    sys.path.insert(0, str(Path(__file__).parent))
    from kernel_lab import time_launches

    from atlasc.ir.ops.quant import dequant_q4
    from atlasc.runtime.device import Device, KernelTable

    dev = Device()
    sms = dev.device.get_attribute(dev.cuda.device_attribute.MULTIPROCESSOR_COUNT)
    small = [f"{w}-{st}" for w, st, *_ in configs for k, n, _ in layer_shapes() if n // (16 * w) * (k // GROUP) < sms]
    if small and {"flags", "flags-lean"} & set(modes):  # chain_lab.cu FLAGS: a tile's contributors, no idle block
        sys.exit(f"--modes flags needs at least one item per block in every projection: not so for {small[0]}")
    module = dev.load_module(cubin)
    names = [f"chain_{w}_{st}_{i}_{o}_{a}" for w, st, i, o, a in configs]
    table = KernelTable(dev, module, names)
    rng = np.random.default_rng(0)
    runs = attention_runs(sms)
    shapes = [(k, n if k else 8 * runs * PART, g) for k, n, g in layer_shapes(bool(args.attn))] * args.layers
    names_layer = layer_names(bool(args.attn))
    P = len(shapes)
    x0 = rng.standard_normal(HIDDEN).astype(np.float32)
    # (wq, scale) per phase: codes 1..15 (values -7..7, mean 0, variance 56 / 3), rows of unit gain; each down
    # projection's scales are set so that its output (on the float chain from x0) has unit spread, since the SwiGLU
    # squares the spread (no fixed gain keeps 8 layers finite and nonzero)
    def is_norm(p: int) -> bool:
        return args.norm and names_layer[p % len(names_layer)] in ("QKV", "gate/up")

    def prev_norm(p: int) -> int:
        """The norm phase before p (whose h p adds to), -1 for the first (x0)."""
        return max([q for q in range(p) if is_norm(q)], default=-1)

    caches = {}  # --attn: per attention phase, the K and V caches (float16 [8, ctx, 128]; the last row the GPU's)
    weights, dense, prev, hs = [], [], x0, {}
    for p, (k, n, gated) in enumerate(shapes):
        if k == 0:
            caches[p] = tuple(rng.standard_normal((8, args.attn, 128)).astype(np.float16) for _ in range(2))
            prev = attention(prev, *caches[p])
            weights.append(None)
            dense.append(None)
            continue
        if is_norm(p):
            hs[p], prev = normed(x0 if p == 0 else hs[prev_norm(p)], np.zeros(k, np.float32) if p == 0 else prev[:k])
        lo, hi = (rng.integers(1, 16, (n, k // 2), dtype=np.uint8) for _ in range(2))
        wq = lo | (hi << 4)
        scale = (rng.uniform(0.5, 1.5, (n, k // GROUP)) / np.sqrt(56 / 3 * 1.08 * k)).astype(np.float16)
        d = dequant_q4(wq, scale, GROUP)  # float32, for the checks (7 GB at 8 layers)
        y = d @ phase_input(prev, k, gated).astype(np.float32)
        if gated:
            scale = (scale.astype(np.float32) / y.std()).astype(np.float16)
            d = dequant_q4(wq, scale, GROUP)
            y = d @ phase_input(prev, k, gated).astype(np.float32)
        weights.append((wq, scale))
        dense.append(d)
        prev = y
    wbytes = sum(w[0].nbytes + w[1].nbytes for w in weights if w is not None)
    print(f"{dev.name}: {args.layers} layers, {P} phases, {wbytes / 1e6:.1f} MB of packed weights and scales "
          f"({wbytes / PEAK * 1e6:.1f} us at 4.30 TB/s), {sms} blocks"
          f"{', the residual stream and RMSNorm before QKV and gate/up' if args.norm else ''}"
          f"{f', attention over {args.attn} keys' if args.attn else ''}\n")
    print("| config | mode | launches | us per chain | us per layer | GB/s | % of 4.30 TB/s | max err | max abs y |")
    print("|---|---|---|---|---|---|---|---|---|")
    traces = []
    for w_cfg in sorted({w for w, *_ in configs}):
        rows = 16 * w_cfg
        # arena: phase table, barrier, x0, trace, outputs, chunks (each 256-aligned)
        offs, pos = {}, 0

        def place(key, nbytes, align=256):
            nonlocal pos
            pos = (pos + align - 1) // align * align
            offs[key] = pos
            pos += nbytes

        place("phases", P * PHASE_DTYPE.itemsize)
        place("bar", 1024)  # generation barrier: words 0, 32; counted: 64; flags: 96, 100; lean: 128
        place("x0", 4 * HIDDEN)
        place("zeros", 4 * HIDDEN)  # --norm: the first QKV's input added to x0
        place("times", sms * P * 6 * 8)
        for p, (k, n, _) in enumerate(shapes):
            place(("out", p), 4 * n)
            place(("out2", p), 4 * n)
            place(("ready", p), 4 * max(n // rows, 8))  # attention: a counter per KV head
            if is_norm(p):
                place(("h", p), 4 * HIDDEN)
            if k == 0:
                place(("kc", p), caches[p][0].nbytes)
                place(("vc", p), caches[p][1].nbytes)
        for p, (k, n, _) in enumerate(shapes):
            if k:
                place(("w", p), n // rows * (k // GROUP) * chunk_bytes(w_cfg))
        arena = dev.alloc_arena(pos + 256)
        table_np = np.zeros(P, PHASE_DTYPE)
        for p, (k, n, gated) in enumerate(shapes):
            first_in = offs["zeros"] if is_norm(0) else offs["x0"]
            table_np[p] = (offs[("w", p)] if k else 0, first_in if p == 0 else offs[("out", p - 1)],
                           offs[("out", p)], k, n, int(gated), int(is_norm(p)), offs[("out2", p)], offs[("ready", p)],
                           offs["x0"] if p == 0 and is_norm(p) else offs[("h", prev_norm(p))] if is_norm(p)
                           else offs[("kc", p)] if k == 0 else 0,
                           offs[("h", p)] if is_norm(p) else offs[("vc", p)] if k == 0 else 0,
                           int(k == 0), args.attn if k == 0 else 0)
            if k == 0:
                dev.upload(arena, offs[("kc", p)], caches[p][0])
                dev.upload(arena, offs[("vc", p)], caches[p][1])
            else:
                dev.upload(arena, offs[("w", p)], chunked(*weights[p], rows))
        dev.upload(arena, offs["phases"], table_np)
        dev.upload(arena, offs["bar"], np.zeros(256, np.uint32))
        dev.upload(arena, offs["x0"], x0)
        dev.upload(arena, offs["zeros"], np.zeros(HIDDEN, np.float32))

        def zero_outputs(counters: bool = False):
            """Zero every output (both buffers); counters: also the tile counters and the launch number (flags)."""
            for p, (_k, n, _) in enumerate(shapes):
                dev.upload(arena, offs[("out", p)], np.zeros(n, np.float32))
                dev.upload(arena, offs[("out2", p)], np.zeros(n, np.float32))
                if counters:
                    dev.upload(arena, offs[("ready", p)], np.zeros(n // rows, np.uint32))
            if counters:
                dev.upload(arena, offs["bar"], np.zeros(256, np.uint32))

        for (w, st, ilp, ofs, a8), name in zip(configs, names):
            if w != w_cfg:
                continue
            smem = smem_bytes(w, st)
            flags = ("i" if ilp else "") + ("o" if ofs else "") + ("a" if a8 else "")
            label = (f"{w}-{st}{'-' + flags if flags else ''}{' ah' if args.attn_hold else ''}"
                     f"{' ap' if args.attn_prefetch else ''}")

            def launch(mode, wrap=1, times=0, inflight=0, name=name, smem=smem, w=w):
                spans = [(0, P)] if mode != "separate" else [(p, p + 1) for p in range(P)]
                for p0, p1 in spans:
                    table.launch(name, (sms, 1, 1), (32 * w + 32, 1, 1), smem, arena,
                                 args=(offs["phases"], P, p0, p1, offs["bar"], wrap,
                                       (1 if mode == "hold" else 2 if args.attn_hold else 0)
                                       | (4 if args.attn_prefetch else 0),
                                       int(mode in COPY_MODES), times,
                                       1 if mode == "counted" else 2 if mode.endswith("lean") else 0,
                                       int(mode.startswith("flags")), inflight, int(mode == "stream")))

            for mode, d in ((m, d) for m in modes for d in inflights):
                row = f"{label} d{d}" if d else label
                err = top = 0.0
                if mode not in COPY_MODES:
                    zero_outputs(counters=True)  # launch number 0: the flags mode writes the even buffers
                    launch(mode, wrap=0, inflight=d)
                    dev.synchronize()
                    prev, h_gpu = x0, {}
                    for p, (k, n, gated) in enumerate(shapes):
                        y = dev.download(arena, offs[("out", p)], 4 * n).view(np.float32)
                        if k == 0:  # attention: the runs' partials against numpy on the GPU's QKV outputs
                            want = attention_partials(prev, *caches[p], runs)
                            got = y.reshape(want.shape)
                            ok_m = np.array_equal(np.isneginf(got[:, :, 512:516]), np.isneginf(want[:, :, 512:516]))
                            diff = np.where(np.isneginf(want), 0, np.abs(got - want))
                            scale = np.abs(np.where(np.isneginf(want), 0, want)).max()
                            err = max(err, float(np.nan_to_num(diff, nan=np.inf).max() / scale) if ok_m else np.inf)
                            prev = merge_partials(got)
                            continue
                        if is_norm(p):  # the blocks' slices of h against h_prev + the input, both the GPU's
                            h_want, prev = normed(x0 if p == 0 else h_gpu[prev_norm(p)],
                                                  np.zeros(k, np.float32) if p == 0 else prev[:k])
                            h_gpu[p] = dev.download(arena, offs[("h", p)], 4 * HIDDEN).view(np.float32)
                            err = max(err, float(np.nan_to_num(np.abs(h_gpu[p] - h_want), nan=np.inf).max()
                                                 / np.abs(h_want).max()))
                        x16 = phase_input(prev, k, gated, int8=bool(a8))
                        want = dense[p] @ x16.astype(np.float32)
                        e = float(np.nan_to_num(np.abs(y - want), nan=np.inf).max() / np.abs(want).max())
                        err, top = max(err, e), max(top, float(np.abs(want).max()))
                        prev = y
                zero_outputs()  # the timed launches zero the next launch's first outputs themselves (wrap)
                us = time_launches(dev, lambda _a, mode=mode, d=d: launch(mode, inflight=d), [arena])
                ok = mode in COPY_MODES or (err < TOLERANCE and np.isfinite(top))
                print(f"| {row} | {mode} | {1 if mode != 'separate' else P} | {us:.1f} | {us / args.layers:.2f} | "
                      f"{wbytes / us / 1e3:.0f} | {100 * wbytes / (us * 1e-6) / PEAK:.1f} | "
                      f"{'-' if mode in COPY_MODES else f'{err:.1e}'}{'' if ok else '  WRONG'} | {top:.2f} |",
                      flush=True)
            if args.trace:
                for mode, d in ((m, d) for m in TRACED for d in inflights):
                    if mode not in modes:
                        continue
                    zero_outputs(counters=True)  # launch number 0 again (flags), the outputs of every mode zero
                    launch(mode, inflight=d)  # warm
                    launch(mode, times=offs["times"], inflight=d)
                    dev.synchronize()
                    t = dev.download(arena, offs["times"], sms * P * 6 * 8).view(np.uint64).reshape(sms, P, 6)
                    traces.append((f"{label}{f' d{d}' if d else ''} {mode}", trace_table(t, args.layers, names_layer)))
        arena.free()
    for title, lines in traces:
        print(f"\n{title} (one launch; medians over blocks and layers):")
        print("\n".join(lines))
    if args.floor:
        from lab_floor import floor_rows, print_floor

        print_floor(floor_rows(dev, [wbytes, wbytes // args.layers]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
