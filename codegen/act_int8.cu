// Decode projections with int8 activations (codegen/act_int8.py; references w4a8_matmul / w8a8_matmul in
// atlasc/ir/ops/quant.py): LinearQ4 / LinearQ8 with act = "int8". Every block first quantizes the M <= 8
// rows of x to int8 in shared memory (act8_quantize: one warp per row), then a warp per output streams
// that output's weight row and accumulates dp4a products in int32: per group for int4 (linear_w4a8),
// over the whole row for int8 (linear_w8a8). Uses quant.cu (qlin_row, QLIN_WARPS) and linear.cu (the
// paired epilogues, lin_round, warp_sum).

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

// W8A8: a warp per output (paired: per pair); lane chunks c = 32 i + lane of 16 bytes (16 k), dp4a of the
// int8 weights and x_q in int32 over the lane's chunks, the warp's lanes added (exact: |dot| <= K * 127^2
// < 2^31 for K < 133144), then y = float32(float32(dot) * scale[n]) * s_x (+ bias), each step rounded to
// float32 as the reference does, rounded to T.
template <typename T, int R, int MT, int U, bool HAS_BIAS, typename EPI = LinNoEpi>
__device__ __forceinline__ void linear_w8a8(const int* xw, const float* sx, const signed char* __restrict__ wq,
                                            const __half* __restrict__ scale, const T* __restrict__ bias,
                                            long long bias_stride, const View<T, R>& y, long long M, long long N,
                                            long long K, EPI epi = EPI()) {
  constexpr bool PAIRED = lin_gated<EPI>();
  constexpr int F = PAIRED ? 2 : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long chunks = K / 16, words = K / 4;
  const long long outs = PAIRED ? N / 2 : N;
  for (long long o = (long long)blockIdx.x * QLIN_WARPS + warp; o < outs; o += (long long)gridDim.x * QLIN_WARPS) {
    long long rows[F];
    rows[0] = PAIRED ? epi.row_a(o, N) : o;
    if constexpr (PAIRED) rows[F - 1] = epi.row_b(o, N);
    int dot[F][MT];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
      for (int m = 0; m < MT; ++m) dot[f][m] = 0;
    for (long long c0 = lane; c0 < chunks; c0 += 32 * U) {
      int4 w[U][F];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const long long c = c0 + 32 * u;
#pragma unroll
        for (int f = 0; f < F; ++f)
          w[u][f] = c < chunks ? __ldg(reinterpret_cast<const int4*>(wq + rows[f] * K) + c) : make_int4(0, 0, 0, 0);
      }
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
