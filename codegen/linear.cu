// Linear (see linear.py): y[..., N] = x[..., K] @ w[N, K]^T (+ bias[N]).
//
// Layout: w is a contiguous [N, K] constant (one row per output feature); x and y are Views whose
// leading dims flatten to M rows (any strides); bias is [N] with a stride. Numerics: float32
// accumulation, the bias added in float32, one rounding at the store (matches the reference).
//
// Two paths, chosen at run time from M (the grid is static, so every block takes the same branch):
// - GEMV (M <= 32, decode): each warp owns F consecutive output features; its lanes walk those F
//   weight rows with 16-byte loads (8 halves / 4 floats), U vectors per row per lane in flight
//   (F*U*16 bytes per lane), streamed past L1 (ld.global.nc.L1::no_allocate) so that x, read
//   through the read-only cache with the same 16-byte loads and reused by the F rows, stays in L1.
//   MT (a power of two >= M) rows of x are accumulated in registers (acc[F][MT]), then each sum is
//   reduced across the warp with shuffles and lane m stores row m. Row offsets of x and y are
//   computed once per block into shared memory. The 16-byte path needs K * sizeof(T) % 16 == 0,
//   16-byte aligned x rows (unit stride along K) and w; otherwise the same loop runs with scalar
//   loads through the strides.
// - tiled (M > 32, prefill): matmul_tiled of matmul.cu with B = w^T expressed through strides
//   (B[k, n] = w[n * K + k]: k-major loads stay coalesced) and the bias as a stride-0 row.
// Warps loop grid-stride over feature groups and blocks over tiles, so any grid is correct.
namespace atlas {

constexpr int LIN_THREADS = 256;
constexpr int LIN_WARPS = LIN_THREADS / 32;
constexpr int LIN_GEMV_MAX_M = 32;

// a 16-byte load of weights that are read once: bypass L1
__device__ __forceinline__ uint4 lin_ld_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

template <typename T> struct LinVec;
template <> struct LinVec<float> {
  static constexpr int N = 4;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
};
template <> struct LinVec<__half> {
  static constexpr int N = 8;
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    const unsigned int u[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __half2 h = *reinterpret_cast<const __half2*>(&u[i]);
      const float2 t = __half22float2(h);
      f[2 * i] = t.x;
      f[2 * i + 1] = t.y;
    }
  }
};

// element offset of row m (row-major over the leading R-1 dims) of a View
template <typename T, int R> __device__ __forceinline__ long long lin_row_offset(const View<T, R>& v, long long m) {
  long long off = 0;
#pragma unroll
  for (int i = R - 2; i >= 0; --i) {
    const long long c = m % v.shape[i];
    m /= v.shape[i];
    off += c * v.stride[i];
  }
  return off;
}

// one feature group [n0, n0 + F) of the GEMV, 16-byte loads
template <typename T, int MT, int F, int U>
__device__ __forceinline__ void lin_group_vec(float (&acc)[F][MT], const T* __restrict__ x, const long long* xoff,
                                              long long M, const T* __restrict__ w, long long n0, long long N,
                                              long long K, int lane) {
  constexpr int V = LinVec<T>::N;
  const long long KV = K / V;  // 16-byte vectors per row
  const T* wr[F];
#pragma unroll
  for (int f = 0; f < F; ++f) wr[f] = w + imin(n0 + f, N - 1) * K;  // rows past N: read row N-1, discard
  long long v0 = lane;
  for (; v0 + 32 * (U - 1) < KV; v0 += 32 * U) {
    uint4 wv[U][F];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int f = 0; f < F; ++f) wv[u][f] = lin_ld_stream(wr[f] + (v0 + 32 * u) * V);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float wf[F][V];
#pragma unroll
      for (int f = 0; f < F; ++f) LinVec<T>::unpack(wv[u][f], wf[f]);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < M) {
          float xf[V];
          LinVec<T>::unpack(__ldg(reinterpret_cast<const uint4*>(x + xoff[m] + (v0 + 32 * u) * V)), xf);
#pragma unroll
          for (int f = 0; f < F; ++f)
#pragma unroll
            for (int e = 0; e < V; ++e) acc[f][m] = fmaf(wf[f][e], xf[e], acc[f][m]);
        }
      }
    }
  }
  for (; v0 < KV; v0 += 32) {  // remainder: one vector per row at a time
    float wf[F][V];
#pragma unroll
    for (int f = 0; f < F; ++f) LinVec<T>::unpack(lin_ld_stream(wr[f] + v0 * V), wf[f]);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < M) {
        float xf[V];
        LinVec<T>::unpack(__ldg(reinterpret_cast<const uint4*>(x + xoff[m] + v0 * V)), xf);
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
          for (int e = 0; e < V; ++e) acc[f][m] = fmaf(wf[f][e], xf[e], acc[f][m]);
      }
    }
  }
}

// the same with scalar loads through x's K stride (any alignment)
template <typename T, int MT, int F>
__device__ __forceinline__ void lin_group_scalar(float (&acc)[F][MT], const T* __restrict__ x, const long long* xoff,
                                                 long long xk, long long M, const T* __restrict__ w, long long n0,
                                                 long long N, long long K, int lane) {
  const T* wr[F];
#pragma unroll
  for (int f = 0; f < F; ++f) wr[f] = w + imin(n0 + f, N - 1) * K;
  for (long long k = lane; k < K; k += 32) {
    float wf[F];
#pragma unroll
    for (int f = 0; f < F; ++f) wf[f] = float(load(wr[f] + k));
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < M) {
        const float xv = float(load(x + xoff[m] + k * xk));
#pragma unroll
        for (int f = 0; f < F; ++f) acc[f][m] = fmaf(wf[f], xv, acc[f][m]);
      }
    }
  }
}

// GEMV over every feature group (M <= MT <= 32); xoff / yoff: row offsets in shared memory
template <typename T, int R, int MT, int F, int U, bool HAS_BIAS>
__device__ __forceinline__ void linear_gemv(const View<T, R>& x, const T* __restrict__ w, const T* __restrict__ bias,
                                            long long bias_stride, const View<T, R>& y, long long M, long long N,
                                            long long K, const long long* xoff, const long long* yoff, bool vec) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long groups = (N + F - 1) / F;
  const long long xk = x.stride[R - 1], yn = y.stride[R - 1];
  for (long long g = (long long)blockIdx.x * LIN_WARPS + warp; g < groups; g += (long long)gridDim.x * LIN_WARPS) {
    const long long n0 = g * F;
    float acc[F][MT];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
      for (int m = 0; m < MT; ++m) acc[f][m] = 0.f;
    if (vec) {
      lin_group_vec<T, MT, F, U>(acc, x.p, xoff, M, w, n0, N, K, lane);
    } else {
      lin_group_scalar<T, MT, F>(acc, x.p, xoff, xk, M, w, n0, N, K, lane);
    }
#pragma unroll
    for (int f = 0; f < F; ++f) {
      const long long n = n0 + f;
      float b = 0.f;
      if constexpr (HAS_BIAS) b = (n < N) ? float(load(bias + imin(n, N - 1) * bias_stride)) : 0.f;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float s = warp_sum(acc[f][m]);
        if (m < M && lane == m && n < N) store(y.p + yoff[m] + n * yn, s + b);
      }
    }
  }
}

// block setup shared by the GEMV variants: row offsets, and whether the 16-byte path applies
template <typename T, int R>
__device__ __forceinline__ bool linear_gemv_setup(const View<T, R>& x, const T* w, const View<T, R>& y, long long M,
                                                  long long K, long long* xoff, long long* yoff) {
  constexpr int V = LinVec<T>::N;
  if (threadIdx.x < M) {
    xoff[threadIdx.x] = lin_row_offset(x, threadIdx.x);
    yoff[threadIdx.x] = lin_row_offset(y, threadIdx.x);
  }
  bool vec = (K % V == 0) && x.stride[R - 1] == 1 && (reinterpret_cast<uintptr_t>(x.p) % 16 == 0) &&
             (reinterpret_cast<uintptr_t>(w) % 16 == 0);
#pragma unroll
  for (int i = 0; i < R - 1; ++i) vec = vec && (x.shape[i] == 1 || x.stride[i] % V == 0);
  __syncthreads();
  return vec;
}

// the prefill path: matmul_tiled with B = w^T through strides
template <typename T, int R, bool HAS_BIAS>
__device__ __forceinline__ void linear_tiled(const View<T, R>& x, const T* w, const T* bias, long long bias_stride,
                                             const View<T, R>& y, long long N, long long K) {
  typedef typename Compute<T>::type Acc;
  View<T, R> B;
  B.p = const_cast<T*>(w);
#pragma unroll
  for (int i = 0; i < R - 2; ++i) {
    B.shape[i] = y.shape[i];
    B.stride[i] = 0;
  }
  B.shape[R - 2] = K;
  B.stride[R - 2] = 1;
  B.shape[R - 1] = N;
  B.stride[R - 1] = K;
  View<T, 2> bv;
  bv.p = const_cast<T*>(bias);
  bv.shape[0] = y.shape[R - 2];
  bv.stride[0] = 0;
  bv.shape[1] = N;
  bv.stride[1] = bias_stride;
  matmul_tiled<T, R, true, HAS_BIAS>(x, B, y, bv, Acc(1), Acc(1));
}

}  // namespace atlas
