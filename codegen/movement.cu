// Data movement and tensor construction (see movement.py): Concat, Split, Gather, GatherND,
// ScatterND, Trilu, CumSum, Range, ConstantOfShape, DimsTensor. Elements are copied as raw values of
// their storage type (no float round trip). Every loop is grid-stride, so any grid is correct and a
// zero-size tensor does nothing.
namespace atlas {
namespace mv {

template <typename T> __device__ __forceinline__ T zero() { return T(0); }
template <> __device__ __forceinline__ __half zero<__half>() { return __float2half(0.f); }

// dst[c] = src[c] for every coordinate c of dst's shape (src has the same shape), both strided
template <typename T, int R> __device__ __forceinline__ void copy(View<T, R> dst, View<T, R> src) {
  const long long n = dst.numel();
  for (long long i = global_thread(); i < n; i += global_threads()) *dst.at_flat(i) = *src.at_flat(i);
}

// Trilu over the last two dims: keep x[..., i, j] where j - i >= k (upper) or j - i <= k (lower)
template <typename T, int R>
__device__ __forceinline__ void trilu(View<T, R> y, View<T, R> x, long long k, bool upper) {
  static_assert(R >= 2, "Trilu needs rank >= 2");
  const long long n = y.numel();
  for (long long f = global_thread(); f < n; f += global_threads()) {
    long long c[R];
    unravel<R>(f, y.shape, c);
    long long xo = 0, yo = 0;
#pragma unroll
    for (int t = 0; t < R; ++t) { xo += c[t] * x.stride[t]; yo += c[t] * y.stride[t]; }
    const long long diag = c[R - 1] - c[R - 2];
    const bool keep = upper ? diag >= k : diag <= k;
    y.p[yo] = keep ? x.p[xo] : zero<T>();
  }
}

// a + b rounded to T (numpy accumulates float16 cumsums in float16)
template <typename T, typename C> __device__ __forceinline__ C add_in(C a, C b) { return a + b; }
template <> __device__ __forceinline__ float add_in<__half, float>(float a, float b) {
  return __half2float(__float2half_rn(a + b));
}

// CumSum: one thread per line along the axis. Mirrors the reference: inclusive sums in T's precision;
// exclusive = inclusive - x; reverse walks the line backwards.
template <bool Exclusive, bool Reverse, typename T, int KR>
__device__ __forceinline__ void cumsum(View<T, KR> xk, View<T, 1> xr, View<T, KR> yk, View<T, 1> yr) {
  typedef typename Compute<T>::type C;
  const long long lines = xk.numel(), n = xr.numel();
  for (long long o = global_thread(); o < lines; o += global_threads()) {
    const T* x = xk.p + xk.offset_of_flat(o);
    T* y = yk.p + yk.offset_of_flat(o);
    C acc = C(0);
    for (long long s = 0; s < n; ++s) {
      const long long i = Reverse ? n - 1 - s : s;
      const C v = load(x + i * xr.stride[0]);
      acc = add_in<T, C>(acc, v);
      store(y + i * yr.stride[0], Exclusive ? add_in<T, C>(acc, -v) : acc);
    }
  }
}

// every thread of the block gets the maximum (blockDim.x a multiple of 32)
__device__ __forceinline__ long long block_max_ll(long long v, long long* scratch) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = imax(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  if (warp == 0) {
    v = lane < nwarps ? scratch[lane] : -1;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = imax(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

// ScatterND (reduction none) as one kernel with no grid-wide ordering: the output is split into
// "slots" (a coordinate over data's first K dims; each slot is a slice over the remaining dims), and a
// block owns a slot at a time. The block finds the LAST update row whose index targets the slot (the
// reference applies rows in order, so the last wins on duplicates), then copies that update's slice,
// or data's slice when no row targets it. Each output element is written once, by one thread, which
// reads data at the same coordinate: correct even when the output aliases data (in place).
// Negative indices wrap; out-of-range ones match no slot.
template <int K, typename T, typename I, int SR, int UR, int LR>
__device__ __forceinline__ void scatter_nd(View<T, SR> out_slot, View<T, SR> data_slot, View<T, LR> out_slice,
                                           View<T, LR> data_slice, View<I, UR> rows, long long last_stride,
                                           View<T, UR> upd_rows, View<T, LR> upd_slice) {
  __shared__ long long scratch[32];
  const long long slots = out_slot.numel(), nrows = rows.numel(), n = out_slice.numel();
  for (long long s = blockIdx.x; s < slots; s += gridDim.x) {
    long long c[SR];
    unravel<SR>(s, out_slot.shape, c);
    long long best = -1;
    for (long long u = threadIdx.x; u < nrows; u += blockDim.x) {
      const I* ip = rows.p + rows.offset_of_flat(u);
      bool match = true;
#pragma unroll
      for (int j = 0; j < K; ++j) {
        long long v = static_cast<long long>(ip[j * last_stride]);
        if (v < 0) v += out_slot.shape[j];
        match = match && v == c[j];
      }
      if (match) best = u;  // u grows along this thread's loop: its last match
    }
    best = block_max_ll(best, scratch);
    T* dst = out_slot.p + out_slot.offset_of_flat(s);
    if (best >= 0) {
      const T* src = upd_rows.p + upd_rows.offset_of_flat(best);
      for (long long i = threadIdx.x; i < n; i += blockDim.x)
        dst[out_slice.offset_of_flat(i)] = src[upd_slice.offset_of_flat(i)];
    } else {
      const T* src = data_slot.p + data_slot.offset_of_flat(s);
      for (long long i = threadIdx.x; i < n; i += blockDim.x)
        dst[out_slice.offset_of_flat(i)] = src[data_slice.offset_of_flat(i)];
    }
  }
}

}  // namespace mv
}  // namespace atlas
