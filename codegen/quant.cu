// LinearQ8 / LinearQ4 (see quant.py): y[..., N] = x[..., K] @ dequant(wq)^T (+ bias[N]).
//
// Layout: wq is a contiguous [N, row_bytes] constant: int8 [N, K] (row_bytes = K) or packed int4
// uint8 [N, K/2] (low nibble = even k, high nibble = odd k, value + 8); scale is float16 [N] (int8)
// or [N, K/G] (int4). x and y are Views whose leading dims flatten to M rows (any strides). int4 with
// zero points (asymmetric, ZP): zero is uint8 [N, K/G] in [0, 15] and the nibble is the unsigned code,
// w = (nibble - zero) * scale; symmetric is the same with zero = 8 everywhere.
//
// Tensor-core path (linear_quant_mma; float16 x, sm80+, checked at run time by qlin_mma_ok):
// mma.sync m16n8k16 (fp16 in, fp32 accumulate) with A = 16 weight rows x 16 k, B = 16 k x 8 rows of
// x, as linear_mma_decode in linear.cu. A warp step covers 16 rows x 64 bytes: lane (g = lane / 4,
// c = lane % 4) streams one 16-byte load (ld.global.nc.L1::no_allocate) of each of rows n0 + g and
// n0 + g + 8 at byte 16c of the step, i.e. 32 int4 weights (k 32c .. 32c+31 of a 128-k step) or 16
// int8 weights (k 16c .. 16c+15 of a 64-k step), and reads x row 8j + g at the same k through L1.
// Dequantization in registers, exact (the fp16 A operands are the integers q themselves):
// - int4: a 32-bit word holds k 0..7; (u & 0x000F000F) | 0x64006400 is the half2 (1024 + n_k0,
//   1024 + n_k4), minus 1032 = q exactly; the high nibbles (mask 0x00F000F0: 1024 + 16 n) take an
//   fma by 1/16 and -72; u >> 8 gives k 2, 3, 6, 7. A word yields the pairs (k0, k4), (k1, k5),
//   (k2, k6), (k3, k7): 9 instructions per 8 weights. With zero points the constants 1032 and 72 become
//   1024 + z and 64 + z (z in [0, 15]: nibble - z in [-15, 15], still exact), per row and group.
// - int8: u ^ 0x80808080 makes the bytes q + 128; __byte_perm with 0x64 high bytes builds the half2
//   (1024 + q + 128) of bytes (0, 2) and (1, 3), minus 1152 = q exactly: 5 instructions per 4 weights.
// Inside one k16 tile the k order is free as long as A and B agree: the fragment slots (2c, 2c+1 |
// 2c+8, 2c+9) hold the pairs above, and the x halves are paired the same way with __byte_perm (x is
// loaded 16 bytes at a time, in k order). Products q * x are exact in the fp32 accumulator:
// - int8 / fp8: acc = sum_k q x per row, times scale[n] in float32 at the end;
// - int4 with G % 128 == 0 (a 128-k step inside one group): each step's mma chain starts from zero
//   and is added as acc += scale[n, group] * part in float32;
// - int4 with G % 128 != 0 (G % 32 == 0: a lane's 32 k inside one group): the A operand is the fp16
//   product q * scale (mul.rn.f16x2), one rounding per weight (relative error <= 2^-11, far inside
//   the float16 output's own rounding and the tests' tolerance), then one fp32 accumulation.
// Only the summation order differs from the float32 reference otherwise; bias in float32, one rounding
// at the store. Work split: an item is F = 8 / S blocks of 16 features x 8J rows of x; the block's 8
// warps are F feature blocks x S ways of split-K (interleaved steps, U steps of loads in flight per
// warp), the S partial fragments summed through shared memory in warp order (deterministic). Blocks
// loop grid-stride over items (feature blocks major, then 8J-row tiles of M: M > 8J re-reads a block's
// weights, from L2). Weight rows n >= N read row N-1 and x rows m >= M read row M-1; neither is stored.
// KS > 1 (plain projections at S = 8 with fewer N / 16 blocks than SMs, quant.py quant_ks): K is also split
// across ks_n blocks, each taking one contiguous run of the steps; the partial sums meet in the scratch
// (qlin_split_store, as linear_mma_decode's K split in linear.cu).
// The path needs float16 x with unit stride along K and 16-byte aligned rows, a 16-byte aligned wq,
// K % 128 == 0 (int4) or K % 64 == 0 (int8); the emitter also requires G % 32 == 0 for int4.
//
// - fp8 (LinearF8, the int8 layout holding E4M3 codes): cvt.rn.f16x2.e4m3x2 (cuda_fp8.h) gives the same
//   (k0, k2), (k1, k3) pairs, exact (every E4M3 value is a float16); the per-channel scale as for int8.
// Fallback (linear_quant: float32 x, other K / G, misaligned pointers, strided x; E4M3 codes decode
// through cuda_fp8.h there too):
// one warp per output feature (warps loop grid-stride over features): its lanes walk the packed row
// with 16-byte loads (scalar byte loads when the row is not 16-byte aligned), dequantize in registers
// (int8 -> float * scale; nibble -> (v - 8) * group scale: exact in float32, as the reference), and
// accumulate QM rows of x at a time in float32; a warp-shuffle reduce, the bias in float32, one
// rounding at the store. Rows of x are processed QM at a time, so any M is correct (large M re-reads
// the weights M / QM times: the prefill speed of this kernel is not tuned).
namespace atlas {

constexpr int QLIN_THREADS = 256;
constexpr int QLIN_WARPS = QLIN_THREADS / 32;
constexpr int QLIN_QM = 4;
// the int8 / fp8 weight loads of the tensor-core path and of linear_w8a8 (act_int8.cu) go through lin_ld_stream_l2
// (quant.py l2_hint, on by default; ATLAS_INT8_L2_HINT=0: the prelude defines ATLAS_INT8_L2_OFF, the plain loads)
#ifdef ATLAS_INT8_L2_OFF
constexpr bool QLIN_L2_HINT = false;
#else
constexpr bool QLIN_L2_HINT = true;
#endif

// an FP8 E4M3 code as float (exact: every E4M3 value is a float16; cuda_fp8.h, hardware on sm89+)
__device__ __forceinline__ float e4m3_to_float(unsigned int byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(byte), __NV_E4M3)));
}

// accumulate the weights of one byte of the row (byte index j) into acc for the QM rows; F8: the byte
// is an E4M3 code (LinearF8) instead of an int8
template <typename T, int BITS, bool F8 = false>
__device__ __forceinline__ void qlin_byte(float (&acc)[QLIN_QM], unsigned int byte, long long j, float s8,
                                          const __half* __restrict__ srow, const unsigned char* __restrict__ zrow,
                                          long long G, const T* __restrict__ x,
                                          const long long (&xoff)[QLIN_QM], long long xk, int rows) {
  if constexpr (BITS == 8) {
    const float w = (F8 ? e4m3_to_float(byte) : float(static_cast<signed char>(byte))) * s8;
#pragma unroll
    for (int m = 0; m < QLIN_QM; ++m)
      if (m < rows) acc[m] = fmaf(w, float(load(x + xoff[m] + j * xk)), acc[m]);
  } else {
    const long long k = 2 * j;  // k and k + 1 share a group (G is even)
    const float s = __half2float(srow[k / G]);
    const int z = zrow ? int(zrow[k / G]) : 8;  // zero point (asymmetric) or the symmetric offset 8
    const float w0 = float(int(byte & 15u) - z) * s;
    const float w1 = float(int(byte >> 4) - z) * s;
#pragma unroll
    for (int m = 0; m < QLIN_QM; ++m)
      if (m < rows) {
        acc[m] = fmaf(w0, float(load(x + xoff[m] + k * xk)), acc[m]);
        acc[m] = fmaf(w1, float(load(x + xoff[m] + (k + 1) * xk)), acc[m]);
      }
  }
}

// one weight row (wr, its scales srow / zero points zrow, s8 the int8 / fp8 row scale) against the QM rows
// of x at xoff: acc[m] (not yet reduced across the warp)
template <typename T, int BITS, bool F8>
__device__ __forceinline__ void qlin_row_acc(float (&acc)[QLIN_QM], const unsigned char* __restrict__ wr,
                                             long long row_bytes, bool vec, float s8, const __half* __restrict__ srow,
                                             const unsigned char* __restrict__ zrow, long long G,
                                             const T* __restrict__ x, const long long (&xoff)[QLIN_QM], long long xk,
                                             int rows, int lane) {
#pragma unroll
  for (int m = 0; m < QLIN_QM; ++m) acc[m] = 0.f;
  if (vec) {
    for (long long v = lane; v < row_bytes / 16; v += 32) {
      const uint4 p = lin_ld_stream(wr + v * 16);
      const unsigned int u[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
      for (int i = 0; i < 16; ++i)
        qlin_byte<T, BITS, F8>(acc, (u[i / 4] >> (8 * (i % 4))) & 0xFFu, v * 16 + i, s8, srow, zrow, G, x, xoff, xk,
                               rows);
    }
  } else {
    for (long long j = lane; j < row_bytes; j += 32)
      qlin_byte<T, BITS, F8>(acc, wr[j], j, s8, srow, zrow, G, x, xoff, xk, rows);
  }
}

// the fallback; paired (EPI not LinNoEpi, see linear_gemv in linear.cu): warp-output p accumulates rows
// epi.row_a(p) and epi.row_b(p)
template <typename T, int R, int BITS, bool HAS_BIAS, bool F8 = false, typename EPI = LinNoEpi>
__device__ __forceinline__ void linear_quant(const View<T, R>& x, const unsigned char* __restrict__ wq,
                                             const __half* __restrict__ scale, const T* __restrict__ bias,
                                             long long bias_stride, const View<T, R>& y, long long M, long long N,
                                             long long K, long long G,
                                             const unsigned char* __restrict__ zero = nullptr, EPI epi = EPI()) {
  constexpr bool GATED = lin_gated<EPI>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long row_bytes = BITS == 8 ? K : K / 2;
  const long long groups = BITS == 8 ? 1 : K / G;
  const long long xk = x.stride[R - 1], yn = y.stride[R - 1];
  const long long H = N / 2, outs = GATED ? H : N;
  const bool vec = (row_bytes % 16 == 0) && (reinterpret_cast<uintptr_t>(wq) % 16 == 0);
  for (long long n = (long long)blockIdx.x * QLIN_WARPS + warp; n < outs; n += (long long)gridDim.x * QLIN_WARPS) {
    const long long na = GATED ? epi.row_a(n, N) : n, nu = GATED ? epi.row_b(n, N) : n;  // the pair's rows
    float b = 0.f, bu = 0.f;
    if constexpr (HAS_BIAS) {
      b = float(load(bias + na * bias_stride));
      if constexpr (GATED) bu = float(load(bias + nu * bias_stride));
    }
    for (long long m0 = 0; m0 < M; m0 += QLIN_QM) {
      const int rows = int(M - m0 < QLIN_QM ? M - m0 : QLIN_QM);
      long long xoff[QLIN_QM];  // y's row offsets are computed at the store (fewer live registers)
#pragma unroll
      for (int m = 0; m < QLIN_QM; ++m) xoff[m] = lin_row_offset(x, m0 + (m < rows ? m : 0));
      float acc[QLIN_QM];
      qlin_row_acc<T, BITS, F8>(acc, wq + na * row_bytes, row_bytes, vec, BITS == 8 ? __half2float(scale[na]) : 0.f,
                                scale + na * groups, zero ? zero + na * groups : nullptr, G, x.p, xoff, xk, rows, lane);
      if constexpr (GATED) {
        float up[QLIN_QM];
        qlin_row_acc<T, BITS, F8>(up, wq + nu * row_bytes, row_bytes, vec, BITS == 8 ? __half2float(scale[nu]) : 0.f,
                                  scale + nu * groups, zero ? zero + nu * groups : nullptr, G, x.p, xoff, xk, rows,
                                  lane);
#pragma unroll
        for (int m = 0; m < QLIN_QM; ++m) {
          const float sg = warp_sum(acc[m]) + b, su = warp_sum(up[m]) + bu;
          if (m < rows && lane == m) epi.put(y.p + lin_row_offset(y, m0 + m), yn, m0 + m, n, lin_round<T>(sg), lin_round<T>(su));
        }
      } else {
#pragma unroll
        for (int m = 0; m < QLIN_QM; ++m) {
          const float s = warp_sum(acc[m]);
          if (m < rows && lane == m) store(y.p + lin_row_offset(y, m0 + m) + n * yn, s + b);
        }
      }
    }
  }
}


// -- tensor-core path (see the header) ------------------------------------------------------------

constexpr int QLIN_STEP_BYTES = 64;  // bytes of one weight row per warp step (16 per lane c)

__device__ __forceinline__ unsigned qlin_hsub2(unsigned a, unsigned b) {
  unsigned r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ unsigned qlin_hfma2(unsigned a, unsigned b, unsigned c) {
  unsigned r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ unsigned qlin_hmul2(unsigned a, unsigned b) {
  unsigned r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// (low half of a, low half of b) and (high half of a, high half of b)
__device__ __forceinline__ unsigned qlin_lo(unsigned a, unsigned b) { return __byte_perm(a, b, 0x5410); }
__device__ __forceinline__ unsigned qlin_hi(unsigned a, unsigned b) { return __byte_perm(a, b, 0x7632); }

// 8 int4 of one row (u: k 0..7, byte b = k 2b low nibble, 2b+1 high) -> half2 pairs (k0, k4),
// (k1, k5), (k2, k6), (k3, k7) of nibble - z, exact: (1024 + n) - (1024 + z) and (1024 + 16 n) / 16 -
// (64 + z); sub2 / fma2 are the half2 constants (1024 + z, 1024 + z) and (-(64 + z), ...) of
// qlin_zero_consts (symmetric: z = 8, 0x64086408 and 0xD480D480)
// (a & MASK) | 0x64006400 in one LOP3: written as C, nvcc emits an AND and an OR (each LOP3 takes one
// immediate), 4 extra instructions per 8 weights in the decode loop (docs/perf.md v11)
template <unsigned MASK> __device__ __forceinline__ unsigned qlin_nibbles(unsigned a) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "r"(0x64006400u));  // (a & b) | c
  return r;
}

__device__ __forceinline__ void qlin_q4_pairs(unsigned u, unsigned (&p)[4], unsigned sub2 = 0x64086408u,
                                              unsigned fma2 = 0xD480D480u) {
  const unsigned v = u >> 8;
  p[0] = qlin_hsub2(qlin_nibbles<0x000F000Fu>(u), sub2);
  p[1] = qlin_hfma2(qlin_nibbles<0x00F000F0u>(u), 0x2C002C00u, fma2);
  p[2] = qlin_hsub2(qlin_nibbles<0x000F000Fu>(v), sub2);
  p[3] = qlin_hfma2(qlin_nibbles<0x00F000F0u>(v), 0x2C002C00u, fma2);
}

// the half2 constants of qlin_q4_pairs for zero point z in [0, 15]: 1024 + z is 0x6400 + z in float16
__device__ __forceinline__ void qlin_zero_consts(unsigned z, unsigned& sub2, unsigned& fma2) {
  sub2 = (0x6400u + z) * 0x10001u;
  fma2 = unsigned(__half_as_ushort(__float2half_rn(-(64.f + float(z))))) * 0x10001u;
}

// 4 int8 of one row (u: k 0..3) -> half2 q pairs (k0, k2), (k1, k3), exact: (1024 + q + 128) - 1152
__device__ __forceinline__ void qlin_q8_pairs(unsigned u, unsigned (&p)[2]) {
  const unsigned v = u ^ 0x80808080u;
  p[0] = qlin_hsub2(__byte_perm(v, 0x64646464u, 0x4240), 0x64806480u);
  p[1] = qlin_hsub2(__byte_perm(v, 0x64646464u, 0x4341), 0x64806480u);
}

// 4 E4M3 codes of one row (u: k 0..3) -> half2 pairs (k0, k2), (k1, k3), the order of qlin_q8_pairs;
// exact (every E4M3 value is a float16): cvt.rn.f16x2.e4m3x2 on sm89+, through cuda_fp8.h
__device__ __forceinline__ void qlin_f8_pairs(unsigned u, unsigned (&p)[2]) {
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(__byte_perm(u, 0u, 0x0020)), __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(__byte_perm(u, 0u, 0x0031)), __NV_E4M3);
  p[0] = unsigned(a.x) | (unsigned(a.y) << 16);
  p[1] = unsigned(b.x) | (unsigned(b.y) << 16);
}

// element offset of row m < M (row-major over the leading R-1 dims) of a View
template <typename T, int R> __device__ __forceinline__ long long qlin_row(const View<T, R>& v, long long m) {
  if constexpr (R == 1) {
    return 0;
  } else if constexpr (R == 2) {
    return m * v.stride[0];
  } else {
    return lin_row_offset(v, m);
  }
}

// whether the tensor-core path applies (see the header)
template <typename T, int R, int BITS>
__device__ __forceinline__ bool qlin_mma_ok(const View<T, R>& x, const unsigned char* wq, long long M, long long N,
                                            long long K) {
#if __CUDA_ARCH__ >= 800
  constexpr long long I32 = 1LL << 31;  // the path indexes rows and steps with int
  return LinVec<T>::MMA && K % (BITS == 4 ? 128 : 64) == 0 && M < I32 && N < I32 && K < I32 &&
         lin_rows_aligned(x, wq);
#else
  return false;
#endif
}

// 16 bytes of x: through the read-only cache, or (XSMEM: x staged in shared memory by a fused norm) a plain load
template <bool XSMEM, typename T> __device__ __forceinline__ uint4 qlin_ldx(const T* p) {
  if constexpr (XSMEM) {
    return *reinterpret_cast<const uint4*>(p);
  } else {
    return __ldg(reinterpret_cast<const uint4*>(p));
  }
}

// one int4 step: wlo / whi = 32 k of rows g / g + 8 (lane c's k 32c .. 32c+31 of the step), xr[j] + k
// the x row 8j + g at the same k. EXACT (G % 128 == 0): slo / shi are the rows' group scales (float),
// applied to the step's fp32 partial; otherwise s2lo / s2hi are half2 (s, s) multiplied into A.
template <typename T, int J, bool EXACT, bool XSMEM = false>
__device__ __forceinline__ void qlin_step4(float (&acc)[J][4], const uint4& wlo, const uint4& whi,
                                           const T* const (&xr)[J], int k, float slo, float shi,
                                           unsigned s2lo, unsigned s2hi, unsigned zsub_lo = 0x64086408u,
                                           unsigned zfma_lo = 0xD480D480u, unsigned zsub_hi = 0x64086408u,
                                           unsigned zfma_hi = 0xD480D480u) {
  float part[J][4];
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) part[j][q] = 0.f;
  const unsigned ulo[4] = {wlo.x, wlo.y, wlo.z, wlo.w}, uhi[4] = {whi.x, whi.y, whi.z, whi.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {  // word w: k 8w .. 8w+7 of the lane's 32
    unsigned plo[4], phi[4];
    qlin_q4_pairs(ulo[w], plo, zsub_lo, zfma_lo);
    qlin_q4_pairs(uhi[w], phi, zsub_hi, zfma_hi);
    if constexpr (!EXACT) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        plo[i] = qlin_hmul2(plo[i], s2lo);
        phi[i] = qlin_hmul2(phi[i], s2hi);
      }
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
      // x halves 8w .. 8w+7: (x0, x1) (x2, x3) (x4, x5) (x6, x7); tiles (k0, k4 | k1, k5), (k2, k6 | k3, k7)
      const uint4 xv = qlin_ldx<XSMEM>(xr[j] + k + 8 * w);
      float (&d)[4] = EXACT ? part[j] : acc[j];
      lin_mma(d, plo[0], phi[0], plo[1], phi[1], qlin_lo(xv.x, xv.z), qlin_hi(xv.x, xv.z));
      lin_mma(d, plo[2], phi[2], plo[3], phi[3], qlin_lo(xv.y, xv.w), qlin_hi(xv.y, xv.w));
    }
  }
  if constexpr (EXACT) {  // C fragment: c0, c1 on row g, c2, c3 on row g + 8
#pragma unroll
    for (int j = 0; j < J; ++j) {
      acc[j][0] = fmaf(slo, part[j][0], acc[j][0]);
      acc[j][1] = fmaf(slo, part[j][1], acc[j][1]);
      acc[j][2] = fmaf(shi, part[j][2], acc[j][2]);
      acc[j][3] = fmaf(shi, part[j][3], acc[j][3]);
    }
  }
}

// -- offset dequantization of one row of x (OFS: ATLAS_QUANT_OFS, quant.py ofs_applies) ----------------
// The int4 A operands skip qlin_q4_pairs' subtraction and fma: an even k's LOP3 pair holds 1024 + n and an odd
// k's 1024 + 16 n (n the stored nibble), multiplied by x and by x / 16 (exact in float16 down to |x| = 2^-10).
// qlin_ofs_stage writes x that way into shared memory, in fragment order, so one 16-byte load per word of 8 k
// feeds both MMAs of the word without byte permutes: (x0, x4) (x2, x6) (x1/16, x5/16) (x3/16, x7/16). A step's
// MMA chain then sums 1024 S_e + 64 S_o + sum n x (S_e / S_o: the x sums over the step's even / odd k), so it
// starts from -(1024 S_e + 64 S_o + z (S_e + S_o)) and ends at sum (n - z) x = sum q x. 5 instructions per 8
// weights instead of 9, none for x. Products stay exact; the chain's partial sums are ~1000x larger than the
// result, so its float32 rounding is larger too (measured against the default in docs/perf.md v26). (int8's form,
// one correction of -1152 sum x per row, was measured and removed: docs/perf.md v28.)
struct QlinNoOfs {
  static constexpr bool ON = false;
  __half* x = nullptr;
  float* corr = nullptr;
};
struct QlinOfs {
  static constexpr bool ON = true;
  __half* x;     // K halves, 16-byte aligned
  float* corr;   // per 128-k step: 1032 S_e + 72 S_o (symmetric), or (ZP) the pair 1024 S_e + 64 S_o, S_e + S_o
};

// the two halves of a half2 (as its bits), added in float32
__device__ __forceinline__ float qlin_half2_sum(unsigned u) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xFFFFu))) +
         __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16)));
}

// x row 0 (K halves at xp: unit stride, 16-byte aligned, K % 128 == 0) into ofs.x in the OFS order, and the
// steps' sums into ofs.corr; ends with a barrier. Every thread of the block calls it.
template <bool ZP, bool XSMEM>
__device__ __forceinline__ void qlin_ofs_stage(const __half* xp, int K, QlinOfs ofs) {
  const int words = K / 8;  // 16 per 128-k step: a step's words are 16 aligned lanes of one pass
  const unsigned sixteenth = 0x2C002C00u;  // (1/16, 1/16) in float16
  for (int base = 0; base < words; base += QLIN_THREADS) {  // uniform trip count: every lane shuffles
    const int v = base + threadIdx.x;
    float se = 0.f, so = 0.f;
    if (v < words) {
      const uint4 p = qlin_ldx<XSMEM>(xp + 8 * v);  // (x0, x1) (x2, x3) (x4, x5) (x6, x7)
      const uint4 q = make_uint4(qlin_lo(p.x, p.z), qlin_lo(p.y, p.w), qlin_hmul2(qlin_hi(p.x, p.z), sixteenth),
                                 qlin_hmul2(qlin_hi(p.y, p.w), sixteenth));
      *reinterpret_cast<uint4*>(ofs.x + 8 * v) = q;
      // the sums of what the MMAs multiply: S_o from the staged x / 16 (times 16, exact), so the offsets cancel
      // exactly even where x / 16 rounds (|x| < 2^-10)
      se = qlin_half2_sum(q.x) + qlin_half2_sum(q.y);
      so = 16.f * (qlin_half2_sum(q.z) + qlin_half2_sum(q.w));
    }
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) {
      se += __shfl_xor_sync(0xffffffffu, se, off);
      so += __shfl_xor_sync(0xffffffffu, so, off);
    }
    if (v < words && v % 16 == 0) {
      if constexpr (ZP) {
        ofs.corr[2 * (v / 16)] = fmaf(1024.f, se, 64.f * so);
        ofs.corr[2 * (v / 16) + 1] = se + so;
      } else {
        ofs.corr[v / 16] = fmaf(1032.f, se, 72.f * so);
      }
    }
  }
  __syncthreads();
}

// one int4 step of OFS (J = 1, G % 128 == 0): wlo / whi as in qlin_step4, xs + k the staged x at the lane's
// k, clo / chi the offset sums of rows g / g + 8 (the chain starts at minus them), slo / shi their group scales
__device__ __forceinline__ void qlin_step4_ofs(float (&acc)[1][4], const uint4& wlo, const uint4& whi,
                                               const __half* xs, int k, float slo, float shi, float clo, float chi) {
  float part[4] = {-clo, -clo, -chi, -chi};  // C fragment: c0, c1 on row g, c2, c3 on row g + 8
  const unsigned ulo[4] = {wlo.x, wlo.y, wlo.z, wlo.w}, uhi[4] = {whi.x, whi.y, whi.z, whi.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {  // word w: k 8w .. 8w+7 of the lane's 32; even k (k0, k4) (k2, k6), odd (k1, k5) (k3, k7)
    const unsigned vlo = ulo[w] >> 8, vhi = uhi[w] >> 8;
    const uint4 xv = *reinterpret_cast<const uint4*>(xs + k + 8 * w);
    lin_mma(part, qlin_nibbles<0x000F000Fu>(ulo[w]), qlin_nibbles<0x000F000Fu>(uhi[w]),
            qlin_nibbles<0x000F000Fu>(vlo), qlin_nibbles<0x000F000Fu>(vhi), xv.x, xv.y);
    lin_mma(part, qlin_nibbles<0x00F000F0u>(ulo[w]), qlin_nibbles<0x00F000F0u>(uhi[w]),
            qlin_nibbles<0x00F000F0u>(vlo), qlin_nibbles<0x00F000F0u>(vhi), xv.z, xv.w);
  }
  acc[0][0] = fmaf(slo, part[0], acc[0][0]);
  acc[0][1] = fmaf(slo, part[1], acc[0][1]);
  acc[0][2] = fmaf(shi, part[2], acc[0][2]);
  acc[0][3] = fmaf(shi, part[3], acc[0][3]);
}

// one int8 step (F8: E4M3 codes): wlo / whi = 16 k of rows g / g + 8 (lane c's k 16c .. 16c+15 of the step)
template <typename T, int J, bool F8, bool XSMEM = false>
__device__ __forceinline__ void qlin_step8(float (&acc)[J][4], const uint4& wlo, const uint4& whi,
                                           const T* const (&xr)[J], int k) {
  const unsigned ulo[4] = {wlo.x, wlo.y, wlo.z, wlo.w}, uhi[4] = {whi.x, whi.y, whi.z, whi.w};
#pragma unroll
  for (int h = 0; h < 2; ++h) {  // words 2h, 2h + 1: k 8h .. 8h+7 of the lane's 16
    unsigned pl0[2], ph0[2], pl1[2], ph1[2];
    if constexpr (F8) {
      qlin_f8_pairs(ulo[2 * h], pl0);
      qlin_f8_pairs(uhi[2 * h], ph0);
      qlin_f8_pairs(ulo[2 * h + 1], pl1);
      qlin_f8_pairs(uhi[2 * h + 1], ph1);
    } else {
      qlin_q8_pairs(ulo[2 * h], pl0);
      qlin_q8_pairs(uhi[2 * h], ph0);
      qlin_q8_pairs(ulo[2 * h + 1], pl1);
      qlin_q8_pairs(uhi[2 * h + 1], ph1);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
      // x halves 8h .. 8h+7: tiles (k0, k2 | k1, k3) of each word
      const uint4 xv = qlin_ldx<XSMEM>(xr[j] + k + 8 * h);
      lin_mma(acc[j], pl0[0], ph0[0], pl0[1], ph0[1], qlin_lo(xv.x, xv.y), qlin_hi(xv.x, xv.y));
      lin_mma(acc[j], pl1[0], ph1[0], pl1[1], ph1[1], qlin_lo(xv.z, xv.w), qlin_hi(xv.z, xv.w));
    }
  }
}

// the partial C fragments of every warp into red[r][warp][lane] (r = 4j + q: conflict-free), then a barrier
template <int J> __device__ __forceinline__ void qlin_stash(const float (&acc)[J][4], float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) red[((4 * j + q) * QLIN_WARPS + warp) * 32 + lane] = acc[j][q];
  __syncthreads();
}

// the paired epilogue of linear_quant_mma: pair n = rows a = epi.row_a(n) (+ bias[a]) and b = epi.row_b(n)
// (+ bias[b]), int8 / fp8 sums times their rows' scales, each rounded to T, then epi.put; S > 1 first sums the S partials of
// the item's F feature blocks through red (warp order: deterministic)
template <typename T, int R, int BITS, int J, int S, bool HAS_BIAS, typename EPI>
__device__ __forceinline__ void qlin_gated_store(const float (&acc)[J][4], float* red, const __half* __restrict__ scale,
                                                 const T* __restrict__ bias, long long bias_stride,
                                                 const View<T, R>& y, long long yn, int nb0, int n0, int m0, int H,
                                                 int m_rows, int F, EPI epi) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  auto out = [&](int n, int m, float sg, float su) {
    const long long na = epi.row_a(n, 2LL * H), nb = epi.row_b(n, 2LL * H);
    float bg = 0.f, bu = 0.f;
    if constexpr (HAS_BIAS) {
      bg = float(load(bias + na * bias_stride));
      bu = float(load(bias + nb * bias_stride));
    }
    if constexpr (BITS == 8) {
      sg = fmaf(sg, __half2float(scale[na]), bg);
      su = fmaf(su, __half2float(scale[nb]), bu);
    } else {
      sg += bg;
      su += bu;
    }
    epi.put(y.p + qlin_row(y, m), yn, m, n, lin_round<T>(sg), lin_round<T>(su));
  };
  if constexpr (S == 1) {
    const int n = n0 + g;
    if (n0 < H && n < H) {
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int m = m0 + 8 * j + 2 * c + q;
          if (m < m_rows) out(n, m, acc[j][q], acc[j][q + 2]);
        }
    }
  } else {
    qlin_stash<J>(acc, red);
    for (int slot = threadIdx.x; slot < F * 2 * J * 32; slot += QLIN_THREADS) {
      const int f = slot / (2 * J * 32), rem = slot % (2 * J * 32);
      const int q = (rem >> 5) & 1, r = 4 * (rem >> 6) + q, l = rem & 31;
      const int n = nb0 + 8 * f + (l >> 2), m = m0 + 8 * (rem >> 6) + 2 * (l & 3) + q;
      if (m < m_rows && n < H) {
        float sg = 0.f, su = 0.f;
#pragma unroll
        for (int v = 0; v < S; ++v) {
          sg += red[(r * QLIN_WARPS + f * S + v) * 32 + l];
          su += red[((r + 2) * QLIN_WARPS + f * S + v) * 32 + l];
        }
        out(n, m, sg, su);
      }
    }
    __syncthreads();  // red is rewritten by the next item
  }
}

// the plain (unpaired) store of linear_quant_mma: y[m, n] = acc (int8 / fp8: times scale[n]) + bias[n],
// rounded once; S > 1 first sums the S partials of the item's F feature blocks through red (warp order)
template <typename T, int R, int BITS, int J, int S, bool HAS_BIAS>
__device__ __forceinline__ void qlin_plain_store(const float (&acc)[J][4], float* red, const __half* __restrict__ scale,
                                                 const T* __restrict__ bias, long long bias_stride,
                                                 const View<T, R>& y, long long yn, int nb0, int n0, int m0,
                                                 int n_rows, int m_rows, int F) {
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  if constexpr (S == 1) {
    if (n0 < n_rows) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int n = n0 + g + (q >= 2 ? 8 : 0);
        if (n < n_rows) {
          float mul = 1.f, b = 0.f;
          if constexpr (BITS == 8) mul = __half2float(scale[n]);
          if constexpr (HAS_BIAS) b = float(load(bias + n * bias_stride));
#pragma unroll
          for (int j = 0; j < J; ++j) {
            const int m = m0 + 8 * j + 2 * c + (q & 1);
            if (m < m_rows) store(y.p + qlin_row(y, m) + n * yn, BITS == 8 ? fmaf(acc[j][q], mul, b) : acc[j][q] + b);
          }
        }
      }
    }
  } else {
    // red[r][warp][lane], r = 4j + q: warps f * S .. f * S + S - 1 hold feature block f's partials
    qlin_stash<J>(acc, red);
    for (int slot = threadIdx.x; slot < F * 4 * J * 32; slot += QLIN_THREADS) {
      const int f = slot / (4 * J * 32), r = (slot >> 5) % (4 * J), l = slot & 31, q = r & 3;
      const int n = nb0 + 16 * f + (l >> 2) + (q >= 2 ? 8 : 0);
      const int m = m0 + 8 * (r >> 2) + 2 * (l & 3) + (q & 1);
      if (m < m_rows && n < n_rows) {
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < S; ++v) sum += red[(r * QLIN_WARPS + f * S + v) * 32 + l];
        float mul = 1.f, b = 0.f;
        if constexpr (BITS == 8) mul = __half2float(scale[n]);
        if constexpr (HAS_BIAS) b = float(load(bias + n * bias_stride));
        store(y.p + qlin_row(y, m) + n * yn, BITS == 8 ? fmaf(sum, mul, b) : sum + b);
      }
    }
    __syncthreads();  // red is rewritten by the next item
  }
}

// the plain store of a K split across blocks (KS > 1; F = 1, S = 8: one feature block per item): the block
// sums its 8 warps' partials (warp order) into ws[item][4J x 32 slots], bumps the feature block's counter
// cnt[key]; the block that arrives last adds the ks_n runs' partials in run order (deterministic), applies the
// int8 / fp8 scale and the bias as qlin_plain_store does, stores, and puts the counter back to 0
template <typename T, int R, int BITS, int J, bool HAS_BIAS>
__device__ __forceinline__ void qlin_split_store(const float (&acc)[J][4], float* red, const __half* __restrict__ scale,
                                                 const T* __restrict__ bias, long long bias_stride,
                                                 const View<T, R>& y, long long yn, int n0, int m0, int n_rows,
                                                 int m_rows, float* __restrict__ ws, unsigned int* cnt, long long key,
                                                 int kr, int ks_n) {
  constexpr int SLOTS = 4 * J * 32;
  __shared__ bool qlin_last;
  qlin_stash<J>(acc, red);
  for (int slot = threadIdx.x; slot < SLOTS; slot += QLIN_THREADS) {
    const int r = slot >> 5, l = slot & 31;
    float sum = 0.f;
#pragma unroll
    for (int v = 0; v < QLIN_WARPS; ++v) sum += red[(r * QLIN_WARPS + v) * 32 + l];
    ws[(key * ks_n + kr) * SLOTS + slot] = sum;
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) qlin_last = atomicAdd(cnt + key, 1u) == (unsigned int)(ks_n - 1);
  __syncthreads();
  if (qlin_last) {
    __threadfence();
    for (int slot = threadIdx.x; slot < SLOTS; slot += QLIN_THREADS) {
      const int r = slot >> 5, l = slot & 31, q = r & 3;
      const int n = n0 + (l >> 2) + (q >= 2 ? 8 : 0), m = m0 + 8 * (r >> 2) + 2 * (l & 3) + (q & 1);
      float sum = 0.f;
      for (int k = 0; k < ks_n; ++k) sum += __ldcg(ws + (key * ks_n + k) * SLOTS + slot);
      if (m < m_rows && n < n_rows) {
        float mul = 1.f, b = 0.f;
        if constexpr (BITS == 8) mul = __half2float(scale[n]);
        if constexpr (HAS_BIAS) b = float(load(bias + n * bias_stride));
        store(y.p + qlin_row(y, m) + n * yn, BITS == 8 ? fmaf(sum, mul, b) : sum + b);
      }
    }
    if (threadIdx.x == 0) cnt[key] = 0u;  // ready for the next launch
  }
  __syncthreads();  // red is rewritten by the next item
}

// an item's stores: qlin_gated_store for a paired epilogue (n_rows / 2 pairs), else qlin_plain_store
template <typename T, int R, int BITS, int J, int S, bool HAS_BIAS, typename EPI>
__device__ __forceinline__ void qlin_store(const float (&acc)[J][4], float* red, const __half* __restrict__ scale,
                                           const T* __restrict__ bias, long long bias_stride, const View<T, R>& y,
                                           long long yn, int nb0, int n0, int m0, int n_rows, int m_rows, int F,
                                           EPI epi) {
  if constexpr (lin_gated<EPI>()) {
    qlin_gated_store<T, R, BITS, J, S, HAS_BIAS>(acc, red, scale, bias, bias_stride, y, yn, nb0, n0, m0, n_rows / 2,
                                                 m_rows, F, epi);
  } else {
    qlin_plain_store<T, R, BITS, J, S, HAS_BIAS>(acc, red, scale, bias, bias_stride, y, yn, nb0, n0, m0, n_rows,
                                                 m_rows, F);
  }
}

// the weights of steps s, s + S, ..., s + S (U - 1) of rows w0 / w1 (scales s0 / s1, zero points z0 / z1)
template <int BITS, int GS, int S, int U, bool EXACT, bool ZP>
__device__ __forceinline__ void qlin_load_steps(uint4 (&wlo)[U], uint4 (&whi)[U], __half (&slo)[U], __half (&shi)[U],
                                                unsigned char (&zlo)[U], unsigned char (&zhi)[U],
                                                const unsigned char* w0, const unsigned char* w1, const __half* s0,
                                                const __half* s1, const unsigned char* z0, const unsigned char* z1,
                                                int s, int steps, int c) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int st = s + S * u;
    wlo[u] = whi[u] = make_uint4(0u, 0u, 0u, 0u);
    slo[u] = shi[u] = __ushort_as_half(0);
    zlo[u] = zhi[u] = 8;
    if (st < steps) {
      if constexpr (BITS == 8 && QLIN_L2_HINT) {
        wlo[u] = lin_ld_stream_l2(w0 + st * QLIN_STEP_BYTES);
        whi[u] = lin_ld_stream_l2(w1 + st * QLIN_STEP_BYTES);
      } else {
        wlo[u] = lin_ld_stream(w0 + st * QLIN_STEP_BYTES);
        whi[u] = lin_ld_stream(w1 + st * QLIN_STEP_BYTES);
      }
      if constexpr (BITS == 4) {
        const int grp = EXACT ? st * 128 / GS : (st * 128 + 32 * c) / GS;
        slo[u] = __ldg(s0 + grp);
        shi[u] = __ldg(s1 + grp);
        if constexpr (ZP) {
          zlo[u] = __ldg(z0 + grp);
          zhi[u] = __ldg(z1 + grp);
        }
      }
    }
  }
}

// the tensor-core path for any M (items of 8J rows); red: 1024 * J floats of shared memory (S > 1).
// XSMEM: x is in shared memory (qlin_ldx). Paired (EPI, see linear_gemv in linear.cu): an item's feature
// blocks are 8 pairs p, A rows g = rows epi.row_a(p0 + g) and rows g + 8 = rows epi.row_b(p0 + g); each
// pair's two sums, rounded to T as the Linear stores them, go to epi.put. (A fused norm stages x before
// the call: running the staging after the first weight loads, as linear_w4a8_mma does, measured slower
// here, docs/perf.md v13, without the early launch.) pro: see LinPro in linear.cu (ATLAS_EARLY_QUANT=1, quant.py:
// the block's first item's first round of U steps, weights and scales, is loaded before it).
template <typename T, int R, int BITS, int GS, int J, int S, int U, bool HAS_BIAS, bool F8 = false, bool ZP = false,
          bool XSMEM = false, typename EPI = LinNoEpi, int KS = 1, typename PRO = LinNoPro, typename OFS = QlinNoOfs>
__device__ __forceinline__ void linear_quant_mma(const View<T, R>& x, const unsigned char* __restrict__ wq,
                                                 const __half* __restrict__ scale, const T* __restrict__ bias,
                                                 long long bias_stride, const View<T, R>& y, long long M,
                                                 long long N, long long K, float* red,
                                                 const unsigned char* __restrict__ zero = nullptr, EPI epi = EPI(),
                                                 float* __restrict__ ws = nullptr, unsigned int* cnt = nullptr,
                                                 int ks_n = KS, PRO pro = PRO(), OFS ofs = OFS()) {
  constexpr bool GATED = lin_gated<EPI>();
  constexpr int FB = GATED ? 8 : 16;  // outputs per feature block
  static_assert(BITS == 8 || (GS > 0 && GS % 32 == 0), "int4 tensor-core path needs G % 32 == 0");
  static_assert(!F8 || BITS == 8, "E4M3 codes are one byte per weight");
  static_assert(!ZP || BITS == 4, "zero points are int4-only");
  static_assert(S == 1 || S == 2 || S == 4 || S == 8, "split-K ways: 1, 2, 4 or 8");
  static_assert(KS == 1 || (!GATED && S == QLIN_WARPS), "a K split across blocks is for plain projections at S = 8");
  constexpr int F = QLIN_WARPS / S;               // 16-feature blocks per item
  constexpr int KL = BITS == 4 ? 32 : 16;         // k per lane per step
  constexpr bool EXACT = BITS == 8 || GS % 128 == 0;
  static_assert(!OFS::ON || (BITS == 4 && EXACT && J == 1 && KS == 1 && sizeof(T) == 2),
                "offset dequantization: int4 with G % 128 == 0, one row of float16 x");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int fb = warp / S, ks = warp % S;
  // 32-bit indices (qlin_mma_ok: M, N, K < 2^31); byte and element offsets of rows stay 64-bit
  int steps = int((BITS == 4 ? K / 2 : K) / QLIN_STEP_BYTES);
  // an opaque trip count: with K known, a warp's whole k loop is one straight line whose x loads nvcc
  // hoists (130+ registers: one block per SM)
  asm("" : "+r"(steps));
  const int n_rows = int(N), m_rows = int(M);
  const long long row_bytes = (long long)steps * QLIN_STEP_BYTES;
  const int groups = BITS == 4 ? int(K / GS) : 1;
  const int tiles_m = (m_rows + 8 * J - 1) / (8 * J);
  const int H = n_rows / 2, outs = GATED ? H : n_rows;
  if constexpr (KS == 1) ks_n = 1;
  const bool split = KS > 1 && ks_n > 1;
  const int run = (steps + ks_n - 1) / ks_n;  // steps per run of a K split across blocks (all of them without)
  const long long keys = (long long)(((outs + FB - 1) / FB + F - 1) / F) * tiles_m, yn = y.stride[R - 1];
  uint4 wlo[U], whi[U];  // a round of weights: one buffer for the preloaded round and the loop's
  __half slo[U], shi[U];
  unsigned char zlo[U], zhi[U];
  bool loaded = false;
  // the block's first item's first round (the same addresses as in the loop below): before pro, or (OFS) before
  // the staging of x
  if constexpr (PRO::EARLY || OFS::ON) {
    const long long key = blockIdx.x / ks_n;
    const int kr = int(blockIdx.x % ks_n), s_end = min(steps, (kr + 1) * run), s = kr * run + ks;
    const int n0 = int(key / tiles_m) * (FB * F) + FB * fb;
    loaded = blockIdx.x < keys * ks_n && n0 < outs && s < s_end;
    if (loaded) {
      const int r0 = GATED ? int(epi.row_a(min(n0 + g, H - 1), n_rows)) : min(n0 + g, n_rows - 1);
      const int r1 = GATED ? int(epi.row_b(min(n0 + g, H - 1), n_rows)) : min(n0 + g + 8, n_rows - 1);
      qlin_load_steps<BITS, GS, S, U, EXACT, ZP>(
          wlo, whi, slo, shi, zlo, zhi, wq + r0 * row_bytes + 16 * c, wq + r1 * row_bytes + 16 * c,
          scale + (long long)r0 * groups, scale + (long long)r1 * groups,
          ZP ? zero + (long long)r0 * groups : nullptr, ZP ? zero + (long long)r1 * groups : nullptr, s, s_end, c);
    }
  }
  pro();
  if constexpr (OFS::ON) qlin_ofs_stage<ZP, XSMEM>(reinterpret_cast<const __half*>(x.p), int(K), ofs);
  for (long long item = blockIdx.x; item < keys * ks_n; item += gridDim.x) {
    if constexpr (PRO::TRIGGER) {
      if (item + gridDim.x >= keys * ks_n) pdl_leave();  // the block's last item
    }
    const long long key = item / ks_n;
    const int kr = int(item % ks_n), s_end = min(steps, (kr + 1) * run);
    const int nb0 = int(key / tiles_m) * (FB * F), n0 = nb0 + FB * fb, m0 = int(key % tiles_m) * (8 * J);
    float acc[J][4];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j][q] = 0.f;
    if (n0 < outs) {  // warp-uniform
      const int r0 = GATED ? int(epi.row_a(min(n0 + g, H - 1), n_rows)) : min(n0 + g, n_rows - 1);
      const int r1 = GATED ? int(epi.row_b(min(n0 + g, H - 1), n_rows)) : min(n0 + g + 8, n_rows - 1);
      const unsigned char* w0 = wq + r0 * row_bytes + 16 * c;
      const unsigned char* w1 = wq + r1 * row_bytes + 16 * c;
      const __half* s0 = scale + (long long)r0 * groups;
      const __half* s1 = scale + (long long)r1 * groups;
      const unsigned char* z0 = ZP ? zero + (long long)r0 * groups : nullptr;
      const unsigned char* z1 = ZP ? zero + (long long)r1 * groups : nullptr;
      const T* xr[J];
#pragma unroll
      for (int j = 0; j < J; ++j) xr[j] = x.p + qlin_row(x, min(m0 + 8 * j + g, m_rows - 1)) + KL * c;
      for (int s = kr * run + ks; s < s_end; s += S * U) {
        if (!loaded) {  // (PRO::EARLY: the first item's first round is loaded before pro)
          qlin_load_steps<BITS, GS, S, U, EXACT, ZP>(wlo, whi, slo, shi, zlo, zhi, w0, w1, s0, s1, z0, z1, s, s_end,
                                                     c);
        }
        loaded = false;
#pragma unroll
        for (int u = 0; u < U; ++u) {
          const int st = s + S * u;
          if (st < s_end) {
            if constexpr (OFS::ON && BITS == 4) {  // J = 1, one x row: xr unused
              float clo, chi;
              if constexpr (ZP) {
                const float2 t = reinterpret_cast<const float2*>(ofs.corr)[st];
                clo = fmaf(float(zlo[u]), t.y, t.x);
                chi = fmaf(float(zhi[u]), t.y, t.x);
              } else {
                clo = chi = ofs.corr[st];
              }
              qlin_step4_ofs(acc, wlo[u], whi[u], ofs.x + KL * c, st * 128, __half2float(slo[u]),
                             __half2float(shi[u]), clo, chi);
            } else if constexpr (BITS == 4) {
              if constexpr (ZP) {
                unsigned sub_lo, fma_lo, sub_hi, fma_hi;
                qlin_zero_consts(zlo[u], sub_lo, fma_lo);
                qlin_zero_consts(zhi[u], sub_hi, fma_hi);
                qlin_step4<T, J, EXACT, XSMEM>(acc, wlo[u], whi[u], xr, st * 128, __half2float(slo[u]),
                                               __half2float(shi[u]), __half_as_ushort(slo[u]) * 0x10001u,
                                               __half_as_ushort(shi[u]) * 0x10001u, sub_lo, fma_lo, sub_hi, fma_hi);
              } else {
                qlin_step4<T, J, EXACT, XSMEM>(acc, wlo[u], whi[u], xr, st * 128, __half2float(slo[u]),
                                               __half2float(shi[u]), __half_as_ushort(slo[u]) * 0x10001u,
                                               __half_as_ushort(shi[u]) * 0x10001u);
              }
            } else {
              qlin_step8<T, J, F8, XSMEM>(acc, wlo[u], whi[u], xr, st * 64);
            }
          }
        }
      }
    }
    // C fragment (per j): c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1] (row = feature, column = x row)
    if constexpr (KS > 1) {
      if (split) {
        qlin_split_store<T, R, BITS, J, HAS_BIAS>(acc, red, scale, bias, bias_stride, y, yn, n0, m0, n_rows, m_rows, ws,
                                                  cnt, key, kr, ks_n);
        continue;
      }
    }
    qlin_store<T, R, BITS, J, S, HAS_BIAS>(acc, red, scale, bias, bias_stride, y, yn, nb0, n0, m0, n_rows, m_rows, F,
                                           epi);
  }
}

}  // namespace atlas
