// MatMul / Gemm (see matmul.py): one shared-memory tiled kernel for both.
//
// Operands arrive as rank-R Views normalized by the emitter: [batch..., M, K] x [batch..., K, N] ->
// [batch..., M, N]; broadcast batch dims, 1-D operands' missing M/N dims and Gemm's transA/transB are
// all expressed through strides (0 for a broadcast dim), so transposed or strided inputs need no copy.
// Tiles: 64x64 outputs per block of 256 threads (each thread a 4x4 micro-tile strided by 16 rows/cols
// so shared-memory reads are conflict-free), K consumed 16 at a time through shared memory.
// Accumulation in Compute<T> (float for float16 and float32); the result is rounded once when stored.
// Blocks loop grid-stride over (batch, tile_m, tile_n), so any grid is correct.
namespace atlas {

constexpr int MM_BM = 64, MM_BN = 64, MM_BK = 16, MM_THREADS = 256;

template <typename T, int R, bool GEMM, bool HAS_BIAS>
__device__ __forceinline__ void matmul_tiled(const View<T, R>& A, const View<T, R>& B, const View<T, R>& C,
                                             const View<T, 2>& bias, typename Compute<T>::type alpha,
                                             typename Compute<T>::type beta) {
  typedef typename Compute<T>::type Acc;
  __shared__ Acc As[MM_BK][MM_BM + 1];  // As[k][m]
  __shared__ Acc Bs[MM_BK][MM_BN + 1];  // Bs[k][n]
  const long long M = C.shape[R - 2], N = C.shape[R - 1], K = A.shape[R - 1];
  long long batch = 1;
#pragma unroll
  for (int i = 0; i < R - 2; ++i) batch *= C.shape[i];
  const long long tiles_m = (M + MM_BM - 1) / MM_BM, tiles_n = (N + MM_BN - 1) / MM_BN;
  const long long total = batch * tiles_m * tiles_n;
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  // A strides along m and k; B along k and n
  const long long sam = A.stride[R - 2], sak = A.stride[R - 1], sbk = B.stride[R - 2], sbn = B.stride[R - 1];
  // load mapping: when A is contiguous along m (a transposed operand), let neighbouring threads walk m
  const bool a_m_major = (sam == 1 && sak != 1);
  const bool b_k_major = (sbk == 1 && sbn != 1);
  for (long long tile = blockIdx.x; tile < total; tile += gridDim.x) {
    const long long bi = tile / (tiles_m * tiles_n);
    const long long rem = tile - bi * tiles_m * tiles_n;
    const long long m0 = (rem / tiles_n) * MM_BM, n0 = (rem % tiles_n) * MM_BN;
    long long oa = 0, ob = 0, oc = 0;
    {
      long long f = bi;
#pragma unroll
      for (int i = R - 3; i >= 0; --i) {
        const long long c = f % C.shape[i];
        f /= C.shape[i];
        oa += c * A.stride[i];
        ob += c * B.stride[i];
        oc += c * C.stride[i];
      }
    }
    const T* pa = A.p + oa;
    const T* pb = B.p + ob;
    Acc acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = Acc(0);
    for (long long k0 = 0; k0 < K; k0 += MM_BK) {
#pragma unroll
      for (int q = 0; q < (MM_BM * MM_BK) / MM_THREADS; ++q) {
        const int e = tid + q * MM_THREADS;
        const int mm = a_m_major ? e % MM_BM : e / MM_BK, kk = a_m_major ? e / MM_BM : e % MM_BK;
        const long long gm = m0 + mm, gk = k0 + kk;
        As[kk][mm] = (gm < M && gk < K) ? Acc(load(pa + gm * sam + gk * sak)) : Acc(0);
      }
#pragma unroll
      for (int q = 0; q < (MM_BK * MM_BN) / MM_THREADS; ++q) {
        const int e = tid + q * MM_THREADS;
        const int kk = b_k_major ? e % MM_BK : e / MM_BN, nn = b_k_major ? e / MM_BK : e % MM_BN;
        const long long gk = k0 + kk, gn = n0 + nn;
        Bs[kk][nn] = (gk < K && gn < N) ? Acc(load(pb + gk * sbk + gn * sbn)) : Acc(0);
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < MM_BK; ++kk) {
        Acc a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
      }
      __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const long long gm = m0 + ty + 16 * i;
      if (gm >= M) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long long gn = n0 + tx + 16 * j;
        if (gn >= N) continue;
        Acc v = acc[i][j];
        if constexpr (GEMM) {
          v = alpha * v;
          if constexpr (HAS_BIAS) v = v + beta * Acc(load(bias.p + gm * bias.stride[0] + gn * bias.stride[1]));
        }
        store(C.p + oc + gm * C.stride[R - 2] + gn * C.stride[R - 1], v);
      }
    }
  }
}

}  // namespace atlas
