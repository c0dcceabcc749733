// The decode projection of 9..32 rows on sm_90a (linear_tma.py): y = x @ w^T with the copy engine filling a ring
// of shared-memory stages (cp.async.bulk.tensor, 128-byte swizzle, completing on mbarriers) and warpgroups
// multiplying them where they lie (wgmma m64n32k16, float32 accumulators). No weight byte passes through a
// register, so a block keeps STAGES stages in flight, not what registers x warps hold (linear.cu's MMA decode:
// 64 KB per SM at M = 32). H200 lab (examples/wgmma_lab.py, docs/perf.md v30): 1.05-1.35x faster than the MMA
// decode on the Llama-3-8B shapes at M = 32, at or past cuBLAS on QKV, gate/up and the LM head.
//
// Block: NC consumer warpgroups (warps 0 .. 4 NC - 1) and one producer warp (warp 4 NC) whose lane 0 issues the
// copies; 128 NC + 32 threads. Per 64-k step a stage holds the block's weight rows (128 bytes each) and 32 x rows.
// Weight rows of a block and the chains (64 rows each) consumer warpgroup q multiplies (LAYOUT):
// - TMA_PLAIN: BN = 64 CH NC contiguous rows from n0 = tile * BN, one box; chain c of q = rows 64 (CH q + c).
// - TMA_GATED (CH = 2, LinGated): P = 64 NC pairs j0 = tile * P: gate rows j0 .. j0 + P - 1 and up rows
//   H + j0 .. (two boxes of P rows, the tensor map's box); chain 0 of q = gate rows 64 q, chain 1 = up rows 64 q.
// - TMA_HEADS (CH = 2, LinRotary with D = R = 128): NC heads from h0 = tile * NC, one box of 128 NC rows; chain 0
//   of q = dims 0 .. 63 of head h0 + q, chain 1 = dims 64 .. 127 (the rotate-half pairs (i, i + 64)).
// x: its own tensor map (box 64 x 32 rows); rows >= M are whatever follows x (or zeros past the map's rows) and
// are never stored: an output column depends on its own x row only. Accumulator r of a chain: row 16 (warp % 4)
// + g (+ 8 for r % 4 >= 2) of the chain, x row 8 (r / 4) + 2 (lane % 4) (+ 1 for odd r).
// K split (ks_n > 1: TMA_PLAIN and TMA_HEADS, linear_tma.py's rule): an item is (tile, run ks of ks_n); each
// writes float32 partial sums to ws and the tile's last item to finish adds them in run order (deterministic), then
// runs the epilogue; counters start and end at 0. PIPE 1 (ATLAS_LINEAR_TMA_PIPE, opt-in): the consumers keep a
// stage's wgmma group in flight while they wait for the next stage and issue its group (wait_group 1), releasing
// each stage one step later. Numerics: float32 accumulation in k-step order, bias added in float32, one rounding
// at the store (as linear.cu's paths; paired epilogues get both sums rounded to T as the unfused Linear stores them).
// Norm prologue (NORM 1: NormLinear's RMSNormalization of a; NORM 2: AddRMSNormalization, h = a + b, b by its own
// tensor map into the stage after a's), with the norm's scale g folded into the weight (fold-norm-scale: w g, the
// op's g all ones): y = inv (x @ (w g)^T) per row, inv = 1 / sqrt(mean(h^2) + eps) as lin_norm_stage computes it.
// The stages are only read: wgmma multiplies a (and b: two products, the sum in float32) while the consumers read
// the same stage for their rows' sums of T(a + b)^2 (each thread the same rows and k chunk every stage; no write
// to the stages, so no proxy fence: rewriting them in place measured up to 2.5x slower, docs/perf.md v31); block it % grid
// stores stage it's T(a + b) to the sum output s (rows < M). After the loop the accumulators are scaled by inv.
// Numerics against the reference (x = T(h inv g), then the product): h and the normalized x are not rounded to T
// before the product and g is rounded into w instead: float16 tolerance.
// The whole of K in each block (no K split).
// Tensor maps live in the arena (written by the runtime at load, GeneratedModule.tensor_maps) and are passed by
// address. Everything here compiles to nothing but a trap outside sm_90a (the emitter asks for it only there).
namespace atlas {

constexpr int TMA_PLAIN = 0, TMA_GATED = 1, TMA_HEADS = 2;
constexpr int TMA_BK = 64;                         // k per stage: one 128-byte swizzle row
constexpr int TMA_XROWS = 32;                      // wgmma N: the x rows of a stage
constexpr int TMA_X_STAGE = TMA_XROWS * TMA_BK * 2;  // bytes of x per stage

constexpr int TMA_NONE = 0, TMA_RMS = 1, TMA_ADD_RMS = 2;  // the norm prologue (NORM)

template <int NC, int CH, int STAGES, int NORM = TMA_NONE>
__host__ __device__ constexpr int tma_smem_bytes() {  // linear_tma.py smem_bytes: + 1024 to align the stages
  return STAGES * (64 * CH * NC * TMA_BK * 2 + (NORM == TMA_ADD_RMS ? 2 : 1) * TMA_X_STAGE) + 1024;
}

// the norm prologue's operands (NORM != TMA_NONE): b's tensor map (TMA_ADD_RMS), epsilon, and the sum output s
// (TMA_ADD_RMS; rows s_row apart; nullptr: not stored)
template <typename T> struct TmaNorm {
  const void* tb = nullptr;
  float eps = 0.f;
  T* s = nullptr;
  long long s_row = 0;
};

__device__ __forceinline__ unsigned tma_smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void tma_bar_init(unsigned bar, unsigned count) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
#endif
}

__device__ __forceinline__ void tma_bar_wait(unsigned bar, unsigned parity) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nTMA_WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra TMA_WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
#endif
}

__device__ __forceinline__ void tma_bar_expect(unsigned bar, unsigned bytes) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
#endif
}

__device__ __forceinline__ void tma_bar_arrive(unsigned bar) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
#endif
}

// the box at (c0 along K, c1 along rows) of the tensor map at tmap into shared address dst, completing on bar
__device__ __forceinline__ void tma_load_2d(unsigned dst, const void* tmap, unsigned bar, int c0, int c1) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
      ::"r"(dst), "l"(tmap), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
#endif
}

// wgmma descriptor of a K-major tile of 128-byte rows in the 128-byte swizzle (what the copy engine writes):
// start >> 4, leading offset 16 B (unused for this layout), 8-row groups 1024 B apart, swizzle mode 1
__device__ __forceinline__ unsigned long long tma_desc(unsigned addr) {
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(16 >> 4) << 16) |
         ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}

// d[64 rows x 32 x rows] += A[64 x 16] B[16 x 32] (both K-major in shared memory)
__device__ __forceinline__ void tma_wgmma(float (&d)[16], unsigned long long da, unsigned long long db) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, 0, 0;"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(da), "l"(db));
#endif
}

__device__ __forceinline__ void tma_wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void tma_wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}

template <int PENDING>
__device__ __forceinline__ void tma_wgmma_wait() {  // all but the last PENDING committed groups done
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
#endif
}

// tw / tx: the weight and x tensor maps (x: a, with a norm prologue); y: the output View (TMA_PLAIN) or the
// epilogue's (paired: epi.put); nrm: the norm prologue's operands (NORM != TMA_NONE).
template <typename T, int R, int LAYOUT, int NC, int CH, int STAGES, bool HAS_BIAS, int NORM, int PIPE, typename EPI>
__device__ __forceinline__ void linear_tma_decode(const void* tw, const void* tx, const T* __restrict__ bias,
                                                  long long bias_stride, const View<T, R>& y, long long M,
                                                  long long N, long long K, EPI epi, float* __restrict__ ws,
                                                  unsigned int* cnt, long long ks_n, const TmaNorm<T>& nrm) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert(LAYOUT == TMA_PLAIN || CH == 2, "a paired layout multiplies its pairs' two rows as chains 0 and 1");
  static_assert(NORM == TMA_NONE || LinVec<T>::N == 8, "the norm prologue reads 16-byte chunks of 8 float16");
  constexpr int BN = 64 * CH * NC;  // weight rows per stage
  constexpr int W_STAGE = BN * TMA_BK * 2;
  constexpr int X_STAGE = (NORM == TMA_ADD_RMS ? 2 : 1) * TMA_X_STAGE;  // a (and b) per stage
  extern __shared__ unsigned char atlas_tma_smem[];
  __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
  __shared__ int last;
  __shared__ float tma_inv[TMA_XROWS];  // the norm's inv per x row
  __shared__ long long tma_yoff[TMA_XROWS];  // y's row offsets (lin_row_offset), once per block, not per output
  const unsigned base = tma_smem_u32(atlas_tma_smem);
  const unsigned sm = base + ((1024 - (base & 1023)) & 1023);  // the swizzle atoms need 1024-byte alignment
  const unsigned xsm = sm + STAGES * W_STAGE;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (LAYOUT == TMA_GATED || NORM != TMA_NONE) ks_n = 1;
  const long long tile = blockIdx.x / ks_n, ks = blockIdx.x % ks_n;
  const long long steps = K / TMA_BK, run = (steps + ks_n - 1) / ks_n;
  const long long s0 = ks * run, s1 = s0 + run < steps ? s0 + run : steps;
  const int iters = s1 > s0 ? int(s1 - s0) : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      tma_bar_init(tma_smem_u32(&full[s]), 1);
      tma_bar_init(tma_smem_u32(&empty[s]), 4 * NC);  // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (threadIdx.x < TMA_XROWS) tma_yoff[threadIdx.x] = threadIdx.x < M ? lin_row_offset(y, threadIdx.x) : 0;
  __syncthreads();
  if (warp == 4 * NC) {  // the producer
    if (lane == 0) {
      for (int it = 0; it < iters; ++it) {
        const int s = it % STAGES;
        const unsigned f = tma_smem_u32(&full[s]);
        tma_bar_wait(tma_smem_u32(&empty[s]), ((it / STAGES) & 1) ^ 1);
        tma_bar_expect(f, W_STAGE + X_STAGE);
        const int k0 = int((s0 + it) * TMA_BK);
        if constexpr (LAYOUT == TMA_GATED) {
          constexpr int P = 64 * NC;
          tma_load_2d(sm + s * W_STAGE, tw, f, k0, int(tile * P));
          tma_load_2d(sm + s * W_STAGE + P * 128, tw, f, k0, int(N / 2 + tile * P));
        } else {
          tma_load_2d(sm + s * W_STAGE, tw, f, k0, int(tile * BN));
        }
        tma_load_2d(xsm + s * X_STAGE, tx, f, k0, 0);
        if constexpr (NORM == TMA_ADD_RMS) tma_load_2d(xsm + s * X_STAGE + TMA_X_STAGE, nrm.tb, f, k0, 0);
      }
    }
    return;
  }
  const int q = warp >> 2;
  float acc[CH][16];
#pragma unroll
  for (int c = 0; c < CH; ++c)
#pragma unroll
    for (int r = 0; r < 16; ++r) acc[c][r] = 0.f;
  unsigned chain[CH];  // shared address of chain c's first row in stage 0
#pragma unroll
  for (int c = 0; c < CH; ++c) {
    const int row = LAYOUT == TMA_GATED ? c * 64 * NC + 64 * q : LAYOUT == TMA_HEADS ? 128 * q + 64 * c : 64 * (CH * q + c);
    chain[c] = sm + row * 128;
  }
  // the norm prologue: consumer thread ct reads the 16-byte chunks ct + 128 NC j of each stage's 32 x 128-byte
  // rows: row ci / 8, its k chunk (ci % 8) ^ (row % 8) (the 128-byte swizzle), the same every stage
  constexpr int NCHUNK = (TMA_XROWS * 8 + 128 * NC - 1) / (128 * NC);
  const int ct = threadIdx.x;
  float ss[NCHUNK];
#pragma unroll
  for (int j = 0; j < NCHUNK; ++j) ss[j] = 0.f;
  for (int it = 0; it < iters; ++it) {
    const int s = it % STAGES;
    tma_bar_wait(tma_smem_u32(&full[s]), (it / STAGES) & 1);
    tma_wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < TMA_BK / 16; ++kk) {
      const unsigned long long db = tma_desc(xsm + s * X_STAGE + kk * 32);
#pragma unroll
      for (int c = 0; c < CH; ++c) tma_wgmma(acc[c], tma_desc(chain[c] + s * W_STAGE + kk * 32), db);
      if constexpr (NORM == TMA_ADD_RMS) {  // + b's product: (a + b) w^T
        const unsigned long long dbb = tma_desc(xsm + s * X_STAGE + TMA_X_STAGE + kk * 32);
#pragma unroll
        for (int c = 0; c < CH; ++c) tma_wgmma(acc[c], tma_desc(chain[c] + s * W_STAGE + kk * 32), dbb);
      }
    }
    tma_wgmma_commit();
    if constexpr (NORM != TMA_NONE) {  // the rows' sums of squares while the tensor cores multiply
      const unsigned char* xg = atlas_tma_smem + (xsm - base) + s * X_STAGE;
      const long long k0 = (s0 + it) * TMA_BK;
      const bool write_s = NORM == TMA_ADD_RMS && nrm.s != nullptr && it % gridDim.x == blockIdx.x;
#pragma unroll
      for (int j = 0; j < NCHUNK; ++j) {
        const int ci = ct + 128 * NC * j, row = ci >> 3;
        if (ci >= TMA_XROWS * 8) continue;
        float v[8];
        LinVec<T>::unpack(*reinterpret_cast<const uint4*>(xg + 16 * ci), v);
        if constexpr (NORM == TMA_ADD_RMS) {
          float w[8];
          LinVec<T>::unpack(*reinterpret_cast<const uint4*>(xg + TMA_X_STAGE + 16 * ci), w);
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] = float(T(v[e] + w[e]));
          if (write_s && row < M)
            *reinterpret_cast<uint4*>(nrm.s + row * nrm.s_row + k0 + 8 * ((ci & 7) ^ (row & 7))) = LinVec<T>::pack(v);
        }
#pragma unroll
        for (int e = 0; e < 8; ++e) ss[j] += v[e] * v[e];
      }
      __syncwarp();  // every lane's reads of the stage before lane 0 releases it
    }
    if constexpr (PIPE) {  // this stage's products stay in flight; the previous stage's are done: release it
      tma_wgmma_wait<1>();
      if (lane == 0 && it > 0) tma_bar_arrive(tma_smem_u32(&empty[(it + STAGES - 1) % STAGES]));
    } else {
      tma_wgmma_wait<0>();
      if (lane == 0) tma_bar_arrive(tma_smem_u32(&empty[s]));
    }
  }
  if constexpr (PIPE) tma_wgmma_wait<0>();  // the last stage's products, before the accumulators are read
  const int g = lane >> 2, cc = lane & 3;
  const int row0 = 16 * (warp & 3) + g;  // + 8 for r % 4 >= 2
  if constexpr (NORM != TMA_NONE) {  // each row's sum of squares over its 8 threads, then the accumulators scaled
#pragma unroll
    for (int j = 0; j < NCHUNK; ++j) {
      float t = ss[j];
      t += __shfl_xor_sync(0xffffffffu, t, 1);
      t += __shfl_xor_sync(0xffffffffu, t, 2);
      t += __shfl_xor_sync(0xffffffffu, t, 4);
      const int ci = ct + 128 * NC * j;
      if (ci < TMA_XROWS * 8 && (ci & 7) == 0)
        tma_inv[ci >> 3] = 1.f / sqrtf(t / float(K) + nrm.eps);
    }
    asm volatile("bar.sync 1, %0;" ::"n"(128 * NC) : "memory");
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int r = 0; r < 16; ++r) acc[c][r] *= tma_inv[8 * (r >> 2) + 2 * cc + (r & 1)];
  }
  if (ks_n > 1) {  // K split: partial sums to ws; the tile's last item adds them in run order into acc
    constexpr int SLOTS = NC * CH * 16 * 128;  // one item's partial sums, [q][c][r][thread of q]
    const int t = threadIdx.x & 127;
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int r = 0; r < 16; ++r) ws[blockIdx.x * (long long)SLOTS + ((q * CH + c) * 16 + r) * 128 + t] = acc[c][r];
    __threadfence();
    asm volatile("bar.sync 1, %0;" ::"n"(128 * NC) : "memory");  // the consumers only: the producer is done
    if (threadIdx.x == 0) last = atomicAdd(cnt + tile, 1u) == (unsigned int)(ks_n - 1);
    asm volatile("bar.sync 1, %0;" ::"n"(128 * NC) : "memory");
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        float sum = 0.f;
        for (long long k = 0; k < ks_n; ++k)
          sum += __ldcg(ws + (tile * ks_n + k) * SLOTS + ((q * CH + c) * 16 + r) * 128 + t);
        acc[c][r] = sum;
      }
    if (threadIdx.x == 0) cnt[tile] = 0u;  // ready for the next launch
  }
  if constexpr (LAYOUT != TMA_PLAIN) {  // the pairs (chain 0, chain 1) of row p of warpgroup q
    const long long yn = y.stride[R - 1];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const long long m = 8 * (r >> 2) + 2 * cc + (r & 1);
      const long long p = (tile * NC + q) * 64 + row0 + ((r & 2) ? 8 : 0);
      if (m < M && p < N / 2) {  // N / 2 pairs: gate / up halves, or a head's 64 rotate-half pairs
        float ba = 0.f, bb = 0.f;
        if constexpr (HAS_BIAS) {
          ba = float(load(bias + epi.row_a(p, N) * bias_stride));
          bb = float(load(bias + epi.row_b(p, N) * bias_stride));
        }
        epi.put(y.p + tma_yoff[m], yn, m, p, lin_round<T>(acc[0][r] + ba), lin_round<T>(acc[1][r] + bb));
      }
    }
  } else {
    const long long yn = y.stride[R - 1];
#pragma unroll
    for (int c = 0; c < CH; ++c)
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        const long long n = tile * BN + 64 * (CH * q + c) + row0 + ((r & 2) ? 8 : 0);
        const long long m = 8 * (r >> 2) + 2 * cc + (r & 1);
        if (m < M && n < N) {
          float b = 0.f;
          if constexpr (HAS_BIAS) b = float(load(bias + n * bias_stride));
          store(y.p + tma_yoff[m] + n * yn, acc[c][r] + b);
        }
      }
  }
#else
  __trap();  // linear_tma.py emits this path for sm_90a only
#endif
}

}  // namespace atlas
