// Lab (examples/w4_bulk_lab.py): the batch-1 int4 g128 (or, BITS 8, int8 per-row-scaled) decode projection
// y[N] = x[K] @ dequant(wq)^T with the copy engine streaming the packed weights into a ring of shared-memory stages
// and consumer warps multiplying them where they lie (mma.sync m16n8k16 on the dequantized nibbles, as quant.cu's
// tensor-core path does in registers). codegen/quant_bulk.cu is the compiler's version of this body (with the norm
// source and the View epilogues; ATLAS_QUANT_BULK=1); this file is standalone on purpose, as wgmma_lab.cu beside
// linear_tma.cu, so that its configurations can be swept without the compiler, and adds the copy-only floor. A fix
// to the shared body (barriers, staging, fragments) belongs in both.
// Why: quant.cu's one-row kernel issues a round of weight loads per warp, waits, then dequantizes and multiplies;
// while a warp computes it has no bytes in flight, and ncu put it at ~46% of DRAM and ~52% of issue slots
// (docs/perf.md v11). Here the bytes in flight are the ring's stages, whatever the consumers do.
//
// Weights stay in the compiler's layout: wq uint8 [N, K/2] (low nibble = even k, value + 8), scale float16 [N, K/128].
// The copy engine reads them by a 2-D tensor map (uint8, dims {K/2, N}, box {64, BN}, no swizzle): a stage is the
// 128 k of one g128 group for BN = 16 W rows, 64 bytes a row, rows packed densely in shared memory.
// Block: W consumer warps (warp w multiplies rows 16 w .. 16 w + 15 of the tile), then one producer warp whose
// lane 0 issues the copies. Lane (g, c) reads 16 bytes of rows g and g + 8 at byte 16 c (conflict-free: a phase's
// two rows are 64 bytes apart), i.e. k 32 c .. 32 c + 31 of the stage, and x at the same k from shared memory
// (staged once per block in the order the lanes read it). Dequantization and the MMA chain as quant.cu's
// qlin_step4 (exact products; each stage's chain from zero, times the rows' group scale into float32).
// An item is (tile, run ks of ks_n): with ks_n > 1 each item writes float32 partial sums to ws and the tile's last
// item to finish adds them in run order (deterministic) and stores y. Arena layout (offsets are arguments): the
// weight tensor maps (128 bytes each: one per configuration, fenced before use), wq, scale, x [K], y [N] float16,
// ws, counters (zero, left zero).
// CHUNK (w4_bulk_lab.py --layout chunks): the weights repacked so that each stage is one contiguous chunk, the
// stage's ROWS rows x 64 bytes exactly as the stage lies in shared memory (gated: the P gate rows, then the P up
// rows), chunk (tile, step) at (tile * steps + step) * W_STAGE from o_tw, and copied by one 1-D bulk copy instead of
// the tensor map's box(es): the layout the chain lab streams (examples/chain_lab.cu, without its scales), against the
// compiler's 2-D boxes of the [N, K/2] rows (docs/perf.md v53 Next 2).
// Compiled after examples/lab_bulk.cuh (w4_bulk_lab.py prepends it): the mbarrier, MMA and dequantization helpers.
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

// box at (c0 bytes along a row, c1 rows) of the tensor map at tmap (global memory) into dst, completing on bar
__device__ __forceinline__ void tma_load(void* dst, const void* tmap, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(tmap), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

constexpr int ROW_BYTES = 64;  // bytes of a row per stage: 128 k of int4 (one g128 group) or 64 k of int8

// GATED: a tile is P = 8 W pairs (gate rows j0 .. j0 + P - 1 and up rows H + j0 ..: two boxes of P rows per stage,
// gate rows first); warp w's A rows g are gate rows 8 w + g, rows g + 8 the up rows of the same pairs, so a lane
// holds both sums of its pair and stores silu(gate) * up (each rounded to float16 first, as the compiler's SwiGLU
// epilogue). Otherwise a tile is BN = 16 W rows, warp w's rows 16 w .. 16 w + 15.
// OFS: quant.cu's offset dequantization (ATLAS_QUANT_OFS): the A operands are the LOP3 pairs as they come (1024 + n
// for an even k, 1024 + 16 n for an odd one), x is staged as (x0, x4) (x2, x6) (x1/16, x5/16) (x3/16, x7/16) per
// word, and each stage's chain starts at -(1032 S_e + 72 S_o): 5 instructions per 8 weights instead of 9.
// COPY: the consumers only wait for each stage and release it (no math, y not written): what the copy engine alone
// streams in this configuration, the floor of the others.
// BITS 8: int8 weights [N, K] with a float16 scale per row (quant.cu's W8A16 layout): a stage is 64 k, lane c's 16
// bytes are k 16 c .. 16 c + 15 (words 2 h, 2 h + 1 against x words 2 c + h, staged at slot 4 h + c), dequantized
// as qlin_step8 (exact), the row scale applied once at the end.
// KW > 1 (stage lanes): the W warps form KW lanes of RG = W / KW warps; a tile is 16 RG rows (8 RG pairs) and lane l
// consumes the stages it with it % KW == l, so KW stages are multiplied at once (each warp's per-stage chain of
// loads, dequantization and MMAs is what bounds a block, docs/perf.md v44 run 1); the lanes' sums meet in shared
// memory in lane order at the end. STAGES % KW == 0 keeps each slot with one lane (whose parity waits then never run
// two phases ahead).
template <int W, int STAGES, bool GATED, bool OFS, bool COPY = false, int BITS = 4, int KW = 1, bool CHUNK = false>
__device__ __forceinline__ void w4_bulk(unsigned char* arena, long long o_tw, long long o_scale, long long o_x,
                                        long long o_y, long long o_ws, long long o_cnt, long long N_, long long K_,
                                        long long ks_n_) {
  static_assert(BITS == 4 || !OFS, "the offset dequantization is int4's");
  static_assert(W % KW == 0 && STAGES % KW == 0, "KW lanes of whole warps, each slot with one lane");
  constexpr int RG = W / KW;  // warps per stage lane: a tile's row groups
  const int N = int(N_), K = int(K_), ks_n = int(ks_n_);
  constexpr int SK = BITS == 4 ? 128 : 64;  // k per stage
  constexpr int WPS = SK / 8;                // words of 8 k per stage
  constexpr int LW = WPS / 4;                // words per lane c (4 int4, 2 int8)
  constexpr int ROWS = 16 * RG;     // weight rows per stage
  constexpr int OUTS = GATED ? 8 * RG : 16 * RG;  // outputs per tile
  constexpr int W_STAGE = ROWS * ROW_BYTES;
  extern __shared__ unsigned char dyn_raw[];
  unsigned char* dyn = dyn_raw + ((128 - (smem_u32(dyn_raw) & 127)) & 127);  // the copies' destinations: 128-aligned
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  __shared__ int last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tile = blockIdx.x / ks_n, ks = blockIdx.x % ks_n;
  const int steps = K / SK, run = (steps + ks_n - 1) / ks_n;
  const int s0 = ks * run, s1 = s0 + run < steps ? s0 + run : steps;
  const int iters = s1 - s0;
  const int H = N / 2, outs = GATED ? H : N;
  unsigned char* xs = dyn + STAGES * W_STAGE;  // the item's x: iters * SK halves, in lane order
  float* corr = reinterpret_cast<float*>(xs + iters * SK * 2);  // OFS: each stage's chain start (negated)
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], RG);  // lane 0 of each consumer warp of the stage's lane
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == W) {  // producer
    if (lane == 0) {
      const void* tw = arena + o_tw;
      // the host rewrites the map between configurations: the copy engine must not use a stale copy of it
      if constexpr (!CHUNK) asm volatile("fence.proxy.tensormap::generic.acquire.gpu [%0], 128;" ::"l"(tw) : "memory");
      for (int it = 0; it < iters; ++it) {
        const int s = it % STAGES;
        bar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
        bar_expect(&full[s], W_STAGE);
        if constexpr (CHUNK) {
          bulk_load(dyn + s * W_STAGE, arena + o_tw + ((long long)tile * steps + s0 + it) * W_STAGE, W_STAGE,
                    &full[s]);
        } else if constexpr (GATED) {
          const int kb = (s0 + it) * ROW_BYTES;
          tma_load(dyn + s * W_STAGE, tw, &full[s], kb, tile * OUTS);
          tma_load(dyn + s * W_STAGE + W_STAGE / 2, tw, &full[s], kb, H + tile * OUTS);
        } else {
          tma_load(dyn + s * W_STAGE, tw, &full[s], (s0 + it) * ROW_BYTES, tile * OUTS);
        }
      }
    }
    return;
  }
  // x of the item's steps into shared memory: word v = LW c + w of a step (int4: k 32 c + 8 w .. + 7) at slot
  // 4 w + c, so lane c's load of word w reads 16 contiguous bytes with its 3 neighbours (no bank conflict)
  const uint4* x = reinterpret_cast<const uint4*>(arena + o_x) + (long long)s0 * WPS;
  for (int base = 0; base < iters * WPS; base += 32 * W) {  // uniform trip count: OFS's lanes shuffle
    const int v = base + threadIdx.x;
    const int st = v / WPS, vv = v % WPS, c = vv / LW, w = vv % LW;
    uint4 p = make_uint4(0u, 0u, 0u, 0u);
    if (v < iters * WPS) p = __ldg(x + v);
    if constexpr (OFS) {
      const unsigned sixteenth = 0x2C002C00u;  // (1/16, 1/16)
      p = make_uint4(lo2(p.x, p.z), lo2(p.y, p.w), hmul2(hi2(p.x, p.z), sixteenth),
                     hmul2(hi2(p.y, p.w), sixteenth));
      float se = half2_sum(p.x) + half2_sum(p.y), so = 16.f * (half2_sum(p.z) + half2_sum(p.w));
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) {
        se += __shfl_xor_sync(0xffffffffu, se, off);
        so += __shfl_xor_sync(0xffffffffu, so, off);
      }
      if (v < iters * WPS && vv == 0) corr[st] = fmaf(1032.f, se, 72.f * so);
    }
    if (v < iters * WPS) *reinterpret_cast<uint4*>(xs + (st * WPS + 4 * w + c) * 16) = p;
  }
  asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");

  const int rg = warp % RG, sl = warp / RG;  // the warp's row group and stage lane
  if constexpr (COPY) {
    for (int it = sl; it < iters; it += KW) {
      const int s = it % STAGES;
      bar_wait(&full[s], (it / STAGES) & 1);
      __syncwarp();
      if (lane == 0) bar_arrive(&empty[s]);
    }
    return;
  }
  const int g = lane >> 2, c = lane & 3;
  // weight rows of A rows g and g + 8 (global, for the scales) and their places in a stage
  const int r_lo = GATED ? 8 * rg + g : 16 * rg + g, r_hi = GATED ? OUTS + r_lo : r_lo + 8;
  const int n_lo = GATED ? tile * OUTS + r_lo : tile * OUTS + r_lo;
  const int n_hi = GATED ? H + tile * OUTS + r_lo : n_lo + 8;
  const int groups = BITS == 4 ? K / SK : 1;  // int8: one scale per row, applied after the loop
  const __half* scale = reinterpret_cast<const __half*>(arena + o_scale);
  const __half* sc_lo = scale + (long long)(n_lo < N ? n_lo : N - 1) * groups;
  const __half* sc_hi = scale + (long long)(n_hi < N ? n_hi : N - 1) * groups;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const unsigned char* wrow_lo = dyn + r_lo * ROW_BYTES + 16 * c;
  const unsigned char* wrow_hi = dyn + r_hi * ROW_BYTES + 16 * c;
  for (int it = sl; it < iters; it += KW) {
    const int s = it % STAGES;
    const float slo = BITS == 4 ? __half2float(sc_lo[s0 + it]) : 1.f;
    const float shi = BITS == 4 ? __half2float(sc_hi[s0 + it]) : 1.f;
    bar_wait(&full[s], (it / STAGES) & 1);
    const uint4 wlo = *reinterpret_cast<const uint4*>(wrow_lo + s * W_STAGE);
    const uint4 whi = *reinterpret_cast<const uint4*>(wrow_hi + s * W_STAGE);
    __syncwarp();
    if (lane == 0) bar_arrive(&empty[s]);
    const unsigned ulo[4] = {wlo.x, wlo.y, wlo.z, wlo.w}, uhi[4] = {whi.x, whi.y, whi.z, whi.w};
    float part[4];
    if constexpr (OFS) {
      const float cs = corr[it];
      part[0] = part[1] = part[2] = part[3] = -cs;  // the same x for both rows: one start
    } else {
      part[0] = part[1] = part[2] = part[3] = 0.f;
    }
#pragma unroll
    for (int w = 0; w < LW; ++w) {
      const uint4 xv = *reinterpret_cast<const uint4*>(xs + (it * WPS + 4 * w + c) * 16);
      if constexpr (BITS == 8) {  // words 2 w, 2 w + 1: k 8 w .. 8 w + 7 of the lane's 16
        unsigned pl0[2], ph0[2], pl1[2], ph1[2];
        q8_pairs(ulo[2 * w], pl0);
        q8_pairs(uhi[2 * w], ph0);
        q8_pairs(ulo[2 * w + 1], pl1);
        q8_pairs(uhi[2 * w + 1], ph1);
        mma16816(part, pl0[0], ph0[0], pl0[1], ph0[1], lo2(xv.x, xv.y), hi2(xv.x, xv.y));
        mma16816(part, pl1[0], ph1[0], pl1[1], ph1[1], lo2(xv.z, xv.w), hi2(xv.z, xv.w));
      } else if constexpr (OFS) {
        const unsigned vlo = ulo[w] >> 8, vhi = uhi[w] >> 8;
        mma16816(part, nibbles<0x000F000Fu>(ulo[w]), nibbles<0x000F000Fu>(uhi[w]), nibbles<0x000F000Fu>(vlo),
                 nibbles<0x000F000Fu>(vhi), xv.x, xv.y);
        mma16816(part, nibbles<0x00F000F0u>(ulo[w]), nibbles<0x00F000F0u>(uhi[w]), nibbles<0x00F000F0u>(vlo),
                 nibbles<0x00F000F0u>(vhi), xv.z, xv.w);
      } else {
        unsigned plo[4], phi[4];
        q4_pairs(ulo[w], plo);
        q4_pairs(uhi[w], phi);
        mma16816(part, plo[0], phi[0], plo[1], phi[1], lo2(xv.x, xv.z), hi2(xv.x, xv.z));
        mma16816(part, plo[2], phi[2], plo[3], phi[3], lo2(xv.y, xv.w), hi2(xv.y, xv.w));
      }
    }
    acc[0] = fmaf(slo, part[0], acc[0]);  // c0: A row g, x column 2c (column 0 is x: lanes c == 0)
    acc[2] = fmaf(shi, part[2], acc[2]);  // c2: A row g + 8
  }
  if constexpr (KW > 1) {  // the lanes' sums, added in lane order by lane 0's warps
    __shared__ float lane_sum[KW * ROWS];
    if (c == 0) {
      lane_sum[sl * ROWS + r_lo] = acc[0];
      lane_sum[sl * ROWS + r_hi] = acc[2];
    }
    asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
    acc[0] = acc[2] = 0.f;
#pragma unroll
    for (int l = 0; l < KW; ++l) {
      acc[0] += lane_sum[l * ROWS + r_lo];
      acc[2] += lane_sum[l * ROWS + r_hi];
    }
  }
  if constexpr (BITS == 8) {
    acc[0] *= __half2float(sc_lo[0]);
    acc[2] *= __half2float(sc_hi[0]);
  }
  __half* y = reinterpret_cast<__half*>(arena + o_y);
  auto put = [&](int r, float lo, float hi) {  // tile output r from A rows (r_lo, r_hi)'s sums
    if constexpr (GATED) {
      const int j = tile * OUTS + r;
      if (j < outs) y[j] = __float2half_rn(silu(__half2float(__float2half_rn(lo))) * __half2float(__float2half_rn(hi)));
    } else {
      const int n = tile * OUTS + r;
      if (n < outs) y[n] = __float2half_rn(lo);
      if (n + 8 < outs) y[n + 8] = __float2half_rn(hi);
    }
  };
  if (ks_n == 1) {
    if (c == 0 && sl == 0) put(GATED ? r_lo : 16 * rg + g, acc[0], acc[2]);
    return;
  }
  float* ws = reinterpret_cast<float*>(arena + o_ws);  // per item: the sums of the tile's ROWS weight rows
  unsigned* cnt = reinterpret_cast<unsigned*>(arena + o_cnt);
  if (c == 0 && sl == 0) {
    ws[(long long)blockIdx.x * ROWS + r_lo] = acc[0];
    ws[(long long)blockIdx.x * ROWS + r_hi] = acc[2];
  }
  __threadfence();
  asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
  if (threadIdx.x == 0) last = atomicAdd(cnt + tile, 1u) == unsigned(ks_n - 1);
  asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
  if (!last) return;
  __threadfence();
  for (int r = threadIdx.x; r < ROWS; r += 32 * W) {
    float sum = 0.f;
    for (int k = 0; k < ks_n; ++k) sum += __ldcg(ws + ((long long)tile * ks_n + k) * ROWS + r);
    ws[((long long)tile * ks_n) * ROWS + r] = sum;  // the first item's slots, now free: the totals
  }
  asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
  const float* tot = ws + (long long)tile * ks_n * ROWS;
  if constexpr (GATED) {
    for (int r = threadIdx.x; r < OUTS; r += 32 * W) put(r, __ldcg(tot + r), __ldcg(tot + OUTS + r));
  } else {
    for (int r = threadIdx.x; r < OUTS; r += 32 * W) {
      const int n = tile * OUTS + r;
      if (n < outs) y[n] = __float2half_rn(__ldcg(tot + r));
    }
  }
  if (threadIdx.x == 0) cnt[tile] = 0u;
}

}  // namespace

// one kernel per configuration: w4_bulk_<W>_<STAGES>_<B>_<GATED>_<OFS>_<COPY>_<BITS>_<KW>_<CHUNK> (B: the launch
// bound's blocks per SM)
#define W4_BULK_LAB(W, ST, B, GATED, OFS, COPY, BITS, KW, CHUNK)                                               \
  extern "C" __global__ void __launch_bounds__(32 * W + 32, B)                                                  \
      w4_bulk_##W##_##ST##_##B##_##GATED##_##OFS##_##COPY##_##BITS##_##KW##_##CHUNK(                            \
          unsigned char* arena, long long o_tw, long long o_scale, long long o_x, long long o_y, long long o_ws,  \
          long long o_cnt, long long N, long long K, long long ks_n) {                                          \
    w4_bulk<W, ST, GATED, OFS, COPY, BITS, KW, CHUNK>(arena, o_tw, o_scale, o_x, o_y, o_ws, o_cnt, N, K, ks_n); \
  }
