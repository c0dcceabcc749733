// quant_chain.py's kernel: consecutive one-row projections of a decode step (quant_bulk.cu's linear_quant_bulk) in ONE
// launch. Uses quant_bulk.cu (the sources, qb_stage_x, qb_stage_dot) and linear_tma.cu (the copy engine).
namespace atlas {

// Why: every kernel boundary of the step lets DRAM idle (the last blocks' tail, the next kernel's blocks waiting for
// the shared memory the previous kernel's blocks hold, their first copies' latency). examples/chain_lab.cu measured
// the same projections in one persistent launch 14-25% under one launch each (H100, docs/perf.md v47-v48). Here the
// phases are the compiler's own linear_quant_bulk projections (same weights, sources, epilogues and arithmetic); one
// block per SM, all resident, each with W consumer warps and one producer warp sharing ONE ring of STAGES stages
// across the phases: the producer streams phase p + 1's weights (constants) while the consumers still multiply phase
// p or wait at the grid barrier between them, which orders every block's outputs of phase p before any read of
// them in phase p + 1. Items: phase p's (tile, K run) pairs, item i for block i mod gridDim.x in turn (a static
// schedule that both roles of a block walk in the same order: no claims, any gridDim). x (or the norm) is staged
// once per phase, and again for a later item only where its K run differs (the K split on a grid the runtime
// clamped below the plan's). Sums, K-split reductions and stores as linear_quant_bulk's (the same results).
// The grid barrier: count (a scratch counter, 0 at the launch's start) gets one release add per block; barrier k
// ends at k x gridDim.x (acquire polls); at the end the last block to finish resets it (done counts the blocks past
// their last barrier, so nobody polls any more). It needs every block resident at once: the runtime launches at most
// one block per SM (NodeSpec.co_resident, runtime/gpu.py co_resident_caps), and a programmatic dependent launches
// only once every block of this grid has triggered or exited, i.e. started (a block cannot exit before every block
// reached the first barrier), so it cannot take an SM from a block not yet resident. A poll that waits 4 s traps (a
// launch error, not a hang: e.g. another kernel holding SMs on a shared GPU).
// qb_stage_dot, the producer's loop, the stores and the K split repeat linear_quant_bulk's on purpose: that kernel
// keeps the machine code its timings measured (calling qb_stage_dot from it changed the SASS of its K-split kernels,
// the same results), until the chain is timed against it and one of the two forms goes.

// one stage's MMA chain of a lane (g, c) (linear_quant_bulk's inner loop, as a function): its A rows' 16 bytes wlo /
// whi (rows g and g + 8) times the stage's staged x (xst: the stage's words in lane order), from `start` (OFS: the
// stage's chain start; else 0) into part (the C fragment: part[0] row g, part[2] row g + 8, both x column 2c); int4
// dequantized exactly (qlin_step4 / its OFS form), int8 by qlin_step8's pairs
template <int BITS, bool OFS>
__device__ __forceinline__ void qb_stage_dot(float (&part)[4], const uint4& wlo, const uint4& whi,
                                             const unsigned char* xst, int c, float start) {
  constexpr int LW = qb_stage_k<BITS>() / 32;  // the lane's words of 8 k per stage
  const unsigned ulo[4] = {wlo.x, wlo.y, wlo.z, wlo.w}, uhi[4] = {whi.x, whi.y, whi.z, whi.w};
  part[0] = part[1] = part[2] = part[3] = start;  // rows g and g + 8 read the same x
#pragma unroll
  for (int w = 0; w < LW; ++w) {
    const uint4 xv = *reinterpret_cast<const uint4*>(xst + (4 * w + c) * 16);
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
}

template <int W, int STAGES> struct QbRing {
  unsigned char* sm;             // the stages (128-byte aligned), then the x area
  unsigned long long* full;      // STAGES mbarriers: the stage's bytes landed
  unsigned long long* empty;     // STAGES mbarriers: every consumer warp took the stage
  unsigned* count;               // the grid barrier's arrivals
  unsigned* done;                // blocks past their last barrier
  int it = 0;                    // this thread's stages so far (the producer's issued, a consumer's taken)
  unsigned barriers = 0;         // grid barriers passed (consumers)
};

// the ring's barriers (thread 0 initializes, the whole block syncs); counters: the chain's scratch counters, count at
// counters[0], done at counters[32] (a line each)
template <int W, int STAGES>
__device__ __forceinline__ QbRing<W, STAGES> qb_chain_begin(unsigned* counters) {
  extern __shared__ unsigned char atlas_qb_smem[];
  __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
  QbRing<W, STAGES> ring;
  ring.sm = atlas_qb_smem + ((128 - (tma_smem_u32(atlas_qb_smem) & 127)) & 127);  // copies: 128-aligned
  ring.full = full;
  ring.empty = empty;
  ring.count = counters;
  ring.done = counters + 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      tma_bar_init(tma_smem_u32(&full[s]), 1);
      tma_bar_init(tma_smem_u32(&empty[s]), W);  // lane 0 of each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  return ring;
}

// the consumer warps of every block: returns once all have called it as often as this block (see above)
template <int W, int STAGES> __device__ __forceinline__ void qb_grid_barrier(QbRing<W, STAGES>& ring) {
  asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");  // the block's stores of the phase are issued
  ++ring.barriers;
  if (threadIdx.x == 0) {
    __threadfence();
    asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ring.count) : "memory");
    const unsigned target = ring.barriers * gridDim.x;
    unsigned long long t0 = 0;
    for (unsigned tries = 0;; ++tries) {
      unsigned v;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ring.count) : "memory");
      if (v >= target) break;
      if ((tries & 1023u) == 0u) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (tries == 0) t0 = now;
        else if (now - t0 > 4000000000ull) __trap();  // not every block resident: a launch error, not a hang
      }
    }
    __threadfence();
  }
  asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
}

// the consumers' end of a chain: the block that finishes last resets the barrier's words for the next launch
template <int W, int STAGES> __device__ __forceinline__ void qb_chain_end(QbRing<W, STAGES>& ring, bool consumer) {
  if (!consumer || threadIdx.x != 0 || ring.barriers == 0) return;
  __threadfence();
  if (atomicAdd(ring.done, 1u) == gridDim.x - 1) {
    *ring.count = 0u;
    *ring.done = 0u;
    __threadfence();
  }
}

// one phase of a chain: linear_quant_bulk's projection (the same arguments; ws / cnt: the K split's, shared by the
// phases, which the grid barrier keeps apart) on the ring. FIRST: the consumers wait for the previous kernel
// (atlas::pdl_enter) before they read x; later phases pass the grid barrier first. LAST: HOLD applies (the producer
// stays until its last stage is taken). WP: the phase's warps (its tiles of 16 WP rows, or 8 WP pairs), at most the
// block's W: a rotary QKV projection whose heads allow fewer (quant_bulk.py rotary_warps: 8 for 128-dim heads) uses
// WP x 1 KB of each ring slot, and warps WP .. W - 1 only take its stages (their arrivals release the slot) and
// stage x with the others. Every thread of the block calls every phase in order.
template <int R, int BITS, int W, int WP, int STAGES, bool HAS_BIAS, bool OFS, int INFLIGHT, bool HOLD, bool FIRST,
          bool LAST, typename SRC, typename EPI = LinNoEpi>
__device__ __forceinline__ void qb_chain_phase(QbRing<W, STAGES>& ring, const void* tw,
                                               const __half* __restrict__ scale, SRC src,
                                               const __half* __restrict__ bias, long long bias_stride,
                                               const View<__half, R>& y, long long M, int N, int K,
                                               float* __restrict__ ws, unsigned int* cnt, int ks_n, EPI epi = EPI()) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  static_assert((BITS == 4 || BITS == 8) && (BITS == 4 || !OFS), "int4 (with or without OFS) or int8");
  static_assert(INFLIGHT >= 0 && INFLIGHT < STAGES, "INFLIGHT: fewer copies in flight than stages (0: no cap)");
  static_assert(WP >= 1 && WP <= W, "a phase's warps are some of the block's");
  constexpr bool GATED = lin_gated<EPI>();
  constexpr int SK = qb_stage_k<BITS>(), WPS = SK / 8;
  constexpr int ROWS = 16 * WP;                   // weight rows per stage
  constexpr int OUTS = GATED ? 8 * WP : 16 * WP;  // outputs per tile
  constexpr int W_STAGE = ROWS * QB_ROW_BYTES;    // the phase's bytes of a ring slot
  constexpr int SLOT = 16 * W * QB_ROW_BYTES;     // a ring slot
  __shared__ int last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int steps = K / SK, run = (steps + ks_n - 1) / ks_n;
  const int H = N / 2, outs = GATED ? H : N;
  const int tiles = (outs + OUTS - 1) / OUTS, items = M < 1 ? 0 : tiles * ks_n;
  unsigned char* sm = ring.sm;
  unsigned char* xs = sm + STAGES * SLOT;
  float* corr = reinterpret_cast<float*>(xs + run * SK * 2);
  unsigned char* src_buf = xs + ((run * (SK * 2 + 4) + 15) & ~15);  // QbNorm: h (K halves) and W floats
  if (warp == W) {  // the producer: this block's items' stages, in the consumers' order
    if (lane == 0) {
      int it = ring.it;
      for (int i = blockIdx.x; i < items; i += gridDim.x) {
        const int t = i / ks_n, s0 = (i % ks_n) * run, s1 = s0 + run < steps ? s0 + run : steps;
        const int row0 = GATED ? int(epi.row_a(t * OUTS, N)) : t * ROWS, row1 = GATED ? int(epi.row_b(t * OUTS, N)) : 0;
        for (int s_k = s0; s_k < s1; ++s_k, ++it) {
          const int s = it % STAGES;
          const unsigned f = tma_smem_u32(&ring.full[s]);
          if (INFLIGHT > 0 && it >= INFLIGHT) {  // copy it - INFLIGHT has landed
            const int back = it - INFLIGHT;
            tma_bar_wait(tma_smem_u32(&ring.full[back % STAGES]), (back / STAGES) & 1);
          }
          tma_bar_wait(tma_smem_u32(&ring.empty[s]), ((it / STAGES) & 1) ^ 1);
          tma_bar_expect(f, W_STAGE);
          if constexpr (GATED) {
            tma_load_2d(tma_smem_u32(sm + s * SLOT), tw, f, s_k * QB_ROW_BYTES, row0);
            tma_load_2d(tma_smem_u32(sm + s * SLOT + W_STAGE / 2), tw, f, s_k * QB_ROW_BYTES, row1);
          } else {
            tma_load_2d(tma_smem_u32(sm + s * SLOT), tw, f, s_k * QB_ROW_BYTES, row0);
          }
        }
      }
      if (LAST && HOLD && it > 0) tma_bar_wait(tma_smem_u32(&ring.empty[(it - 1) % STAGES]), ((it - 1) / STAGES) & 1);
      ring.it = it;
    }
    __syncwarp();
    return;
  }
  if (int(blockIdx.x) < items) {  // the first item's K run (the last run may be shorter)
    const int s0 = (int(blockIdx.x) % ks_n) * run;
    src.preload((long long)s0 * SK, (s0 + run < steps ? run : steps - s0) * WPS);
  }
  if constexpr (FIRST) {
    pdl_enter();  // x (and the norm's operands) may come from the previous kernel
  } else {
    qb_grid_barrier(ring);  // every block's outputs of the phases before are in
  }
  const int g = lane >> 2, c = lane & 3;
  const bool active = warp < WP;  // a warp of the phase's tiles (the others only take its stages)
  const int r_lo = GATED ? 8 * warp + g : 16 * warp + g, r_hi = GATED ? OUTS + r_lo : r_lo + 8;
  const int groups = BITS == 4 ? K / SK : 1;
  const unsigned char* wrow_lo = sm + r_lo * QB_ROW_BYTES + 16 * c;
  const unsigned char* wrow_hi = sm + r_hi * QB_ROW_BYTES + 16 * c;
  const long long yn = y.stride[R - 1];
  auto put = [&](int n, float v) {
    if (n >= N) return;
    if constexpr (HAS_BIAS) v += __half2float(bias[n * bias_stride]);
    store(y.p + n * yn, v);
  };
  auto put_pair = [&](int j, float za, float zb) {
    if (j >= outs) return;
    if constexpr (HAS_BIAS) {
      za += __half2float(bias[epi.row_a(j, N) * bias_stride]);
      zb += __half2float(bias[epi.row_b(j, N) * bias_stride]);
    }
    epi.put(y.p, yn, 0, j, lin_round<__half>(za), lin_round<__half>(zb));
  };
  int it = ring.it, staged = -1;  // staged: the first K step of the x in shared memory (-1: none yet)
  for (int i = blockIdx.x; i < items; i += gridDim.x) {
    const int t = i / ks_n, s0 = (i % ks_n) * run, s1 = s0 + run < steps ? s0 + run : steps;
    const int iters = s1 > s0 ? s1 - s0 : 0;
    if (s0 != staged) {
      if (staged < 0) {
        src.template prepare<W>(K, src_buf);  // QbNorm: h over all of K, once a phase
      } else {
        asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");  // every warp is done with the previous x
      }
      qb_stage_x<W, BITS, OFS>(src, s0, iters, xs, corr);
      staged = s0;
    }
    const int n_lo = GATED ? int(epi.row_a(t * OUTS, N)) + r_lo : t * OUTS + r_lo;
    const int n_hi = GATED ? int(epi.row_b(t * OUTS, N)) + r_lo : n_lo + 8;
    const __half* sc_lo = scale + (long long)(n_lo < N ? n_lo : N - 1) * groups;
    const __half* sc_hi = scale + (long long)(n_hi < N ? n_hi : N - 1) * groups;
    float acc_lo = 0.f, acc_hi = 0.f;
    for (int j = 0; j < iters; ++j, ++it) {
      const int s = it % STAGES;
      if (WP < W && !active) {  // warp-uniform: take the stage, release it
        tma_bar_wait(tma_smem_u32(&ring.full[s]), (it / STAGES) & 1);
        __syncwarp();
        if (lane == 0) tma_bar_arrive(tma_smem_u32(&ring.empty[s]));
        continue;
      }
      const float slo = BITS == 4 ? __half2float(sc_lo[s0 + j]) : 1.f;
      const float shi = BITS == 4 ? __half2float(sc_hi[s0 + j]) : 1.f;
      tma_bar_wait(tma_smem_u32(&ring.full[s]), (it / STAGES) & 1);
      const uint4 wlo = *reinterpret_cast<const uint4*>(wrow_lo + s * SLOT);
      const uint4 whi = *reinterpret_cast<const uint4*>(wrow_hi + s * SLOT);
      __syncwarp();
      if (lane == 0) tma_bar_arrive(tma_smem_u32(&ring.empty[s]));
      float part[4];
      qb_stage_dot<BITS, OFS>(part, wlo, whi, xs + j * WPS * 16, c, OFS ? -corr[j] : 0.f);
      acc_lo = fmaf(slo, part[0], acc_lo);
      acc_hi = fmaf(shi, part[2], acc_hi);
    }
    if constexpr (BITS == 8) {
      acc_lo *= __half2float(sc_lo[0]);
      acc_hi *= __half2float(sc_hi[0]);
    }
    if (ks_n == 1) {
      if (active && c == 0) {
        if constexpr (GATED) {
          put_pair(t * OUTS + r_lo, acc_lo, acc_hi);
        } else {
          put(n_lo, acc_lo);
          put(n_hi, acc_hi);
        }
      }
      continue;
    }
    // the K split: the runs' sums meet in ws (slot i: the item), the tile's last run stores them
    if (active && c == 0) {
      ws[(long long)i * ROWS + r_lo] = acc_lo;
      ws[(long long)i * ROWS + r_hi] = acc_hi;
    }
    __threadfence();
    asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
    if (threadIdx.x == 0) last = atomicAdd(cnt + t, 1u) == unsigned(ks_n - 1);
    asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
    if (!last) continue;
    __threadfence();
    float* tot = ws + (long long)t * ks_n * ROWS;
    for (int r = threadIdx.x; r < ROWS; r += 32 * W) {
      float sum = 0.f;
      for (int k = 0; k < ks_n; ++k) sum += __ldcg(tot + (long long)k * ROWS + r);
      if constexpr (GATED) {
        tot[r] = sum;
      } else {
        put(t * ROWS + r, sum);
      }
    }
    if constexpr (GATED) {
      asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");
      for (int r = threadIdx.x; r < OUTS; r += 32 * W) put_pair(t * OUTS + r, __ldcg(tot + r), __ldcg(tot + OUTS + r));
    }
    if (threadIdx.x == 0) cnt[t] = 0u;
    asm volatile("bar.sync 1, %0;" ::"n"(32 * W) : "memory");  // `last` and tot are read before the next item's
  }
  ring.it = it;
#endif
}

}  // namespace atlas
