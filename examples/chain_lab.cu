// Lab (examples/chain_lab.py): a chain of batch-1 int4 g128 projections, a Llama layer's QKV -> o -> gate/up ->
// down repeated for L layers, run by ONE persistent kernel whose producer warp streams the weights of the next
// projection while the consumers still multiply the current one, against the same kernel launched once per
// projection.
// Why: in the 8B int4 decode step each projection is its own kernel, and every boundary lets DRAM idle: the last
// blocks' tail, the wait for the previous kernel, x staged, the first weights' latency. Programmatic launch hid
// little of it (docs/perf.md v46: the int4 step ran 1% faster with plain graphs), and the copy-engine kernels'
// early copies gained nothing (v46), because the next kernel's blocks hold no shared memory until the previous
// kernel's blocks leave. Here the ring of shared-memory stages simply flows on into the next projection: weights
// are constants, so only the consumers wait at a projection boundary (a grid-wide barrier on a counter), while
// the copies stay in flight.
//
// Weights in a layout made for this: each projection [N, K] in chunks of ROWS = 16 W rows x 128 k (one g128 group),
// chunk (tile, group) at ((tile * K / 128) + group) * CHUNK bytes: the ROWS rows' 64 packed bytes each (low nibble
// = even k, value + 8), then their ROWS float16 scales. A stage is one chunk, one 1-D bulk copy.
// Block: W consumer warps (warp w multiplies rows 16 w .. 16 w + 15 of each chunk, as w4_bulk_lab.cu's plain
// non-OFS form: dequantized nibbles times x in mma.sync m16n8k16, each stage's chain from zero times the rows'
// group scale into float32), then one producer warp whose lane 0 issues the copies. Grid: one block per SM, all
// resident (the barrier needs every block running). A projection's items (tile, group), tile-major, are split
// into gridDim.x contiguous ranges of equal length; a block adds its sums of each tile it touched into the
// projection's float32 output with atomics. So each output must be zero before its projection: phase p zeroes
// phase p + 2's output (two barriers before anyone adds to it; WRAP: phases P - 2, P - 1 zero phases 0, 1 for the
// next launch).
// A phase's x: its input (float32, K values; gated: y = silu(in[j]) * in[K + j], the SwiGLU of gate/up's output)
// rounded to float16 into shared memory in the order the lanes read it (w4_bulk_lab.cu's staging), only for the
// groups of 128 k that the block's items use.
// Modes (arguments): phases [p_begin, p_end) of the table; one launch per phase with p_end = p_begin + 1 is the
// per-kernel baseline. ATTN_HOLD (chain_lab.py --attn-hold): the producer starts the copies of the phase after
// attention (o) only once its block's consumers are done with their attention item, so that the attention's
// latency-bound loads do not queue behind the ring's copies (v49 run 1: ~11 us a layer with them streaming).
// ATTN_PREFETCH (--attn-prefetch): a block with an attention item asks L2 for its run's cached keys and values
// (the rows before the new one: no earlier phase writes them) at the phase's start, before it waits for QKV.
// HOLD: the producer starts a phase's copies only after the consumers passed its barrier
// (the persistent kernel without the cross-phase stream). COPY: the consumers only wait for each stage and release
// it (no math, no sums; the barriers and the staging as before): what the pipeline streams without the math.
// ILP2: each stage's 8 MMAs as two chains of 4 (two accumulator sets added at the end), so a warp's stage takes
// half the MMA latency. OFS: quant.cu's offset dequantization (w4_bulk_lab.cu's OFS form): the A operands are the
// LOP3 pairs as they come (1024 + n for an even k, 1024 + 16 n for an odd one), x is staged as (x0, x4) (x2, x6)
// (x1/16, x5/16) (x3/16, x7/16) per word, and each stage's chain starts at -(1032 S_e + 72 S_o) (S_e the sum of the
// group's staged even x, S_o 16 times that of its staged odd x / 16): 5 instructions per 8 weights instead of 9,
// and no byte permutes of x. A8: W4A8 on the int8 tensor cores (act_int8.cu linear_w4a8_mma's fragments): x
// quantized to int8 at staging with a scale per group of 128 k (max |x| / 127, so a group needs no other), the
// codes as unsigned bytes (u & 0x0F0F0F0F, (u >> 4) & 0x0F0F0F0F) times x_q in mma.sync m16n8k32 u8 x s8, exact in
// int32; the codes' offset 8 through the group's sum of x_q; one float FMA per stage with the weight scale times
// x's: 4 MMAs a stage instead of 8 and 3 instructions per 8 weights. o_times (0: none): per block and phase,
// globaltimer ns of the consumers' thread 0 at the phase's start (its previous items done), after the barrier
// (FLAGS: after the wait for its input tiles), after the staging, after its items, and of the producer at its first
// and last copy of the phase: 6 u64 at ((block * P) + p) * 6.
// INFLIGHT D (a launch argument, 0: off): the producer starts copy `it` only once copy it - D has landed, so at
// most D copies are in flight while the ring can still hold S landed stages. Why: with every stage in flight
// (132 blocks x S x ~17 KB, 18-25 MB) the memory system's queues hold ~6 us of traffic, and every other access
// waits behind it: the barrier's atomics and polls (4.7-9.4 us per barrier in copy mode, v48) and x's staging.
// NORM (a phase flag, chain_lab.py --norm: QKV and gate/up): the layer's residual stream. The phase's input (o's or
// down's output, zeros for the first QKV) is added to hin (the stream before it: x0, or the h of phase p - 2) over
// all of K; each block stores its slice of that h at hout (phase p + 2 reads it after two barriers, or after every
// block's signals of phase p + 1 in FLAGS, which follow its store) and stages h / rms(h) for its groups. So such a
// phase needs all of its input: FLAGS waits for every tile of phase p - 1.
// ATTN (a phase with attn = 1, chain_lab.py --attn: between QKV and o): decode attention split over the grid, a
// block per (KV head, run of keys) writing a partial (attend_run); MERGE: o's staging weighs the runs of its groups'
// heads. FLAGS: a counter per KV head counts its runs; o waits for its heads' counters.
// STREAM (with COPY): no barrier and no staging either: the ring's copies and their waits alone, the pipeline's
// own rate over the chain's bytes.
// FLAGS (first run on a GPU in v48): no grid barrier. A block adds one to each output tile's counter once its sums of
// the tile are in (the tile's contributing blocks are known from the static split); a block of the next projection
// waits only for the tiles its groups of x come from (count = launch number x contributors: the counters only grow,
// and the launch number, o_bar word 96, goes up when a launch's last block ends). Outputs alternate between two
// buffers by the launch number's parity; a launch zeroes the other buffers for the next one, since with no barrier
// no phase knows when the others are done with a buffer of its own launch. A FLAGS launch must run every phase
// (p_begin 0, p_end P: chain_lab.py launches it so), and each phase must give every block an item (contributors
// counts every block between a tile's first and last owners: chain_lab.py refuses configurations without).
// Compiled after examples/lab_bulk.cuh (chain_lab.py prepends it): the mbarrier, MMA and dequantization helpers.
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

constexpr int INTER_MAX = 14336;  // the widest K of a phase (chain_lab.py INTER)
// NORM: h (float32, K = 4096) in the x area past the staged x (4096 halves at most for a NORM phase): 8 KB + 16 KB of
// the area's 2 x INTER_MAX bytes
constexpr int H_SMEM = 8192;
static_assert(H_SMEM + 4 * 4096 <= 2 * INTER_MAX, "h fits the x area");

struct Phase {        // 80 bytes, chain_lab.py PHASE_DTYPE
  long long w;        // byte offset of the weight chunks
  long long in;       // byte offset of the float32 input
  long long out;      // byte offset of the float32 output (N values)
  int K, N, gated, norm;
  long long out2;     // FLAGS: the output of odd launches (out: even ones)
  long long ready;    // FLAGS: byte offset of the output's tile counters (N / ROWS u32, they only grow)
  long long hin;      // NORM: the residual stream before this phase's input is added (K floats)
  long long hout;     // NORM: the residual stream after (K floats; each block writes its slice)
  int attn, ctx;      // ATTN: a decode attention phase over ctx keys (hin / hout: the K / V cache, float16)
};

// FLAGS: the block owning item i of a projection of n items split into G contiguous runs (n * b / G ..)
__device__ __forceinline__ long long owner(long long i, long long n, long long G) {
  return ((i + 1) * G + n - 1) / n - 1;
}

__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// every block of the grid: one thread of each arrives; returns when all have. bar[0] counts arrivals, bar[GEN] is
// the generation (read before arriving, so the last arrival's increment is the one waited for), on its own
// 128-byte line so that the spinning reads do not queue behind the arrivals' atomics; bar[0] returns to 0, so the
// barrier needs no reset between launches.
constexpr int GEN = 32;
__device__ __forceinline__ void grid_sync(unsigned* bar, unsigned blocks) {
  const unsigned gen = ld_acquire(bar + GEN);
  __threadfence();
  if (atomicAdd(bar, 1u) == blocks - 1) {
    atomicExch(bar, 0u);
    __threadfence();
    atomicAdd(bar + GEN, 1u);
  } else {
    const unsigned long long t0 = now_ns();
    for (unsigned tries = 1; ld_acquire(bar + GEN) == gen; ++tries) {
      if ((tries & 1023u) == 0u && now_ns() - t0 > 2000000000ull) __trap();
    }
  }
  __threadfence();
}

// the same barrier in fewer round trips: bar[COUNT] only grows (a block's arrival returns its place, and the
// barrier it belongs to ends at the next multiple of blocks), so nobody resets it and the waiters poll the count
// itself, with relaxed loads (no fence per poll; the fence after the loop orders what follows). (Wraps after
// 2^32 / blocks barriers: ~32 million on 132 blocks, far beyond a lab run.)
constexpr int COUNT = 64;
constexpr int EPOCH = 96, DONE = 100;  // FLAGS: the launch number and the count of blocks that ended it
constexpr int LEAN = 128;              // LEAN: the arrivals' count, on a line of its own
__device__ __forceinline__ void grid_sync_count(unsigned* bar, unsigned blocks) {
  __threadfence();
  const unsigned target = (atomicAdd(bar + COUNT, 1u) / blocks + 1) * blocks;
  const unsigned long long t0 = now_ns();
  for (unsigned tries = 1; int(ld_relaxed(bar + COUNT) - target) < 0; ++tries) {
    if ((tries & 1023u) == 0u && now_ns() - t0 > 2000000000ull) __trap();
  }
  __threadfence();
}

// LEAN: the fewest round trips to L2 on the last arrival's path. The count only grows and each block knows the
// count that ends its k-th barrier of the launch (base + k * blocks, base read at the start: no block can pass the
// first barrier before every block has arrived, so the count then is base + fewer than blocks; this needs every
// launch on the count to use the same grid, as chain_lab.py's do, and the count zeroed with it), so the arrival is a
// red (no value back) whose release orders the block's writes (after the block's bar.sync, cumulative: the
// cooperative-groups grid barrier's pattern, with no fence by every thread), and the polls are acquire loads.
__device__ __forceinline__ void grid_sync_lean(unsigned* count, unsigned target) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(count) : "memory");
  const unsigned long long t0 = now_ns();
  for (unsigned tries = 1; int(ld_acquire(count) - target) < 0; ++tries) {
    if ((tries & 1023u) == 0u && now_ns() - t0 > 2000000000ull) __trap();
  }
}

__device__ __forceinline__ unsigned h2bits(float a, float b) {
  const __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<const unsigned*>(&h);
}
// d += A * B for one m16n8k32 tile, A unsigned bytes (int4 codes 0..15), B signed bytes (x_q), int32
__device__ __forceinline__ void mma_u8s8(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, int b0,
                                         int b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <int W> __device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
}

// ATTN: Llama-3-8B's GQA decode attention, split over the grid: item (h, r) of KV_HEADS x R, run r of the ctx keys
// (runs of L = ceil(ctx / R), some possibly empty) for KV head h, by one block's W consumer warps: the 4 query heads
// 4h .. 4h + 3 (qkv[512 h ..], float32) over the run's keys of the float16 caches [KV_HEADS, ctx, 128]; the run
// holding key ctx - 1 first writes the new key and value (qkv[4096 + 128 h ..], qkv[5120 + 128 h ..]) there. The
// partial at part + (h R + r) * PART: for head i, the unnormalized sum of exp(s - m_i) v (128 floats at 128 i),
// m_i (at 512 + i) and the total of exp(s - m_i) (at 516 + i), s = q k / sqrt(128); an empty run: m = -inf, 0s.
// The o phase's staging merges the runs (chain_lab.py merge_partials). sm: 4 x 128 q, 4 x 128 sums, 4 x L scores.
constexpr int KV_HEADS = 8, ATTN_CTX_MAX = 1024, PART = 520, RUNS_MAX = 32;
static_assert(4 * (1024 + 4 * ATTN_CTX_MAX) <= 2 * INTER_MAX, "attend_run's q, sums and scores fit the x area");
static_assert(H_SMEM + 4 * 32 * RUNS_MAX <= 2 * INTER_MAX, "MERGE's weights fit the x area past the staged x");

// a warp's BATCH rows of a cache (rows j_lo + u0 + u W, u < BATCH, those below n of the run), lane d4's 4 halves of
// each, the loads issued together (zeros past the run)
template <int BATCH, int W>
__device__ __forceinline__ void load_keys(uint2 (&w)[BATCH], const __half* rows, int j_lo, int u0, int n, int lane) {
#pragma unroll
  for (int u = 0; u < BATCH; ++u) {
    const int j = j_lo + u0 + u * W;
    w[u] = u0 + u * W < n ? __ldcg(reinterpret_cast<const uint2*>(rows + (long long)j * 128) + lane)
                          : make_uint2(0u, 0u);
  }
}
template <int W>
__device__ __forceinline__ void attend_run(const float* qkv, __half* kc, __half* vc, int ctx, int h, int r, int R,
                                           float* sm, float* part) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int L = (ctx + R - 1) / R, j_lo = r * L, j_hi = min(ctx, j_lo + L), n = max(0, j_hi - j_lo);
  float* qs = sm;
  float* os = sm + 512;
  float* sc = sm + 1024;
  float* out = part + (long long)(h * R + r) * PART;
  kc += (long long)h * ctx * 128;
  vc += (long long)h * ctx * 128;
  for (int i = threadIdx.x; i < 512; i += 32 * W) {
    qs[i] = __ldcg(qkv + 512 * h + i) * 0.08838834764831845f;  // 1 / sqrt(128)
    os[i] = 0.f;
  }
  if (ctx - 1 >= j_lo && ctx - 1 < j_hi) {
    for (int i = threadIdx.x; i < 128; i += 32 * W) {
      kc[(ctx - 1) * 128 + i] = __float2half_rn(__ldcg(qkv + 4096 + 128 * h + i));
      vc[(ctx - 1) * 128 + i] = __float2half_rn(__ldcg(qkv + 5120 + 128 * h + i));
    }
  }
  consumers_sync<W>();
  // a warp per key, BATCH keys' loads issued together (one at a time, each waited for, took 22 us at 256 keys with
  // a block per KV head, v48 run 8): lane d4 holds k[4 d4 .. 4 d4 + 3]
  constexpr int BATCH = 8;
  for (int u0 = warp; u0 < n; u0 += BATCH * W) {
    uint2 kw[BATCH];
    load_keys<BATCH, W>(kw, kc, j_lo, u0, n, lane);
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int jj = u0 + u * W;  // warp-uniform
      if (jj >= n) break;
      const float2 k01 = __half22float2(*reinterpret_cast<const __half2*>(&kw[u].x));
      const float2 k23 = __half22float2(*reinterpret_cast<const __half2*>(&kw[u].y));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 q = reinterpret_cast<const float4*>(qs + 128 * i)[lane];
        float s = q.x * k01.x + q.y * k01.y + q.z * k23.x + q.w * k23.y;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
        if (lane == 0) sc[i * L + jj] = s;
      }
    }
  }
  consumers_sync<W>();
  for (int i = warp; i < 4; i += W) {  // head i's exp(s - m) in place, m and their total into the partial
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, sc[i * L + j]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float total = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float e = __expf(sc[i * L + j] - m);
      sc[i * L + j] = e;
      total += e;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
    if (lane == 0) {
      out[512 + i] = m;
      out[516 + i] = total;
    }
  }
  consumers_sync<W>();
  float acc[4][4] = {};
  for (int u0 = warp; u0 < n; u0 += BATCH * W) {
    uint2 vw[BATCH];
    load_keys<BATCH, W>(vw, vc, j_lo, u0, n, lane);
#pragma unroll
    for (int u = 0; u < BATCH; ++u) {
      const int jj = u0 + u * W;
      if (jj >= n) break;
      const float2 v01 = __half22float2(*reinterpret_cast<const __half2*>(&vw[u].x));
      const float2 v23 = __half22float2(*reinterpret_cast<const __half2*>(&vw[u].y));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float w = sc[i * L + jj];
        acc[i][0] = fmaf(w, v01.x, acc[i][0]);
        acc[i][1] = fmaf(w, v01.y, acc[i][1]);
        acc[i][2] = fmaf(w, v23.x, acc[i][2]);
        acc[i][3] = fmaf(w, v23.y, acc[i][3]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int d = 0; d < 4; ++d) atomicAdd(os + 128 * i + 4 * lane + d, acc[i][d]);
  consumers_sync<W>();
  for (int i = threadIdx.x; i < 512; i += 32 * W) out[i] = os[i];
}

template <int W, int STAGES, bool ILP2, bool OFS, bool A8>
__device__ __forceinline__ void chain(unsigned char* arena, long long o_phases, int P, int p_begin, int p_end,
                                      long long o_bar, bool wrap, int hold, bool copy, long long o_times,
                                      int barrier, bool flags, int inflight, bool stream) {
  constexpr int ROWS = 16 * W, WBYTES = ROWS * 64, CHUNK = WBYTES + ROWS * 2;
  static_assert(CHUNK % 16 == 0, "bulk copies move multiples of 16 bytes");
  extern __shared__ unsigned char dyn_raw[];
  unsigned char* ring = dyn_raw + ((128 - (smem_u32(dyn_raw) & 127)) & 127);
  unsigned char* xs = ring + STAGES * CHUNK;  // the phase's x: K halves in lane order
  __shared__ float corr[INTER_MAX / 128];        // OFS: each group's chain start (negated); A8: x's group scale
  __shared__ int qsum[INTER_MAX / 128];          // A8: each group's sum of x_q
  static_assert(!(OFS && A8), "one dequantization");
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  __shared__ volatile int go_phase;  // HOLD: the last phase whose barrier the consumers passed
  __shared__ unsigned launch_no;     // FLAGS: this launch's number
  __shared__ unsigned lean_base;     // LEAN: the count before this launch's first barrier
  if (inflight >= STAGES) inflight = 0;  // INFLIGHT's parity holds only below STAGES (chain_lab.py refuses more)
  stream = stream && copy;               // STREAM skips the staging: only without math
  const Phase* phases = reinterpret_cast<const Phase*>(arena + o_phases);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const long long G = gridDim.x, b = blockIdx.x;
  unsigned long long* times = o_times ? reinterpret_cast<unsigned long long*>(arena + o_times) : nullptr;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], W);  // lane 0 of each consumer warp
    }
    go_phase = p_begin;
    if (flags) launch_no = ld_relaxed(reinterpret_cast<const unsigned*>(arena + o_bar) + EPOCH);
    const unsigned c0 = ld_relaxed(reinterpret_cast<const unsigned*>(arena + o_bar) + LEAN);
    lean_base = c0 - c0 % gridDim.x;
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == W) {  // producer
    if (lane == 0) {
      unsigned it = 0;
      for (int p = p_begin; p < p_end; ++p) {
        // HOLD 1: every phase's copies wait for its barrier; 2 (ATTN_HOLD): only the phase after attention's, until
        // this block's consumers are done with their attention item
        if ((hold & 1) || ((hold & 2) && p > p_begin && phases[p - 1].attn)) {
          const unsigned long long t0 = now_ns();
          while (go_phase < p) {
            if (now_ns() - t0 > 2000000000ull) __trap();
          }
        }
        const Phase ph = phases[p];
        const long long n = (long long)(ph.N / ROWS) * (ph.K / 128);
        const unsigned char* w = arena + ph.w;
        const long long i0 = n * b / G, i1 = n * (b + 1) / G;
        for (long long i = i0; i < i1; ++i, ++it) {
          const int s = int(it % STAGES);
          if (inflight > 0 && it >= unsigned(inflight)) {  // INFLIGHT: copy it - D has landed before copy it starts
            const unsigned back = it - unsigned(inflight);
            bar_wait(&full[back % STAGES], (back / STAGES) & 1u);
          }
          bar_wait(&empty[s], ((it / STAGES) & 1u) ^ 1u);
          bar_expect(&full[s], CHUNK);
          bulk_load(ring + s * CHUNK, w + i * CHUNK, CHUNK, &full[s]);
          if (times && (i == i0 || i == i1 - 1)) times[(b * P + p) * 6 + (i == i0 ? 4 : 5)] = now_ns();
        }
      }
    }
    return;
  }
  unsigned* gbar = reinterpret_cast<unsigned*>(arena + o_bar);
  const int g = lane >> 2, c = lane & 3;
  const int r_lo = 16 * warp + g, r_hi = r_lo + 8;
  unsigned it = 0, barriers = 0;
  for (int p = p_begin; p < p_end; ++p) {
    const Phase ph = phases[p];
    unsigned long long* tp = times && threadIdx.x == 0 ? times + (b * P + p) * 6 : nullptr;
    if (tp) tp[0] = now_ns();
    const bool odd = flags && (launch_no & 1u);
    const long long out_off = odd ? ph.out2 : ph.out;
    if ((hold & 4) && ph.attn && threadIdx.x == 0) {  // ATTN_PREFETCH: the run's cached keys and values toward L2
      const int R = min(int(G) / KV_HEADS, RUNS_MAX);
      const int L = R > 0 ? (ph.ctx + R - 1) / R : 0;
      const int j_lo = int(b / KV_HEADS) * L, j_hi = min(ph.ctx - 1, j_lo + L);  // the rows before the new one
      if (b < KV_HEADS * R && j_hi > j_lo) {
        const long long row0 = (long long)(b % KV_HEADS) * ph.ctx + j_lo;  // [KV_HEADS, ctx, 128] halves
        const unsigned bytes = unsigned(j_hi - j_lo) * 256u;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(arena + ph.hin + row0 * 256), "r"(bytes)
                     : "memory");
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(arena + ph.hout + row0 * 256), "r"(bytes)
                     : "memory");
      }
    }
    if (p != p_begin && !flags && !stream) {  // every block's sums of phase p - 1 are in before anyone reads them
      if (barrier != 2) __threadfence();
      consumers_sync<W>();
      if (threadIdx.x == 0) {
        if (barrier == 2) grid_sync_lean(gbar + LEAN, lean_base + ++barriers * unsigned(G));
        else if (barrier == 1) grid_sync_count(gbar, unsigned(G));
        else grid_sync(gbar, unsigned(G));
        go_phase = p;
      }
      consumers_sync<W>();
    }
    if (tp && !flags) tp[1] = now_ns();
    if (flags) {  // the other parity's output of this phase, zero for the next launch
      float* zo = reinterpret_cast<float*>(arena + (odd ? ph.out : ph.out2));
      for (long long j = b * 32 * W + threadIdx.x; j < ph.N; j += G * 32 * W) zo[j] = 0.f;
    } else if (p + 2 < P || wrap) {  // phase p + 2's output: not touched until two barriers from now
      const Phase z = phases[(p + 2) % P];
      float* zo = reinterpret_cast<float*>(arena + z.out);
      for (long long j = b * 32 * W + threadIdx.x; j < z.N; j += G * 32 * W) zo[j] = 0.f;
    }
    const int K = ph.K, groups = K / 128;
    const long long n = (long long)(ph.N / ROWS) * groups, i0 = n * b / G, i1 = n * (b + 1) / G;
    // x of the groups the block's items use: those of items i0 .. i1 - 1 (one run of groups, cyclic; all of them
    // when the run is as long as a row)
    const int staged = int(i1 - i0 < groups ? i1 - i0 : groups);
    const float* in = reinterpret_cast<const float*>(arena + ph.in);
    // FLAGS: wait for the tiles of phase p - 1 that hold this block's groups of x (and their up half); NORM and
    // ATTN: for all (ATTN: only the blocks with an item); after ATTN a counter is a KV head's, counting its runs
    const int runs = min(int(G) / KV_HEADS, RUNS_MAX);  // ATTN: each KV head's keys in this many runs, a block each
    if (flags && p > 0 && !(ph.attn && b >= KV_HEADS * runs)) {
      const Phase q = phases[p - 1];
      in = reinterpret_cast<const float*>(arena + (odd ? q.out2 : q.out));
      const unsigned* ready = reinterpret_cast<const unsigned*>(arena + q.ready);
      const long long nq = (long long)(q.N / ROWS) * (q.K / 128), gq = q.K / 128;
      const bool all = ph.norm || ph.attn;
      for (int j = threadIdx.x; j < (ph.attn ? q.N / 128 : ph.norm ? groups : staged * (ph.gated ? 2 : 1));
           j += 32 * W) {
        const int k = all ? j * 128 : int((i0 + j % staged) % groups) * 128 + (j >= staged ? K : 0);
        const int per = q.attn ? 4 * 128 : ROWS;  // outputs a counter stands for
        for (long long t = k / per; t <= (k + 127) / per; ++t) {  // in[k .. k + 127]: several tiles if ROWS < 128
          const unsigned want = q.attn ? (launch_no + 1u) * unsigned(runs)
              : (launch_no + 1u) * unsigned(owner((t + 1) * gq - 1, nq, G) - owner(t * gq, nq, G) + 1);
          const unsigned long long t0 = now_ns();
          for (unsigned tries = 1; int((barrier == 2 ? ld_acquire(ready + t) : ld_relaxed(ready + t)) - want) < 0;
               ++tries) {
            if ((tries & 1023u) == 0u && now_ns() - t0 > 2000000000ull) __trap();
          }
        }
      }
      if (barrier != 2) __threadfence();  // LEAN: the acquire polls, then the block's bar.sync
      consumers_sync<W>();
      if (tp) tp[1] = now_ns();  // the trace's "barrier wait": here, the wait for the input tiles
    }
    if (ph.attn) {  // ATTN: block b < KV_HEADS x runs attends for item (b % KV_HEADS, b / KV_HEADS); the others go on
      if (tp && flags && b >= KV_HEADS * runs) tp[1] = now_ns();  // they skipped the wait
      if (tp) tp[2] = now_ns();
      if (b < KV_HEADS * runs && !stream) {
        attend_run<W>(in, reinterpret_cast<__half*>(arena + ph.hin), reinterpret_cast<__half*>(arena + ph.hout),
                      ph.ctx, int(b % KV_HEADS), int(b / KV_HEADS), runs, reinterpret_cast<float*>(xs),
                      reinterpret_cast<float*>(arena + out_off));
        if (flags) {
          consumers_sync<W>();
          if (threadIdx.x == 0) {
            unsigned* ready = reinterpret_cast<unsigned*>(arena + ph.ready) + b % KV_HEADS;
            if (barrier == 2) {
              asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ready) : "memory");
            } else {
              __threadfence();
              atomicAdd(ready, 1u);
            }
          }
        }
      }
      if (tp) tp[3] = now_ns();
      if ((hold & 2) && threadIdx.x == 0) go_phase = p + 1;  // ATTN_HOLD: the producer may stream o's weights now
      continue;
    }
    // NORM: h = hin + in over all of K (the block's slice of it stored), then the staged x are h / rms(h)
    float rinv = 1.f;
    const float* hin = reinterpret_cast<const float*>(arena + ph.hin);
    if (ph.norm && !stream) {
      __shared__ float ss_warp[16];
      float4* hout = reinterpret_cast<float4*>(arena + ph.hout);
      float4* hsm = reinterpret_cast<float4*>(xs + H_SMEM);  // h for the staging below, in shared memory
      const int q0 = int(K / 4 * b / G), q1 = int(K / 4 * (b + 1) / G);  // the block's float4s of h
      float ss = 0.f;
      for (int q = threadIdx.x; q < K / 4; q += 32 * W) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(hin) + q);
        const float4 d = __ldcg(reinterpret_cast<const float4*>(in) + q);
        const float4 h = make_float4(a.x + d.x, a.y + d.y, a.z + d.z, a.w + d.w);
        ss += h.x * h.x + h.y * h.y + h.z * h.z + h.w * h.w;
        if (q >= q0 && q < q1) hout[q] = h;
        hsm[q] = h;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
      if (lane == 0) ss_warp[warp] = ss;
      consumers_sync<W>();
      ss = 0.f;
#pragma unroll
      for (int w = 0; w < W; ++w) ss += ss_warp[w];
      rinv = rsqrtf(ss / float(K) + 1e-5f);
      consumers_sync<W>();  // ss_warp read by all before the next phase's writes
    }
    // MERGE (the phase after ATTN, o): each staged group (a query head) gets its runs' weights exp(m_r - M) / total
    // into shared memory (past the staged x, as NORM's h), a warp per group, a lane per run
    const bool merge = p > 0 && phases[p - 1].attn && !stream;
    float* mw = reinterpret_cast<float*>(xs + H_SMEM);
    if (merge) {
      for (int j = warp; j < staged; j += W) {
        const int gq = int((i0 + j) % groups), h = gq / 4, i = gq % 4;
        const float* pr = in + (long long)(h * runs + lane) * PART;
        const float m = lane < runs ? __ldcg(pr + 512 + i) : -INFINITY;
        const float l = lane < runs ? __ldcg(pr + 516 + i) : 0.f;
        float big = m;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) big = fmaxf(big, __shfl_xor_sync(0xffffffffu, big, off));
        const float e = m == -INFINITY ? 0.f : __expf(m - big);
        float total = e * l;
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
        if (lane < runs) mw[gq * RUNS_MAX + lane] = e / total;
      }
      consumers_sync<W>();
    }
    // word v: k 8 v .. 8 v + 7, at slot 4 w + c of its group (STREAM: no x)
    for (int base = 0; base < (stream ? 0 : staged * 16); base += 32 * W) {
      const int j = base + threadIdx.x;  // uniform trip count: OFS's half-warps (a group each) shuffle
      const int v = int((i0 + j / 16) % groups) * 16 + j % 16;
      float f[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (j < staged * 16 && ph.norm) {  // h from the norm's pass (staged x_v after the consumers_sync there)
        const float4* hsm = reinterpret_cast<const float4*>(xs + H_SMEM);
        const float4 h0 = hsm[2 * v], h1 = hsm[2 * v + 1];
        f[0] = h0.x * rinv, f[1] = h0.y * rinv, f[2] = h0.z * rinv, f[3] = h0.w * rinv;
        f[4] = h1.x * rinv, f[5] = h1.y * rinv, f[6] = h1.z * rinv, f[7] = h1.w * rinv;
      } else if (j < staged * 16 && merge) {  // x = the runs' sums weighted (MERGE)
        const int gq = v / 16, h = gq / 4, d0 = 128 * (gq % 4) + 8 * (v % 16);
#pragma unroll 4
        for (int r = 0; r < runs; ++r) {
          const float w = mw[gq * RUNS_MAX + r];
          const float* pr = in + (long long)(h * runs + r) * PART + d0;
          const float4 a0 = __ldcg(reinterpret_cast<const float4*>(pr));
          const float4 a1 = __ldcg(reinterpret_cast<const float4*>(pr) + 1);
          f[0] = fmaf(w, a0.x, f[0]), f[1] = fmaf(w, a0.y, f[1]), f[2] = fmaf(w, a0.z, f[2]);
          f[3] = fmaf(w, a0.w, f[3]), f[4] = fmaf(w, a1.x, f[4]), f[5] = fmaf(w, a1.y, f[5]);
          f[6] = fmaf(w, a1.z, f[6]), f[7] = fmaf(w, a1.w, f[7]);
        }
      } else if (j < staged * 16) {
        const float4 a0 = __ldcg(reinterpret_cast<const float4*>(in) + 2 * v);
        const float4 a1 = __ldcg(reinterpret_cast<const float4*>(in) + 2 * v + 1);
        f[0] = a0.x, f[1] = a0.y, f[2] = a0.z, f[3] = a0.w, f[4] = a1.x, f[5] = a1.y, f[6] = a1.z, f[7] = a1.w;
        if (ph.gated) {
          const float4 u0 = __ldcg(reinterpret_cast<const float4*>(in + K) + 2 * v);
          const float4 u1 = __ldcg(reinterpret_cast<const float4*>(in + K) + 2 * v + 1);
          const float u[8] = {u0.x, u0.y, u0.z, u0.w, u1.x, u1.y, u1.z, u1.w};
#pragma unroll
          for (int i = 0; i < 8; ++i) f[i] = silu(f[i]) * u[i];
        }
      }
      const int st = v / 16, vv = v % 16, cc = vv / 4, ww = vv % 4;
      if constexpr (A8) {  // the group's 16 words are a half-warp: its max and its sum of x_q by shuffles
        float m = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) m = fmaxf(m, fabsf(f[i]));
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
        const float sx = m > 0.f ? m / 127.f : 1.f;
        int q[8], sum = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          q[i] = max(-127, min(127, __float2int_rn(f[i] / sx)));
          sum += q[i];
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        if (j < staged * 16) {
          if (vv == 0) {
            corr[st] = sx;
            qsum[st] = sum;
          }
          // even k then odd k, 4 bytes each (linear_w4a8_mma's B words), word v at int 2 v
          const int even = (q[0] & 255) | (q[2] & 255) << 8 | (q[4] & 255) << 16 | (q[6] & 255) << 24;
          const int odd = (q[1] & 255) | (q[3] & 255) << 8 | (q[5] & 255) << 16 | (q[7] & 255) << 24;
          *reinterpret_cast<int2*>(xs + 8 * v) = make_int2(even, odd);
        }
        continue;
      }
      uint4 word = make_uint4(h2bits(f[0], f[1]), h2bits(f[2], f[3]), h2bits(f[4], f[5]), h2bits(f[6], f[7]));
      if constexpr (OFS) {
        const unsigned sixteenth = 0x2C002C00u;  // (1/16, 1/16)
        word = make_uint4(lo2(word.x, word.z), lo2(word.y, word.w), hmul2(hi2(word.x, word.z), sixteenth),
                          hmul2(hi2(word.y, word.w), sixteenth));
        float se = half2_sum(word.x) + half2_sum(word.y), so = 16.f * (half2_sum(word.z) + half2_sum(word.w));
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) {
          se += __shfl_xor_sync(0xffffffffu, se, off);
          so += __shfl_xor_sync(0xffffffffu, so, off);
        }
        if (j < staged * 16 && vv == 0) corr[st] = fmaf(1032.f, se, 72.f * so);
      }
      if (j < staged * 16) *reinterpret_cast<uint4*>(xs + (st * 16 + 4 * ww + cc) * 16) = word;
    }
    consumers_sync<W>();
    if (tp) tp[2] = now_ns();
    float* out = reinterpret_cast<float*>(arena + out_off);
    unsigned* ready = reinterpret_cast<unsigned*>(arena + ph.ready);
    auto tile_done = [&](int t) {  // FLAGS: every warp's sums of tile t are in: count this block (the barrier, then
      consumers_sync<W>();        // one cumulative fence before the release, as the grid barriers do)
      if (threadIdx.x == 0) {
        if (barrier == 2) {  // LEAN: the release red (cumulative after the bar.sync)
          asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ready + t) : "memory");
        } else {
          __threadfence();
          atomicAdd(ready + t, 1u);
        }
      }
    };
    float acc0 = 0.f, acc2 = 0.f;
    // the item's (tile, group), stepped along instead of divided per item (a 64-bit division is ~100 instructions)
    int tile = int(i0 / groups), grp = int(i0 % groups);
    for (long long i = i0; i < i1; ++i, ++it, ++grp) {
      if (grp == groups) {  // a new tile: the last one's sums out
        if (c == 0 && !copy) {
          atomicAdd(out + (long long)tile * ROWS + r_lo, acc0);
          atomicAdd(out + (long long)tile * ROWS + r_hi, acc2);
        }
        if (flags) tile_done(tile);
        acc0 = acc2 = 0.f;
        grp = 0;
        ++tile;
      }
      const int s = int(it % STAGES);
      bar_wait(&full[s], (it / STAGES) & 1u);
      if (copy) {
        __syncwarp();
        if (lane == 0) bar_arrive(&empty[s]);
        continue;
      }
      const unsigned char* stage = ring + s * CHUNK;
      const uint4 wlo = *reinterpret_cast<const uint4*>(stage + r_lo * 64 + 16 * c);
      const uint4 whi = *reinterpret_cast<const uint4*>(stage + r_hi * 64 + 16 * c);
      const float slo = __half2float(*reinterpret_cast<const __half*>(stage + WBYTES + 2 * r_lo));
      const float shi = __half2float(*reinterpret_cast<const __half*>(stage + WBYTES + 2 * r_hi));
      __syncwarp();
      if (lane == 0) bar_arrive(&empty[s]);
      const unsigned ulo[4] = {wlo.x, wlo.y, wlo.z, wlo.w}, uhi[4] = {whi.x, whi.y, whi.z, whi.w};
      if constexpr (A8) {
        const int4 xa = *reinterpret_cast<const int4*>(xs + 8 * (grp * 16 + 4 * c));      // words 4c, 4c + 1
        const int4 xb = *reinterpret_cast<const int4*>(xs + 8 * (grp * 16 + 4 * c) + 16);  // words 4c + 2, 4c + 3
        const int xe[4] = {xa.x, xa.z, xb.x, xb.z}, xo[4] = {xa.y, xa.w, xb.y, xb.w};
        int d[2][4] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          int (&e)[4] = d[ILP2 ? (w & 1) : 0];
          mma_u8s8(e, ulo[w] & 0x0F0F0F0Fu, uhi[w] & 0x0F0F0F0Fu, (ulo[w] >> 4) & 0x0F0F0F0Fu,
                   (uhi[w] >> 4) & 0x0F0F0F0Fu, xe[w], xo[w]);
        }
        const float sx = corr[grp];
        const int off = 8 * qsum[grp];  // sum (n - 8) q = sum n q - 8 sum q
        acc0 = fmaf(slo * sx, float(d[0][0] + d[1][0] - off), acc0);
        acc2 = fmaf(shi * sx, float(d[0][2] + d[1][2] - off), acc2);
        continue;
      }
      const float start = OFS ? -corr[grp] : 0.f;  // the same x for both rows: one start
      float part[2][4] = {{start, start, start, start}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xs + (grp * 16 + 4 * w + c) * 16);
        float (&d)[4] = part[ILP2 ? (w & 1) : 0];
        if constexpr (OFS) {
          const unsigned vlo = ulo[w] >> 8, vhi = uhi[w] >> 8;
          mma16816(d, nibbles<0x000F000Fu>(ulo[w]), nibbles<0x000F000Fu>(uhi[w]), nibbles<0x000F000Fu>(vlo),
                   nibbles<0x000F000Fu>(vhi), xv.x, xv.y);
          mma16816(d, nibbles<0x00F000F0u>(ulo[w]), nibbles<0x00F000F0u>(uhi[w]), nibbles<0x00F000F0u>(vlo),
                   nibbles<0x00F000F0u>(vhi), xv.z, xv.w);
        } else {
          unsigned plo[4], phi[4];
          q4_pairs(ulo[w], plo);
          q4_pairs(uhi[w], phi);
          mma16816(d, plo[0], phi[0], plo[1], phi[1], lo2(xv.x, xv.z), hi2(xv.x, xv.z));
          mma16816(d, plo[2], phi[2], plo[3], phi[3], lo2(xv.y, xv.w), hi2(xv.y, xv.w));
        }
      }
      acc0 = fmaf(slo, part[0][0] + part[1][0], acc0);  // c0: A row g, x column 2c (every column is x)
      acc2 = fmaf(shi, part[0][2] + part[1][2], acc2);  // c2: A row g + 8
    }
    if (i1 > i0 && c == 0 && !copy) {
      atomicAdd(out + (long long)tile * ROWS + r_lo, acc0);
      atomicAdd(out + (long long)tile * ROWS + r_hi, acc2);
    }
    if (flags && i1 > i0) tile_done(tile);
    if (tp) tp[3] = now_ns();
  }
  if (flags && threadIdx.x == 0) {  // the launch's last block to end moves the launch number on
    unsigned* sync = reinterpret_cast<unsigned*>(arena + o_bar);
    __threadfence();
    if (atomicAdd(sync + DONE, 1u) == unsigned(G) - 1u) {
      atomicExch(sync + DONE, 0u);
      __threadfence();
      atomicAdd(sync + EPOCH, 1u);
    }
  }
}

}  // namespace

// chain_<W>_<STAGES>_<ILP2>_<OFS>_<A8>(arena, o_phases, P, p_begin, p_end, o_bar, wrap, hold, copy, o_times,
// barrier, flags, inflight, stream): one block per SM; hold: bits 1 HOLD, 2 ATTN_HOLD, 4 ATTN_PREFETCH; barrier:
// 0 grid_sync, 1 grid_sync_count, 2 LEAN (also the FLAGS mode's signals and polls); flags: FLAGS; inflight:
// INFLIGHT (0: no cap); stream: STREAM (with copy)
#define CHAIN_LAB(W, ST, ILP2, OFS, A8)                                                                         \
  extern "C" __global__ void __launch_bounds__(32 * W + 32, 1) chain_##W##_##ST##_##ILP2##_##OFS##_##A8(       \
      unsigned char* arena, long long o_phases, long long P, long long p_begin, long long p_end, long long o_bar, \
      long long wrap, long long hold, long long copy, long long o_times, long long barrier, long long flags,   \
      long long inflight, long long stream) {                                                                   \
    chain<W, ST, ILP2 != 0, OFS != 0, A8 != 0>(arena, o_phases, int(P), int(p_begin), int(p_end), o_bar, wrap != 0, \
                                      int(hold), copy != 0, o_times, int(barrier), flags != 0, int(inflight),   \
                                      stream != 0);                                                             \
  }
