// Lab (examples/wgmma_lab.py): the decode projection y[M, N] = x[M, K] @ w[N, K]^T for M <= 32 rows as
// the peer's sm90 kernels do it (cuBLAS's nvjet_sm90_hsh_*x32_64xS kernels, examples/peer_gemm_lab.py):
// the copy engine brings each k step's tiles into a ring of shared-memory stages (cp.async.bulk.tensor,
// 128-byte swizzle, completing on an mbarrier), and warpgroups multiply them where they lie (wgmma, sm_90a):
// no thread holds weight bytes in registers, so the bytes in flight per SM are STAGES stages, not
// registers x warps (the bound of linear.cu's MMA decode, docs/perf.md v25-v29). codegen/linear_tma.cu is the
// compiler's version of this body (with the paired layouts and the View epilogues); this file stays as it was
// measured (perf.md v30), so its numbers can be reproduced.
//
// Block: NC consumer warpgroups (warps 0 .. 4 NC - 1), then one producer warp whose lane 0 issues the
// copies. A block's tile is BN = 64 * CH * NC features; consumer warpgroup q multiplies features
// 64 CH q .. 64 CH (q + 1) - 1 as CH chains of m64n32k16 (x rows are wgmma's N = 32; rows >= M are read
// from whatever follows x and never stored: an output column depends on its own x row only). K steps of 64 (one 128-byte swizzle row per feature). An item is
// (tile, ks): the K split's run ks of ks_n; with ks_n > 1 each item writes float32 partial sums to ws and the
// tile's last item to finish adds them in run order (deterministic) and stores y.
// Arena layout (offsets are arguments): two CUtensorMaps (w: dims {K, N}, box {64, BN}; x: dims {K, 32},
// box {64, 32}; both float16, 128-byte swizzle), y [M, N] float16, ws, counters (zero, left zero).
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void bar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void bar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// box at (c0 along K, c1 along rows) of the tensor map at tmap (global memory) into dst, completing on bar
__device__ __forceinline__ void tma_load(void* dst, const void* tmap, uint64_t* bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(smem_u32(dst)), "l"(tmap), "r"(smem_u32(bar)), "r"(c0), "r"(c1)
      : "memory");
}

// wgmma shared-memory descriptor of a K-major tile with 128-byte rows in the 128-byte swizzle (the layout
// the copy engine writes): start >> 4, leading offset 16 B (unused here), 8-row groups 1024 B apart
__device__ __forceinline__ uint64_t desc_sw128(unsigned addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(16 >> 4) << 16) | (uint64_t(1024 >> 4) << 32) |
         (uint64_t(1) << 62);
}

// d[64 features x 32 rows] += A[64 x 16] * B[16 x 32]: A rows are features, B's columns x rows (both K-major)
__device__ __forceinline__ void wgmma_n32(float (&d)[16], uint64_t da, uint64_t db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db));
}

constexpr int BK = 64;                  // k per stage: one 128-byte swizzle row per feature / x row
constexpr int XROWS = 32;               // wgmma N
constexpr int X_STAGE = XROWS * BK * 2;  // bytes of x per stage

template <int NC, int CH, int STAGES>
__device__ __forceinline__ void wgmma_decode(unsigned char* arena, long long o_tw, long long o_tx, long long o_y,
                                             long long o_ws, long long o_cnt, long long M, long long N,
                                             long long K, long long ks_n) {
  constexpr int BN = 64 * CH * NC;
  constexpr int W_STAGE = BN * BK * 2;
  extern __shared__ unsigned char dyn[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  __shared__ int last;
  unsigned char* sm = dyn + ((1024 - (smem_u32(dyn) & 1023)) & 1023);  // 1024-aligned: the swizzle atoms
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const void* tw = arena + o_tw;
  const void* tx = arena + o_tx;
  const long long tile = blockIdx.x / ks_n, ks = blockIdx.x % ks_n;
  const long long steps = K / BK, run = (steps + ks_n - 1) / ks_n;
  const long long s0 = ks * run, s1 = s0 + run < steps ? s0 + run : steps;
  const int iters = int(s1 - s0);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], 4 * NC);  // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == 4 * NC) {  // producer
    if (lane == 0) {
      for (int it = 0; it < iters; ++it) {
        const int s = it % STAGES;
        bar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
        bar_expect(&full[s], W_STAGE + X_STAGE);
        const int k0 = int((s0 + it) * BK);
        tma_load(sm + s * W_STAGE, tw, &full[s], k0, int(tile * BN));
        tma_load(sm + STAGES * W_STAGE + s * X_STAGE, tx, &full[s], k0, 0);
      }
    }
    return;
  }
  const int q = warp >> 2, t = threadIdx.x & 127;
  float acc[CH][16];
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int r = 0; r < 16; ++r) acc[c][r] = 0.f;
  const unsigned w_base = smem_u32(sm) + unsigned(q * CH * 64 * 128);
  const unsigned x_base = smem_u32(sm + STAGES * W_STAGE);
  for (int it = 0; it < iters; ++it) {
    const int s = it % STAGES;
    bar_wait(&full[s], (it / STAGES) & 1);
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint64_t db = desc_sw128(x_base + s * X_STAGE + kk * 32);
#pragma unroll
      for (int c = 0; c < CH; ++c) wgmma_n32(acc[c], desc_sw128(w_base + s * W_STAGE + c * 8192 + kk * 32), db);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
    if (lane == 0) bar_arrive(&empty[s]);
  }
  // accumulator r of chain c: feature 16 (warp % 4) + g (+ 8 for r % 4 >= 2), x row 8 (r / 4) + 2 (lane % 4)
  // (+ 1 for odd r)
  const int g = lane >> 2, cc = lane & 3;
  const long long f0 = tile * BN + q * CH * 64 + 16 * (warp & 3) + g;
  __half* y = reinterpret_cast<__half*>(arena + o_y);
  auto store = [&](int c, int r, float v) {
    const long long n = f0 + 64 * c + ((r & 2) ? 8 : 0), m = 8 * (r >> 2) + 2 * cc + (r & 1);
    if (m < M && n < N) y[m * N + n] = __float2half_rn(v);
  };
  if (ks_n == 1) {
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int r = 0; r < 16; ++r) store(c, r, acc[c][r]);
    return;
  }
  constexpr int SLOTS = NC * CH * 16 * 128;  // one item's partial sums, [q][c][r][t]
  float* ws = reinterpret_cast<float*>(arena + o_ws);
  unsigned* cnt = reinterpret_cast<unsigned*>(arena + o_cnt);
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int r = 0; r < 16; ++r) ws[blockIdx.x * (long long)SLOTS + ((q * CH + c) * 16 + r) * 128 + t] = acc[c][r];
  __threadfence();
  asm volatile("bar.sync 1, %0;" ::"n"(128 * NC) : "memory");
  if (threadIdx.x == 0) last = atomicAdd(cnt + tile, 1u) == unsigned(ks_n - 1);
  asm volatile("bar.sync 1, %0;" ::"n"(128 * NC) : "memory");
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      float sum = 0.f;
      for (long long k = 0; k < ks_n; ++k) sum += __ldcg(ws + (tile * ks_n + k) * SLOTS + ((q * CH + c) * 16 + r) * 128 + t);
      store(c, r, sum);
    }
  if (threadIdx.x == 0) cnt[tile] = 0u;
}

}  // namespace

// one kernel per configuration: wgmma_lab_<NC>_<CH>_<STAGES> (examples/wgmma_lab.py CONFIGS)
#define WGMMA_LAB(NC, CH, ST)                                                                                   \
  extern "C" __global__ void __launch_bounds__(128 * NC + 32, 1)                                               \
      wgmma_lab_##NC##_##CH##_##ST(unsigned char* arena, long long o_tw, long long o_tx, long long o_y,       \
                                   long long o_ws, long long o_cnt, long long M, long long N, long long K,    \
                                   long long ks_n) {                                                          \
    wgmma_decode<NC, CH, ST>(arena, o_tw, o_tx, o_y, o_ws, o_cnt, M, N, K, ks_n);                              \
  }
