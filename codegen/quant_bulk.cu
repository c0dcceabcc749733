// linear_quant_bulk (quant_bulk.py): a one-row int4 g128 or int8 projection y[n] = x @ dequant(wq)^T (+ bias[n]), plain
// or paired (SwiGLU; the merged QKV projection's rotary and cache append), x a float16 row or the (Add)RMSNorm of one
// (NormLinearQ, NormLinearRotary), with the copy engine streaming the weights into a ring of shared-memory stages
// (sm_90a; quant_bulk.py says where it serves: the sm90 int4 default from K 4096). quant.cu's tensor-core path holds
// each round of weights in registers and waits for it before dequantizing; here a producer warp keeps STAGES stages
// in flight whatever the consumer warps are doing (examples/w4_bulk_lab.py asks how close that comes to the read-only
// floor; docs/perf.md v43).
//
// Weights in the compiler's layouts: int4 (BITS 4) wq uint8 [N, K/2] (low nibble = even k, value + 8, symmetric),
// scale float16 [N, K/128]; int8 (BITS 8) wq int8 [N, K], scale float16 [N]. The copy engine reads wq by a 2-D
// tensor map (uint8, dims {row bytes, N}, box {64, 16 W} or, paired, two boxes {64, 8 W} a stage; no swizzle:
// generate.TensorMapTable with dtype uint8): a stage is 64 bytes of each of a tile's 16 W rows, packed densely: the
// 128 k of one int4 group, or 64 k of int8. Block: W consumer warps (warp w multiplies 16 rows of the tile), then
// one producer warp whose lane 0 issues the copies. Lane (g, c) reads 16 bytes of its A rows g and g + 8 at byte
// 16 c (conflict-free: a phase's two rows lie 64 bytes apart), i.e. k 32 c .. 32 c + 31 (int4) or 16 c .. 16 c + 15
// (int8) of the stage, and x at the same k from shared memory, staged once per block in the order the lanes read
// it (word LW c + w of a step, LW the lane's words of 8 k, at slot 4 w + c) from the x source (QbPlain: the row;
// QbNorm: the norm, computed by the consumer warps while the first copies are in flight). Dequantization and the
// MMA chain as quant.cu's qlin_step4 (int4, exact products: each stage's chain starts from zero and is added times
// the row's group scale in float32) or qlin_step8 (int8, exact: times the row's scale after the loop); OFS (int4):
// qlin_step4_ofs's offset form (x staged as (x0, x4) (x2, x6) (x1/16, x5/16) (x3/16, x7/16) per word, each stage's
// chain from -(1032 S_e + 72 S_o)).
// An item is (tile, run ks of ks_n) over the K steps; with ks_n > 1 each item writes its float32 sums to ws and the
// tile's last item to finish adds the runs' sums in run order (deterministic), then stores (counters start and end
// at 0). With more tiles than blocks (ks_n == 1; quant_bulk.py loop_choice: the LM head's 501 tiles on 132 SMs) a
// block loops over tiles: the producer claims the next one from a counter and keeps the ring full across tiles, x and
// the norm are staged once a block (each tile still one block's, in stage order: the same sums whoever takes it).
// Numerics: float32 accumulation in stage order, the bias in float32, one rounding at the store (paired:
// each sum rounded, then the epilogue, as quant.cu's qlin_gated_store).
// EARLY (quant_bulk.py early_choice; the wrapper then leaves out its pdl_enter, KernelCode.waits_inside): the producer
// issues its copies without waiting for the previous kernel (the weights are constants, and it writes only shared
// memory), so a block's first STAGES stages are on their way while that kernel drains; the consumer warps wait
// (atlas::pdl_enter) before they read x, and a looping block's producer before its first claim (the counters). The
// grid still completes only after its waits, so a kernel waiting on it waits on everything before it.
// INFLIGHT D (quant_bulk.py inflight_choice; 0: no cap): the producer starts copy it only once copy it - D has landed,
// so at most D copies per block are in flight while the ring still holds STAGES landed stages. With every stage of
// every block in flight the memory system's queues hold microseconds of traffic that x's staging and the split's
// atomics wait behind (examples/chain_lab.cu INFLIGHT: one launch per projection 60.96 -> 52.52 us a layer at D = 2,
// H100, docs/perf.md v48). HOLD (quant_bulk.py hold_choice): the producer warp stays until the consumers have taken
// the last stage, so its lanes trigger the dependents (the wrapper's pdl_leave) near the end, not at the start.
// Everything here compiles to nothing outside sm_90a (the emitter asks for it only in an sm90-only compile).
namespace atlas {

constexpr int QB_ROW_BYTES = 64;  // bytes of a weight row per stage

// k per stage: 128 int4 (one g128 group) or 64 int8
template <int BITS> __host__ __device__ constexpr int qb_stage_k() { return BITS == 4 ? 128 : 64; }

// The x sources of linear_quant_bulk: word(k) gives the 8 float16 values of x at k .. k + 7 (row 0), after prepare()
// ran on the W consumer warps (named barrier 1 after it where it needs one). preload(k0, words) runs on them before
// the wait for the previous kernel: it may read constants only (the norm's scale g), for the thread's first staged
// word, k0 + 8 threadIdx.x when threadIdx.x < words.
// CG (a chain's phases, qb_chain_phase): x and the norm's operands may have been written by this kernel's earlier
// phases, so they are read with coherent loads (ld.global.cg), not through the non-coherent cache (__ldg).
// QbPlain: x a contiguous, 16-byte aligned row (the emitter checks).
template <int R, bool CG = false> struct QbPlain {
  View<__half, R> x;
  __device__ __forceinline__ void preload(long long, int) {}
  template <int W> __device__ __forceinline__ void prepare(long long, unsigned char*) const {}
  __device__ __forceinline__ uint4 word(long long k) const {
    const uint4* p = reinterpret_cast<const uint4*>(x.p + k);
    return CG ? __ldcg(p) : __ldg(p);
  }
};

// row 0's offset, for an XNorm of one row built without linear_prologue's lin_offsets (a chain's phases: no block-wide
// barrier before the phase call, which the producer warp would not reach in step)
__device__ const long long qb_row0[1] = {0};

// QbNorm: NormLinearQ's (Add)RMSNormalization of a (and b) with scale g (linear.cu XNorm: a, b, g contiguous and
// 16-byte aligned, the emitter checks), the arithmetic of lin_norm_stage: h = a (ADD: T(a + b), stored to the sum
// output s by block 0 when s is given), inv = 1 / sqrt(mean(h^2) + eps), x = T(h inv g). prepare() keeps h for all
// of K in shared memory (hbuf, K halves) and finds inv; word() scales 8 of h. The sum of h^2 meets across the
// consumer warps in warp order (a different order than lin_norm_stage's 8 warps: float rounding only).
// G_EARLY (quant_bulk.py g_early_choice): preload() reads the thread's first 16 bytes of g before the wait, so that
// the staging after the norm's reduction does not wait on a load of its own (the same values either way).
template <bool ADD, bool G_EARLY = false, bool CG = false> struct QbNorm {
  XNorm<__half, ADD> src;
  float eps;
  __half* s;  // the residual sum's row 0, or nullptr
  __half* hbuf = nullptr;
  float inv = 0.f;
  long long g_k = -1;  // G_EARLY: the k of g_first (-1: none)
  uint4 g_first = make_uint4(0u, 0u, 0u, 0u);
  __device__ __forceinline__ void preload(long long k0, int words) {
    if (G_EARLY && int(threadIdx.x) < words) {
      g_k = k0 + 8LL * threadIdx.x;
      g_first = __ldg(reinterpret_cast<const uint4*>(src.g + g_k));
    }
  }
  template <int W> __device__ __forceinline__ void prepare(long long K, unsigned char* buf) {
    hbuf = reinterpret_cast<__half*>(buf);
    float* red = reinterpret_cast<float*>(buf + 2 * K);  // W floats after h
    const bool write_s = s != nullptr && blockIdx.x == 0;
    float q = 0.f;
    for (long long k = (long long)threadIdx.x * 8; k < K; k += 32LL * W * 8) {
      float v[8];
      if constexpr (CG) {  // src.h_vec's arithmetic, its loads coherent
        LinVec<__half>::unpack(__ldcg(reinterpret_cast<const uint4*>(src.a + src.aoff[0] + k)), v);
        if constexpr (ADD) {
          float w[8];
          LinVec<__half>::unpack(__ldcg(reinterpret_cast<const uint4*>(src.b + src.boff[0] + k)), w);
          XNorm<__half, ADD>::add_b(v, w);
        }
      } else {
        src.h_vec(0, k, v);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) q += v[e] * v[e];
      const uint4 packed = LinVec<__half>::pack(v);  // exact: h is a float16 value
      *reinterpret_cast<uint4*>(hbuf + k) = packed;
      if (write_s) *reinterpret_cast<uint4*>(s + k) = packed;
    }
    q = warp_sum(q);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = q;
    asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
    float t = 0.f;
    for (int w = 0; w < W; ++w) t += red[w];
    inv = 1.f / sqrtf(t / float(K) + eps);
  }
  __device__ __forceinline__ uint4 word(long long k) const {
    float v[8], gv[8];
    LinVec<__half>::unpack(*reinterpret_cast<const uint4*>(hbuf + k), v);
    uint4 graw;
    if (G_EARLY && k == g_k) {  // a branch, not a select: the load is skipped
      graw = g_first;
    } else {
      graw = __ldg(reinterpret_cast<const uint4*>(src.g + k));
    }
    LinVec<__half>::unpack(graw, gv);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = v[e] * inv * gv[e];
    return LinVec<__half>::pack(v);  // rounds to float16
  }
};

// x of steps s0 .. s0 + iters - 1 (src.word) into xs in lane order, and with OFS its stages' chain starts into corr;
// ends with a barrier of the W consumer warps (named barrier 1)
template <int W, int BITS, bool OFS, typename SRC>
__device__ __forceinline__ void qb_stage_x(const SRC& src, int s0, int iters, unsigned char* xs, float* corr) {
  constexpr int WPS = qb_stage_k<BITS>() / 8, LW = WPS / 4;  // words of 8 k per stage, per lane c
  const long long k0 = (long long)s0 * qb_stage_k<BITS>();
  for (int base = 0; base < iters * WPS; base += 32 * W) {  // a uniform trip count: OFS's lanes shuffle
    const int v = base + threadIdx.x;
    const int st = v / WPS, vv = v % WPS, c = vv / LW, w = vv % LW;
    uint4 p = make_uint4(0u, 0u, 0u, 0u);
    if (v < iters * WPS) p = src.word(k0 + 8LL * v);
    if constexpr (OFS) {
      const unsigned sixteenth = 0x2C002C00u;  // (1/16, 1/16) in float16
      p = make_uint4(qlin_lo(p.x, p.z), qlin_lo(p.y, p.w), qlin_hmul2(qlin_hi(p.x, p.z), sixteenth),
                     qlin_hmul2(qlin_hi(p.y, p.w), sixteenth));
      // the sums of what the MMAs multiply: S_o from the staged x / 16 (times 16, exact), so the offsets cancel
      float se = qlin_half2_sum(p.x) + qlin_half2_sum(p.y), so = 16.f * (qlin_half2_sum(p.z) + qlin_half2_sum(p.w));
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
}

// tw: wq's tensor map; src: the x source (QbPlain / QbNorm); y: the output View (one row); M: the rows at run time (0
// or 1); ws / cnt: the K split's work space and a counter per tile (ks_n > 1), or cnt[0] the loop's claims (ks_n == 1,
// more tiles than blocks; nullptr: no loop). EPI: LinNoEpi (y[n] = the row's sum)
// or a paired epilogue (pair j = rows epi.row_a(j) and epi.row_b(j), epi.put of both sums rounded to float16):
// then a tile is P = 8 W pairs j0 .. j0 + P - 1, read as two boxes of P rows per stage from rows row_a(j0) and
// row_b(j0), and warp w's A rows g / g + 8 are rows 8 w + g of the two boxes, so a lane holds both sums of its pair.
// The emitter checks that row_a and row_b step by one across each tile: always for linear.cu LinGated (rows j and
// N/2 + j); for LinRotary (the merged QKV projection's rotary and cache append) when P divides D / 2 and R / 2.
template <int R, int BITS, int W, int STAGES, bool HAS_BIAS, bool OFS, bool EARLY, int INFLIGHT, bool HOLD,
          typename SRC, typename EPI = LinNoEpi>
__device__ __forceinline__ void linear_quant_bulk(const void* tw, const __half* __restrict__ scale, SRC src,
                                                  const __half* __restrict__ bias, long long bias_stride,
                                                  const View<__half, R>& y, long long M, int N, int K,
                                                  float* __restrict__ ws, unsigned int* cnt, int ks_n,
                                                  EPI epi = EPI()) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert((BITS == 4 || BITS == 8) && (BITS == 4 || !OFS), "int4 (with or without OFS) or int8");
  static_assert(INFLIGHT >= 0 && INFLIGHT < STAGES, "INFLIGHT: fewer copies in flight than stages (0: no cap)");
  constexpr bool GATED = lin_gated<EPI>();
  constexpr int SK = qb_stage_k<BITS>(), WPS = SK / 8, LW = WPS / 4;
  constexpr int ROWS = 16 * W;                  // weight rows per stage
  constexpr int OUTS = GATED ? 8 * W : 16 * W;  // outputs per tile
  constexpr int W_STAGE = ROWS * QB_ROW_BYTES;
  if (M < 1) {  // the whole block: nothing to compute
    if constexpr (EARLY) pdl_enter();
    return;
  }
  extern __shared__ unsigned char atlas_qb_smem[];
  __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
  __shared__ int last;
  unsigned char* sm = atlas_qb_smem + ((128 - (tma_smem_u32(atlas_qb_smem) & 127)) & 127);  // copies: 128-aligned
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tile = blockIdx.x / ks_n, ks = blockIdx.x % ks_n;
  const int steps = K / SK, run = (steps + ks_n - 1) / ks_n;
  const int s0 = ks * run, s1 = s0 + run < steps ? s0 + run : steps;
  const int iters = s1 > s0 ? s1 - s0 : 0;
  const int H = N / 2, outs = GATED ? H : N;
  unsigned char* xs = sm + STAGES * W_STAGE;
  float* corr = reinterpret_cast<float*>(xs + run * SK * 2);
  unsigned char* src_buf = xs + ((run * (SK * 2 + 4) + 15) & ~15);  // QbNorm: h (K halves) and W floats
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      tma_bar_init(tma_smem_u32(&full[s]), 1);
      tma_bar_init(tma_smem_u32(&empty[s]), W);  // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  // tiles beyond the grid (ks_n == 1, quant_bulk.py loop_choice): a block takes tile blockIdx.x, then the tiles its
  // producer claims from cnt[0] (grid + 0, grid + 1, ...), one item ahead; it names each stage's tile in slot_tile,
  // and a stage of tile -1, with no copy, ends the consumers' loop. The claims are made after the previous grid has
  // completed (until then the counters are its own): tiles claims in all, one failing per block, and whoever makes
  // the last one sets the counter back to 0.
  const int tiles = (outs + OUTS - 1) / OUTS;
  const bool loop = ks_n == 1 && cnt != nullptr && int(gridDim.x) < tiles;
  __shared__ int slot_tile[STAGES];
  if (warp == W) {  // the producer
    if (lane == 0) {
      // the stage of an item before whose copy the claim for the next item is made: after the copies in flight are
      // issued; the first item's after a ring of copies (its claim waits for the previous grid first, and the copy
      // after a ring waits for the consumers, who wait for it too)
      const int claim_at = int(imin(iters - 1, INFLIGHT > 0 ? INFLIGHT : STAGES - 1));
      const int first_claim_at = int(imin(iters - 1, STAGES));
      int it = 0, claim = -1;
      for (int t = tile; t < tiles;) {
        int next = tiles;  // without the loop: one item
        const int row0 = GATED ? int(epi.row_a(t * OUTS, N)) : t * ROWS, row1 = GATED ? int(epi.row_b(t * OUTS, N)) : 0;
        for (int j = 0; j < iters; ++j, ++it) {
          const int s = it % STAGES;
          const unsigned f = tma_smem_u32(&full[s]);
          if (loop && j == (it == j ? first_claim_at : claim_at)) {
            if (it == j) pdl_enter();  // the first item: the counters belong to the previous grid until it completes
            claim = int(atomicAdd(cnt, 1u));
            next = int(gridDim.x) + claim;  // tiles or more: none left
          }
          if (INFLIGHT > 0 && it >= INFLIGHT) {  // copy it - INFLIGHT has landed (its slot is not refilled before it)
            const int back = it - INFLIGHT;
            tma_bar_wait(tma_smem_u32(&full[back % STAGES]), (back / STAGES) & 1);
          }
          tma_bar_wait(tma_smem_u32(&empty[s]), ((it / STAGES) & 1) ^ 1);
          if (loop) slot_tile[s] = t;  // published by the arrive below (release), read after the wait (acquire)
          tma_bar_expect(f, W_STAGE);
          if constexpr (GATED) {
            tma_load_2d(tma_smem_u32(sm + s * W_STAGE), tw, f, (s0 + j) * QB_ROW_BYTES, row0);
            tma_load_2d(tma_smem_u32(sm + s * W_STAGE + W_STAGE / 2), tw, f, (s0 + j) * QB_ROW_BYTES, row1);
          } else {
            tma_load_2d(tma_smem_u32(sm + s * W_STAGE), tw, f, (s0 + j) * QB_ROW_BYTES, row0);
          }
        }
        t = next;
      }
      if (loop) {  // the end: a stage of tile -1 (an arrive without bytes)
        const int s = it % STAGES;
        tma_bar_wait(tma_smem_u32(&empty[s]), ((it / STAGES) & 1) ^ 1);
        slot_tile[s] = -1;
        tma_bar_arrive(tma_smem_u32(&full[s]));
        if (claim == tiles - 1) *cnt = 0u;  // the launch's last claim: every block has made its failing one
      }
      // HOLD: stay until the consumers hold the last stage in registers, so that the producer's lanes reach the
      // wrapper's pdl_leave near the block's end, not at its start (common.cuh: the trigger at the end)
      if (HOLD && it > 0) tma_bar_wait(tma_smem_u32(&empty[(it - 1) % STAGES]), ((it - 1) / STAGES) & 1);
    }
    __syncwarp();
    return;
  }
  src.preload((long long)s0 * SK, iters * WPS);  // constants only: before the wait
  if constexpr (EARLY) pdl_enter();  // x (and the norm's operands) may come from the previous kernel
  src.template prepare<W>(K, src_buf);
  qb_stage_x<W, BITS, OFS>(src, s0, iters, xs, corr);
  const int g = lane >> 2, c = lane & 3;
  // A rows g and g + 8: their places in a stage (plain: rows n, n + 8 of the tile; gated: a pair's two)
  const int r_lo = GATED ? 8 * warp + g : 16 * warp + g, r_hi = GATED ? OUTS + r_lo : r_lo + 8;
  const int groups = BITS == 4 ? K / SK : 1;  // int8: one scale per row, applied after the loop
  const unsigned char* wrow_lo = sm + r_lo * QB_ROW_BYTES + 16 * c;
  const unsigned char* wrow_hi = sm + r_hi * QB_ROW_BYTES + 16 * c;
  const long long yn = y.stride[R - 1];
  auto put = [&](int n, float v) {  // a plain output: row n's sum (+ bias), one rounding
    if (n >= N) return;
    if constexpr (HAS_BIAS) v += __half2float(bias[n * bias_stride]);
    store(y.p + n * yn, v);
  };
  auto put_pair = [&](int j, float za, float zb) {  // a paired output: its two rows' sums, each rounded, then epi
    if (j >= outs) return;
    if constexpr (HAS_BIAS) {
      za += __half2float(bias[epi.row_a(j, N) * bias_stride]);
      zb += __half2float(bias[epi.row_b(j, N) * bias_stride]);
    }
    epi.put(y.p, yn, 0, j, lin_round<__half>(za), lin_round<__half>(zb));
  };
  int it = 0;  // the block's stages so far
  for (int t = tile;;) {  // the items: one, or (loop) the tiles the producer names
    if (loop) {
      tma_bar_wait(tma_smem_u32(&full[it % STAGES]), (it / STAGES) & 1);
      t = *reinterpret_cast<volatile int*>(&slot_tile[it % STAGES]);
      if (t < 0) return;
    }
    // the A rows' weight rows (paired: the tile's first rows of the two boxes, consecutive across a tile: the
    // emitter checks)
    const int n_lo = GATED ? int(epi.row_a(t * OUTS, N)) + r_lo : t * OUTS + r_lo;
    const int n_hi = GATED ? int(epi.row_b(t * OUTS, N)) + r_lo : n_lo + 8;
    const __half* sc_lo = scale + (long long)(n_lo < N ? n_lo : N - 1) * groups;
    const __half* sc_hi = scale + (long long)(n_hi < N ? n_hi : N - 1) * groups;
    float acc_lo = 0.f, acc_hi = 0.f;
    for (int j = 0; j < iters; ++j, ++it) {
      const int s = it % STAGES;
      const float slo = BITS == 4 ? __half2float(sc_lo[s0 + j]) : 1.f;
      const float shi = BITS == 4 ? __half2float(sc_hi[s0 + j]) : 1.f;
      tma_bar_wait(tma_smem_u32(&full[s]), (it / STAGES) & 1);
      const uint4 wlo = *reinterpret_cast<const uint4*>(wrow_lo + s * W_STAGE);
      const uint4 whi = *reinterpret_cast<const uint4*>(wrow_hi + s * W_STAGE);
      __syncwarp();
      if (lane == 0) tma_bar_arrive(tma_smem_u32(&empty[s]));  // the stage is in registers: the copy engine may refill
      const unsigned ulo[4] = {wlo.x, wlo.y, wlo.z, wlo.w}, uhi[4] = {whi.x, whi.y, whi.z, whi.w};
      float part[4];
      part[0] = part[1] = part[2] = part[3] = OFS ? -corr[j] : 0.f;  // rows g and g + 8 read the same x
#pragma unroll
      for (int w = 0; w < LW; ++w) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xs + (j * WPS + 4 * w + c) * 16);
        if constexpr (BITS == 8) {  // words 2 w, 2 w + 1: k 8 w .. 8 w + 7 of the lane's 16
          unsigned pl0[2], ph0[2], pl1[2], ph1[2];
          qlin_q8_pairs(ulo[2 * w], pl0);
          qlin_q8_pairs(uhi[2 * w], ph0);
          qlin_q8_pairs(ulo[2 * w + 1], pl1);
          qlin_q8_pairs(uhi[2 * w + 1], ph1);
          lin_mma(part, pl0[0], ph0[0], pl0[1], ph0[1], qlin_lo(xv.x, xv.y), qlin_hi(xv.x, xv.y));
          lin_mma(part, pl1[0], ph1[0], pl1[1], ph1[1], qlin_lo(xv.z, xv.w), qlin_hi(xv.z, xv.w));
        } else if constexpr (OFS) {
          const unsigned vlo = ulo[w] >> 8, vhi = uhi[w] >> 8;
          lin_mma(part, qlin_nibbles<0x000F000Fu>(ulo[w]), qlin_nibbles<0x000F000Fu>(uhi[w]),
                  qlin_nibbles<0x000F000Fu>(vlo), qlin_nibbles<0x000F000Fu>(vhi), xv.x, xv.y);
          lin_mma(part, qlin_nibbles<0x00F000F0u>(ulo[w]), qlin_nibbles<0x00F000F0u>(uhi[w]),
                  qlin_nibbles<0x00F000F0u>(vlo), qlin_nibbles<0x00F000F0u>(vhi), xv.z, xv.w);
        } else {
          unsigned plo[4], phi[4];
          qlin_q4_pairs(ulo[w], plo);
          qlin_q4_pairs(uhi[w], phi);
          lin_mma(part, plo[0], phi[0], plo[1], phi[1], qlin_lo(xv.x, xv.z), qlin_hi(xv.x, xv.z));
          lin_mma(part, plo[2], phi[2], plo[3], phi[3], qlin_lo(xv.y, xv.w), qlin_hi(xv.y, xv.w));
        }
      }
      acc_lo = fmaf(slo, part[0], acc_lo);  // C fragment c0: row g, x column 2c (x is column 0: lanes c == 0)
      acc_hi = fmaf(shi, part[2], acc_hi);  // c2: row g + 8
    }
    if constexpr (BITS == 8) {  // the rows' scales (the K split's partial sums each carry it: a sum of scaled parts)
      acc_lo *= __half2float(sc_lo[0]);
      acc_hi *= __half2float(sc_hi[0]);
    }
    if (ks_n == 1) {
      if (c == 0) {
        if constexpr (GATED) {
          put_pair(t * OUTS + r_lo, acc_lo, acc_hi);  // the pair's index (its rows are n_lo, n_hi)
        } else {
          put(n_lo, acc_lo);
          put(n_hi, acc_hi);
        }
      }
      if (loop) continue;
      return;
    }
    // the K split (one item, t == tile): the runs' sums meet in ws, the tile's last run stores them
    if (c == 0) {
      ws[(long long)blockIdx.x * ROWS + r_lo] = acc_lo;
      ws[(long long)blockIdx.x * ROWS + r_hi] = acc_hi;
    }
    __threadfence();
    asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
    if (threadIdx.x == 0) last = atomicAdd(cnt + tile, 1u) == unsigned(ks_n - 1);
    asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
    if (!last) return;
    __threadfence();
    float* tot = ws + (long long)tile * ks_n * ROWS;  // the first item's slots take the totals
    for (int r = threadIdx.x; r < ROWS; r += 32 * W) {
      float sum = 0.f;
      for (int k = 0; k < ks_n; ++k) sum += __ldcg(tot + (long long)k * ROWS + r);
      if constexpr (GATED) {
        tot[r] = sum;
      } else {
        put(tile * ROWS + r, sum);
      }
    }
    if constexpr (GATED) {
      asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
      for (int r = threadIdx.x; r < OUTS; r += 32 * W)
        put_pair(tile * OUTS + r, __ldcg(tot + r), __ldcg(tot + OUTS + r));
    }
    if (threadIdx.x == 0) cnt[tile] = 0u;
    return;
  }
#endif
}

}  // namespace atlas
