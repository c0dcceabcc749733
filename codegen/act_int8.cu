// Decode projections with int8 activations (codegen/act_int8.py; references w4a8_matmul / w8a8_matmul in
// atlasc/ir/ops/quant.py): LinearQ4 / LinearQ8 with act = "int8". Every block first quantizes the M <= 8
// rows of x to int8 in shared memory (act8_quantize: one warp per row), then a warp per output streams
// that output's weight row and accumulates dp4a products in int32: per group for int4 (linear_w4a8),
// over the whole row for int8 (linear_w8a8). W4A8 with groups of 128k also has a tensor-core kernel
// (linear_w4a8_mma, below: the block quantizes x itself after its first weight loads, then int8 mma.sync),
// which act_int8.py emits first where it applies. Uses quant.cu (qlin_row, QLIN_WARPS, the stores of its
// tensor-core path) and linear.cu (the paired epilogues, lin_round, warp_sum).

namespace atlas {

// c + the 4 products of a's unsigned bytes (int4 codes 0..15) and b's signed bytes (x_q)
__device__ __forceinline__ int w4a8_dp4a_us(unsigned a, int b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// clip(rint(v * inv), -127, 127): the float32 product rounded to nearest, then to the nearest integer
// (ties to even), as quantize_rows_int8 computes it
__device__ __forceinline__ unsigned w4a8_q(float v, float inv) {
  const int q = __float2int_rn(__fmul_rn(v, inv));
  return unsigned(min(127, max(-127, q))) & 0xFFu;
}

// rows m < M of x -> xw (int8 words, K / 4 per row); sx[m] = amax / 127. Ends with a barrier. NIBBLES
// (int4 weights) puts them in dp4a order for the packed codes: the 8 k of weight word j (k = 8j .. 8j + 7:
// byte b holds k = 8j + 2b in its low nibble, 8j + 2b + 1 in its high one) meet word 2j (x_q at the even
// k, byte b = k 8j + 2b) and word 2j + 1 (the odd k); else word j holds k = 4j .. 4j + 3 in order.
template <typename T, int R, bool NIBBLES>
__device__ __forceinline__ void act8_quantize(const View<T, R>& x, long long M, long long K, int* xw, float* sx) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long xk = x.stride[R - 1];
  for (long long m = warp; m < M; m += QLIN_WARPS) {
    const T* row = x.p + qlin_row(x, m);
    float amax = 0.f;
    for (long long k = lane; k < K; k += 32) amax = fmaxf(amax, fabsf(float(row[k * xk])));
#pragma unroll
    for (int o = 16; o; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
    if (lane == 0) sx[m] = __fdiv_rn(amax, 127.f);
    int* out = xw + m * (K / 4);
    for (long long j = lane; j < K / 8; j += 32) {
      const T* v = row + 8 * j * xk;
      unsigned e = 0u, o = 0u;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        e |= w4a8_q(float(v[(NIBBLES ? 2 * b : b) * xk]), inv) << (8 * b);
        o |= w4a8_q(float(v[(NIBBLES ? 2 * b + 1 : b + 4) * xk]), inv) << (8 * b);
      }
      out[2 * j] = int(e);
      out[2 * j + 1] = int(o);
    }
  }
  __syncthreads();
}

// one weight word u (8 int4 codes) against its x words xe (even k) and xo (odd k)
__device__ __forceinline__ int w4a8_word(unsigned u, int xe, int xo, int d) {
  d = w4a8_dp4a_us(u & 0x0F0F0F0Fu, xe, d);
  return w4a8_dp4a_us((u >> 4) & 0x0F0F0F0Fu, xo, d);
}

// output o's value(s) for row m (v: one per weight row, + bias), from lane 0: y[m, o], or the paired epilogue
template <typename T, int R, int F, typename EPI>
__device__ __forceinline__ void act8_put(const View<T, R>& y, long long m, long long o, const float (&v)[F],
                                         const EPI& epi) {
  if ((threadIdx.x & 31) != 0) return;
  if constexpr (lin_gated<EPI>()) {
    epi.put(y.p + qlin_row(y, m), y.stride[R - 1], m, o, lin_round<T>(v[0]), lin_round<T>(v[F - 1]));
  } else {
    store(y.p + qlin_row(y, m) + o * y.stride[R - 1], v[0]);
  }
}

// The GEMV over the staged rows: a warp per output (paired epilogue: per pair, weight rows epi.row_a and
// epi.row_b); lane chunks c = 32 i + lane of 16 bytes (32 k of group c / L, L = G / 32 lanes per group,
// U chunks in flight). Per row: the chunk's int32 dot of codes and x_q minus z times the chunk's sum of
// x_q (z = 8, or the group's zero point), summed over the group's L lanes by shuffles (exact), then one
// float32 FMA with the group's scale by the group's first lane; y = s_x * warp sum (+ bias), rounded to T.
template <typename T, int R, int MT, int G, int U, bool HAS_BIAS, bool ZP, typename EPI = LinNoEpi>
__device__ __forceinline__ void linear_w4a8(const int* xw, const float* sx, const unsigned char* __restrict__ wq,
                                            const __half* __restrict__ scale, const T* __restrict__ bias,
                                            long long bias_stride, const View<T, R>& y, long long M, long long N,
                                            long long K, const unsigned char* __restrict__ zero = nullptr,
                                            EPI epi = EPI()) {
  constexpr bool PAIRED = lin_gated<EPI>();
  constexpr int F = PAIRED ? 2 : 1;
  constexpr int L = G / 32;
  static_assert(G % 32 == 0 && L <= 32 && (L & (L - 1)) == 0, "W4A8: G must be 32 x a power of two <= 1024");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long chunks = K / 32, row_bytes = K / 2, groups = K / G, words = K / 4;
  const long long outs = PAIRED ? N / 2 : N;
  for (long long o = (long long)blockIdx.x * QLIN_WARPS + warp; o < outs; o += (long long)gridDim.x * QLIN_WARPS) {
    long long rows[F];
    rows[0] = PAIRED ? epi.row_a(o, N) : o;
    if constexpr (PAIRED) rows[F - 1] = epi.row_b(o, N);
    float acc[F][MT];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
      for (int m = 0; m < MT; ++m) acc[f][m] = 0.f;
    for (long long c0 = 0; c0 < chunks; c0 += 32 * U) {
      uint4 w[U][F];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long c = c0 + 32 * u + lane;
#pragma unroll
        for (int f = 0; f < F; ++f)
          w[u][f] = c < chunks ? __ldg(reinterpret_cast<const uint4*>(wq + rows[f] * row_bytes) + c)
                               : make_uint4(0u, 0u, 0u, 0u);
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long cu = c0 + 32 * u;  // warp-uniform: every lane shuffles below
        if (cu >= chunks) break;
        const long long c = cu + lane;
        const bool live = c < chunks;  // a group's L lanes are all live or all dead (L divides 32)
        const long long g = (live ? c : cu) / L;
        int zf[F];
#pragma unroll
        for (int f = 0; f < F; ++f) zf[f] = ZP && live ? int(__ldg(zero + rows[f] * groups + g)) : 8;
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m >= M) break;  // block-uniform
          int4 xa = make_int4(0, 0, 0, 0), xb = xa;
          if (live) {
            const int4* xp = reinterpret_cast<const int4*>(xw + m * words + 8 * c);
            xa = xp[0];
            xb = xp[1];
          }
          int xs = __dp4a(xa.x, 0x01010101, 0);
          xs = __dp4a(xa.y, 0x01010101, xs);
          xs = __dp4a(xa.z, 0x01010101, xs);
          xs = __dp4a(xa.w, 0x01010101, xs);
          xs = __dp4a(xb.x, 0x01010101, xs);
          xs = __dp4a(xb.y, 0x01010101, xs);
          xs = __dp4a(xb.z, 0x01010101, xs);
          xs = __dp4a(xb.w, 0x01010101, xs);
#pragma unroll
          for (int f = 0; f < F; ++f) {
            int d = w4a8_word(w[u][f].x, xa.x, xa.y, 0);
            d = w4a8_word(w[u][f].y, xa.z, xa.w, d);
            d = w4a8_word(w[u][f].z, xb.x, xb.y, d);
            d = w4a8_word(w[u][f].w, xb.z, xb.w, d);
            d -= zf[f] * xs;
#pragma unroll
            for (int off = 1; off < L; off <<= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
            if (live && (lane & (L - 1)) == 0)
              acc[f][m] = fmaf(float(d), __half2float(scale[rows[f] * groups + g]), acc[f][m]);
          }
        }
      }
    }
    float b[F];
#pragma unroll
    for (int f = 0; f < F; ++f) b[f] = HAS_BIAS ? float(load(bias + rows[f] * bias_stride)) : 0.f;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m >= M) break;
      float v[F];
#pragma unroll
      for (int f = 0; f < F; ++f) v[f] = __fmul_rn(warp_sum(acc[f][m]), sx[m]) + b[f];
      act8_put(y, m, o, v, epi);
    }
  }
}

// -- W4A8 on tensor cores (linear_w4a8_mma; sm80+, G % 128 == 0, K % 128 == 0, M <= 8) ---------------

// rows m < M of x -> int8 in xw (in act8_quantize's NIBBLES order or not), sx[m] = amax / 127, and, unless xs is
// nullptr, xs[m * K / 128 + t] = the sum of x_q over k 128 t .. 128 t + 127. K % 128 == 0. All the block's
// threads: 8-k chunks i = m * K / 8 + j spread over the block (pass 1: |x| maxima, half-warp max then a shared
// atomicMax on the float bits, exact and order-free; pass 2: quantize, write, the 16 chunks of a 128-k step
// summed by half-warp shuffles). smax: ACT8 max rows ints. The values and sx are act8_quantize's (same w4a8_q).
// Ends with a barrier.
template <typename T, int R, bool NIBBLES = true>
__device__ __forceinline__ void act8_quantize_block(const View<T, R>& x, long long M, long long K, int* xw, int* xs,
                                                    float* sx, int* smax) {
  const int lane = threadIdx.x & 31;
  const long long xk = x.stride[R - 1], words = K / 8, total = M * words;  // total % 16 == 0 (K % 128 == 0)
  if (threadIdx.x < M) smax[threadIdx.x] = 0;
  __syncthreads();
  auto load8 = [&](long long i, float (&v)[8]) {
    const long long m = i / words, k = (i - m * words) * 8;
    const T* p = x.p + qlin_row(x, m) + k * xk;
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = float(p[e * xk]);
  };
  for (long long i0 = 0; i0 < total; i0 += blockDim.x) {
    const long long i = i0 + threadIdx.x;
    float a = 0.f;
    if (i < total) {
      float v[8];
      load8(i, v);
#pragma unroll
      for (int e = 0; e < 8; ++e) a = fmaxf(a, fabsf(v[e]));
    }
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
    if (i < total && (lane & 15) == 0) atomicMax(smax + i / words, __float_as_int(a));  // |x| >= 0: int order
  }
  __syncthreads();
  for (long long i0 = 0; i0 < total; i0 += blockDim.x) {
    const long long i = i0 + threadIdx.x;
    int sum = 0;
    if (i < total) {
      const long long m = i / words;
      const float amax = __int_as_float(smax[m]);
      const float inv = amax > 0.f ? __fdiv_rn(127.f, amax) : 0.f;
      float v[8];
      load8(i, v);
      unsigned e = 0u, o = 0u;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        e |= w4a8_q(v[NIBBLES ? 2 * b : b], inv) << (8 * b);
        o |= w4a8_q(v[NIBBLES ? 2 * b + 1 : b + 4], inv) << (8 * b);
      }
      xw[2 * i] = int(e);  // row m's words start at m * K / 4 = 2 * m * words
      xw[2 * i + 1] = int(o);
      sum = __dp4a(int(e), 0x01010101, __dp4a(int(o), 0x01010101, 0));
    }
    if (xs == nullptr) continue;
#pragma unroll
    for (int o = 1; o < 16; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (i < total && (lane & 15) == 0) xs[i / 16] = sum;
  }
  if (threadIdx.x < M) sx[threadIdx.x] = __fdiv_rn(__int_as_float(smax[threadIdx.x]), 127.f);
  __syncthreads();
}

// d += A * B for one m16n8k32 tile, A unsigned bytes (int4 codes 0..15), B signed bytes (x_q), int32
__device__ __forceinline__ void w4a8_mma(int (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, int b0,
                                         int b1) {
#if __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// whether linear_w4a8_mma applies (block-uniform): sm80+, a 16-byte aligned wq, the rows of one block
template <int G> __device__ __forceinline__ bool w4a8_mma_ok(const unsigned char* wq, long long M, long long K) {
#if __CUDA_ARCH__ >= 800
  return G % 128 == 0 && K % 128 == 0 && M <= 8 && M >= 1 && K < (1LL << 30) &&
         reinterpret_cast<uintptr_t>(wq) % 16 == 0;
#else
  return false;
#endif
}

// W4A8 decode on tensor cores. Items and warps as linear_quant_mma at J = 1 (an item: F = 8 / S blocks of 16
// features, or of 8 pairs when paired; S ways of split-K, U 128-k steps in flight per warp). A step: lane
// (g, c) streams 16 bytes of rows g and g + 8 (k 32c .. 32c+31 of the step); each of its 4 words w (k 8w ..
// 8w+7 of the lane's 32) becomes two A registers per row, the even-k codes (u & 0x0F0F0F0F) and the odd-k
// ones ((u >> 4) & 0x0F0F0F0F), and meets x words 2j and 2j + 1 (j the global 8-k word: act8 NIBBLES
// order) of x row g as B: one m16n8k32 u8 x s8 product per word, exact in int32. Per step (inside one
// group): float(dot - z * xs) * scale (z = 8 or the group's zero point), summed in float32; at the end times
// sx of the column's x row, then the stores of linear_quant_mma (qlin_store: bias,
// one rounding). The block first loads its first U steps, then runs pro() (a fused norm's staging, or
// nothing) and quantizes x (act8_quantize_block), so the weight reads overlap both.
template <typename T, int R, int G, int S, int U, bool HAS_BIAS, bool ZP, typename PRO, typename EPI = LinNoEpi>
__device__ __forceinline__ void linear_w4a8_mma(const View<T, R>& x, PRO pro, int* xw, int* xs, float* sx, int* smax,
                                                float* red, const unsigned char* __restrict__ wq,
                                                const __half* __restrict__ scale, const T* __restrict__ bias,
                                                long long bias_stride, const View<T, R>& y, long long M, long long N,
                                                long long K, const unsigned char* __restrict__ zero = nullptr,
                                                EPI epi = EPI()) {
  constexpr bool GATED = lin_gated<EPI>();
  constexpr int FB = GATED ? 8 : 16, F = QLIN_WARPS / S;
  static_assert(G % 128 == 0, "W4A8 tensor cores: a 128-k step inside one group");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int fb = warp / S, ks = warp % S;
  const int steps = int(K / 128), groups = int(K / G), n_rows = int(N), m_rows = int(M);
  const long long row_bytes = K / 2, yn = y.stride[R - 1];
  const int H = n_rows / 2, outs = GATED ? H : n_rows;
  const long long items = ((outs + FB - 1) / FB + F - 1) / F;
  const int mx = min(g, m_rows - 1);  // this lane's B column: x row g (rows >= M repeat the last, not stored)
  uint4 wlo[U], whi[U];
  __half slo[U], shi[U];
  unsigned char zlo[U], zhi[U];
  int r0 = 0, r1 = 0;
  auto rows_of = [&](long long item) {
    const int n0 = int(item) * (FB * F) + FB * fb;
    r0 = GATED ? int(epi.row_a(min(n0 + g, H - 1), n_rows)) : min(n0 + g, n_rows - 1);
    r1 = GATED ? int(epi.row_b(min(n0 + g, H - 1), n_rows)) : min(n0 + g + 8, n_rows - 1);
    return n0;
  };
  auto load = [&](int s) {  // quant.cu's loads of U steps (G % 128 == 0: a step's group is st * 128 / G)
    qlin_load_steps<4, G, S, U, true, ZP>(wlo, whi, slo, shi, zlo, zhi, wq + r0 * row_bytes + 16 * c,
                                          wq + r1 * row_bytes + 16 * c, scale + (long long)r0 * groups,
                                          scale + (long long)r1 * groups, ZP ? zero + (long long)r0 * groups : nullptr,
                                          ZP ? zero + (long long)r1 * groups : nullptr, s, steps, c);
  };
  bool loaded = false;  // the first U steps of the block's first item, read before x is ready
  if (blockIdx.x < items && rows_of(blockIdx.x) < outs) {
    load(ks);
    loaded = true;
  }
  pro();
  act8_quantize_block<T, R>(x, M, K, xw, xs, sx, smax);
  const int* xrow = xw + (long long)mx * (K / 4) + 8 * c;  // + 2 j for the step's words: j = 16 st + 4 c + w
  // the step sums of x_q of this lane's C columns 2c, 2c + 1 (x rows, the last repeated past M)
  const int* xs0 = xs + (long long)min(2 * c, m_rows - 1) * steps;
  const int* xs1 = xs + (long long)min(2 * c + 1, m_rows - 1) * steps;
  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    const int n0 = rows_of(item), nb0 = int(item) * (FB * F);
    float acc[1][4] = {{0.f, 0.f, 0.f, 0.f}};
    if (n0 < outs) {  // warp-uniform
      for (int s = ks; s < steps; s += S * U) {
        if (!loaded) load(s);
        loaded = false;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int st = s + S * u;
          if (st >= steps) break;
          int d[4] = {0, 0, 0, 0};
          const unsigned ulo[4] = {wlo[u].x, wlo[u].y, wlo[u].z, wlo[u].w};
          const unsigned uhi[4] = {whi[u].x, whi[u].y, whi[u].z, whi[u].w};
          const int4 xa = *reinterpret_cast<const int4*>(xrow + 32 * st);
          const int4 xb = *reinterpret_cast<const int4*>(xrow + 32 * st + 4);
          const int xe[4] = {xa.x, xa.z, xb.x, xb.z}, xo[4] = {xa.y, xa.w, xb.y, xb.w};
#pragma unroll
          for (int w = 0; w < 4; ++w)
            w4a8_mma(d, ulo[w] & 0x0F0F0F0Fu, uhi[w] & 0x0F0F0F0Fu, (ulo[w] >> 4) & 0x0F0F0F0Fu,
                     (uhi[w] >> 4) & 0x0F0F0F0Fu, xe[w], xo[w]);
          // C: d0, d1 = row g, columns 2c, 2c + 1; d2, d3 = row g + 8
          const int s0 = xs0[st], s1 = xs1[st];
          const float a = __half2float(slo[u]), b = __half2float(shi[u]);
          acc[0][0] = fmaf(float(d[0] - int(zlo[u]) * s0), a, acc[0][0]);
          acc[0][1] = fmaf(float(d[1] - int(zlo[u]) * s1), a, acc[0][1]);
          acc[0][2] = fmaf(float(d[2] - int(zhi[u]) * s0), b, acc[0][2]);
          acc[0][3] = fmaf(float(d[3] - int(zhi[u]) * s1), b, acc[0][3]);
        }
      }
      const float x0 = sx[min(2 * c, m_rows - 1)], x1 = sx[min(2 * c + 1, m_rows - 1)];
      acc[0][0] *= x0;
      acc[0][1] *= x1;
      acc[0][2] *= x0;
      acc[0][3] *= x1;
    }
    loaded = false;  // also when the warp had no steps
    qlin_store<T, R, 4, 1, S, HAS_BIAS>(acc, red, scale, bias, bias_stride, y, yn, nb0, n0, 0, n_rows, m_rows, F, epi);
  }
}

// W8A8: a warp per output (paired: per pair); lane chunks c = 32 i + lane of 16 bytes (16 k), dp4a of the
// int8 weights and x_q in int32 over the lane's chunks, the warp's lanes added (exact: |dot| <= K * 127^2
// < 2^31 for K < 133144), then y = float32(float32(dot) * scale[n]) * s_x (+ bias), each step rounded to
// float32 as the reference does, rounded to T. PRE (linear.cu's LinPro): the warp's first round of weights is
// loaded first, then the block runs pre() (a fused norm's staging and the quantization of x into xw / sx:
// act_int8.py's early form), so those loads overlap it; LinNoPro: the caller quantized x before the call.
template <typename T, int R, int MT, int U, bool HAS_BIAS, typename EPI = LinNoEpi, typename PRE = LinNoPro>
__device__ __forceinline__ void linear_w8a8(const int* xw, const float* sx, const signed char* __restrict__ wq,
                                            const __half* __restrict__ scale, const T* __restrict__ bias,
                                            long long bias_stride, const View<T, R>& y, long long M, long long N,
                                            long long K, EPI epi = EPI(), PRE pre = PRE()) {
  constexpr bool PAIRED = lin_gated<EPI>();
  constexpr int F = PAIRED ? 2 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long chunks = K / 16, words = K / 4;
  const long long outs = PAIRED ? N / 2 : N;
  const long long o0 = (long long)blockIdx.x * QLIN_WARPS + warp;
  auto load_round = [&](const long long (&rows)[F], long long c0, int4 (&w)[U][F]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const long long c = c0 + 32 * u;
#pragma unroll
      for (int f = 0; f < F; ++f) {
        const int4* p = reinterpret_cast<const int4*>(wq + rows[f] * K) + c;
        if constexpr (QLIN_L2_HINT) {
          const uint4 v = c < chunks ? lin_ld_stream_l2(p) : make_uint4(0u, 0u, 0u, 0u);
          w[u][f] = make_int4(int(v.x), int(v.y), int(v.z), int(v.w));
        } else {
          w[u][f] = c < chunks ? __ldg(p) : make_int4(0, 0, 0, 0);
        }
      }
    }
  };
  int4 w[U][F];
  bool loaded = false;
  if constexpr (PRE::EARLY) {
    if (o0 < outs) {
      long long rows[F];
      rows[0] = PAIRED ? epi.row_a(o0, N) : o0;
      if constexpr (PAIRED) rows[F - 1] = epi.row_b(o0, N);
      load_round(rows, lane, w);
      loaded = true;
    }
    pre();  // every thread (it ends with a barrier)
  }
  for (long long o = o0; o < outs; o += (long long)gridDim.x * QLIN_WARPS) {
    long long rows[F];
    rows[0] = PAIRED ? epi.row_a(o, N) : o;
    if constexpr (PAIRED) rows[F - 1] = epi.row_b(o, N);
    int dot[F][MT];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
      for (int m = 0; m < MT; ++m) dot[f][m] = 0;
    for (long long c0 = lane; c0 < chunks; c0 += 32 * U) {
      if (!loaded) load_round(rows, c0, w);
      loaded = false;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long c = c0 + 32 * u;
        if (c >= chunks) break;  // per lane: no shuffles in this loop
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          if (m >= M) break;
          const int4 xv = *reinterpret_cast<const int4*>(xw + m * words + 4 * c);
#pragma unroll
          for (int f = 0; f < F; ++f) {
            int d = __dp4a(w[u][f].x, xv.x, dot[f][m]);
            d = __dp4a(w[u][f].y, xv.y, d);
            d = __dp4a(w[u][f].z, xv.z, d);
            dot[f][m] = __dp4a(w[u][f].w, xv.w, d);
          }
        }
      }
    }
    loaded = false;  // also when the lane had no chunks
    float b[F];
#pragma unroll
    for (int f = 0; f < F; ++f) b[f] = HAS_BIAS ? float(load(bias + rows[f] * bias_stride)) : 0.f;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m >= M) break;
      float v[F];
#pragma unroll
      for (int f = 0; f < F; ++f) {
        int d = dot[f][m];
#pragma unroll
        for (int off = 16; off; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
        v[f] = __fadd_rn(__fmul_rn(__fmul_rn(__int2float_rn(d), __half2float(scale[rows[f]])), sx[m]), b[f]);
      }
      act8_put(y, m, o, v, epi);
    }
  }
}

}  // namespace atlas
