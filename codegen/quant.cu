// LinearQ8 / LinearQ4 (see quant.py): y[..., N] = x[..., K] @ dequant(wq)^T (+ bias[N]).
//
// Layout: wq is a contiguous [N, row_bytes] constant: int8 [N, K] (row_bytes = K) or packed int4
// uint8 [N, K/2] (low nibble = even k, high nibble = odd k, value + 8); scale is float16 [N] (int8)
// or [N, K/G] (int4). x and y are Views whose leading dims flatten to M rows (any strides).
// One warp per output feature (warps loop grid-stride over features): its lanes walk the packed row
// with 16-byte loads (scalar byte loads when the row is not 16-byte aligned), dequantize in registers
// (int8 -> float * scale; nibble -> (v - 8) * group scale: exact in float32, as the reference), and
// accumulate QM rows of x at a time in float32; a warp-shuffle reduce, the bias in float32, one
// rounding at the store. Rows of x are processed QM at a time, so any M is correct (large M re-reads
// the weights M / QM times: the prefill speed of this kernel is not tuned).
namespace atlas {

constexpr int QLIN_THREADS = 256;
constexpr int QLIN_WARPS = QLIN_THREADS / 32;
constexpr int QLIN_QM = 4;

// accumulate the weights of one byte of the row (byte index j) into acc for the QM rows
template <typename T, int BITS>
__device__ __forceinline__ void qlin_byte(float (&acc)[QLIN_QM], unsigned int byte, long long j, float s8,
                                          const __half* __restrict__ srow, long long G, const T* __restrict__ x,
                                          const long long (&xoff)[QLIN_QM], long long xk, int rows) {
  if constexpr (BITS == 8) {
    const float w = float(static_cast<signed char>(byte)) * s8;
#pragma unroll
    for (int m = 0; m < QLIN_QM; ++m)
      if (m < rows) acc[m] = fmaf(w, float(load(x + xoff[m] + j * xk)), acc[m]);
  } else {
    const long long k = 2 * j;  // k and k + 1 share a group (G is even)
    const float s = __half2float(srow[k / G]);
    const float w0 = float(int(byte & 15u) - 8) * s;
    const float w1 = float(int(byte >> 4) - 8) * s;
#pragma unroll
    for (int m = 0; m < QLIN_QM; ++m)
      if (m < rows) {
        acc[m] = fmaf(w0, float(load(x + xoff[m] + k * xk)), acc[m]);
        acc[m] = fmaf(w1, float(load(x + xoff[m] + (k + 1) * xk)), acc[m]);
      }
  }
}

template <typename T, int R, int BITS, bool HAS_BIAS>
__device__ __forceinline__ void linear_quant(const View<T, R>& x, const unsigned char* __restrict__ wq,
                                             const __half* __restrict__ scale, const T* __restrict__ bias,
                                             long long bias_stride, const View<T, R>& y, long long M, long long N,
                                             long long K, long long G) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long row_bytes = BITS == 8 ? K : K / 2;
  const long long groups = BITS == 8 ? 1 : K / G;
  const long long xk = x.stride[R - 1], yn = y.stride[R - 1];
  const bool vec = (row_bytes % 16 == 0) && (reinterpret_cast<uintptr_t>(wq) % 16 == 0);
  for (long long n = (long long)blockIdx.x * QLIN_WARPS + warp; n < N; n += (long long)gridDim.x * QLIN_WARPS) {
    const unsigned char* wr = wq + n * row_bytes;
    const __half* srow = scale + n * groups;
    const float s8 = BITS == 8 ? __half2float(scale[n]) : 0.f;
    float b = 0.f;
    if constexpr (HAS_BIAS) b = float(load(bias + n * bias_stride));
    for (long long m0 = 0; m0 < M; m0 += QLIN_QM) {
      const int rows = int(M - m0 < QLIN_QM ? M - m0 : QLIN_QM);
      long long xoff[QLIN_QM], yoff[QLIN_QM];
#pragma unroll
      for (int m = 0; m < QLIN_QM; ++m) {
        const long long mm = m0 + (m < rows ? m : 0);
        xoff[m] = lin_row_offset(x, mm);
        yoff[m] = lin_row_offset(y, mm);
      }
      float acc[QLIN_QM];
#pragma unroll
      for (int m = 0; m < QLIN_QM; ++m) acc[m] = 0.f;
      if (vec) {
        for (long long v = lane; v < row_bytes / 16; v += 32) {
          const uint4 p = lin_ld_stream(wr + v * 16);
          const unsigned int u[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
          for (int i = 0; i < 16; ++i)
            qlin_byte<T, BITS>(acc, (u[i / 4] >> (8 * (i % 4))) & 0xFFu, v * 16 + i, s8, srow, G, x.p, xoff, xk,
                               rows);
        }
      } else {
        for (long long j = lane; j < row_bytes; j += 32)
          qlin_byte<T, BITS>(acc, wr[j], j, s8, srow, G, x.p, xoff, xk, rows);
      }
#pragma unroll
      for (int m = 0; m < QLIN_QM; ++m) {
        const float s = warp_sum(acc[m]);
        if (m < rows && lane == m) store(y.p + yoff[m] + n * yn, s + b);
      }
    }
  }
}

}  // namespace atlas
