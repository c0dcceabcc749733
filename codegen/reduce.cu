// Reductions (see reduce.py): Reduce*, ArgMax/ArgMin, Softmax/LogSoftmax, LayerNormalization,
// RMSNormalization.
//
// Every op here reads its input through two views over the same pointer: `k` (the kept dims) and
// `r` (the reduced dims), each with the input's own strides, so element (o, i) of the "row" o lives
// at k.p + off(k, o) + off(r, i). Two schedules:
//   *_block:  one block per row (grid-stride over rows); threads walk the row, coalesced when the
//             reduced dims are innermost; a block-wide tree combines the partials;
//   *_thread: one thread per row (grid-stride over rows); adjacent threads take adjacent rows, which
//             is coalesced when the innermost dim is kept (e.g. a reduction over axis 0).
// Accumulators: float for float16/float32, double for float64, long long for integers and bool.
// Row loops depend only on blockIdx, so every thread of a block reaches each __syncthreads.
namespace atlas {
namespace rd {

// offset of flat index `flat` (< v.numel()) over v's shape; rank 1 needs no division
template <typename T, int R> __device__ __forceinline__ long long off(const View<T, R>& v, long long flat) {
  if constexpr (R == 1) {
    return flat * v.stride[0];
  } else {
    return v.offset_of_flat(flat);
  }
}

template <typename A> struct Lim;
template <> struct Lim<float> {
  static __device__ __forceinline__ float lowest() { return -INFINITY; }
  static __device__ __forceinline__ float highest() { return INFINITY; }
};
template <> struct Lim<double> {
  static __device__ __forceinline__ double lowest() { return -INFINITY; }
  static __device__ __forceinline__ double highest() { return INFINITY; }
};
template <> struct Lim<long long> {
  static __device__ __forceinline__ long long lowest() { return -9223372036854775807LL - 1; }
  static __device__ __forceinline__ long long highest() { return 9223372036854775807LL; }
};

__device__ __forceinline__ float fexp(float x) { return expf(x); }
__device__ __forceinline__ double fexp(double x) { return exp(x); }
__device__ __forceinline__ float flog(float x) { return logf(x); }
__device__ __forceinline__ double flog(double x) { return log(x); }
__device__ __forceinline__ float fsqrt(float x) { return sqrtf(x); }
__device__ __forceinline__ double fsqrt(double x) { return sqrt(x); }
__device__ __forceinline__ long long fsqrt(long long x) { return static_cast<long long>(sqrt(static_cast<double>(x))); }

// count division for ReduceMean: 0/0 is NaN for floats (like numpy); integers truncate (numpy's
// float mean cast back to int truncates too), and an empty integer mean gives 0
template <typename A> __device__ __forceinline__ A div_count(A a, long long n) { return a / static_cast<A>(n); }
template <> __device__ __forceinline__ long long div_count<long long>(long long a, long long n) { return n ? a / n : 0; }

// numpy max/min propagate NaN
template <typename A> __device__ __forceinline__ A nmax(A a, A b) { return (a > b || a != a) ? a : b; }
template <typename A> __device__ __forceinline__ A nmin(A a, A b) { return (a < b || a != a) ? a : b; }

// -- reduction operators: init (identity), pre (per element), combine, post (with the count) ----
template <typename A> struct Sum {
  static __device__ __forceinline__ A init() { return A(0); }
  static __device__ __forceinline__ A pre(A x) { return x; }
  static __device__ __forceinline__ A combine(A a, A b) { return a + b; }
  static __device__ __forceinline__ A post(A a, long long) { return a; }
};
template <typename A> struct Mean : Sum<A> {
  static __device__ __forceinline__ A post(A a, long long n) { return div_count(a, n); }
};
template <typename A> struct SumSquare : Sum<A> {
  static __device__ __forceinline__ A pre(A x) { return x * x; }
};
template <typename A> struct L2 : SumSquare<A> {
  static __device__ __forceinline__ A post(A a, long long) { return fsqrt(a); }
};
template <typename A> struct Prod {
  static __device__ __forceinline__ A init() { return A(1); }
  static __device__ __forceinline__ A pre(A x) { return x; }
  static __device__ __forceinline__ A combine(A a, A b) { return a * b; }
  static __device__ __forceinline__ A post(A a, long long) { return a; }
};
template <typename A> struct Max {
  static __device__ __forceinline__ A init() { return Lim<A>::lowest(); }
  static __device__ __forceinline__ A pre(A x) { return x; }
  static __device__ __forceinline__ A combine(A a, A b) { return nmax(a, b); }
  static __device__ __forceinline__ A post(A a, long long) { return a; }
};
template <typename A> struct Min {
  static __device__ __forceinline__ A init() { return Lim<A>::highest(); }
  static __device__ __forceinline__ A pre(A x) { return x; }
  static __device__ __forceinline__ A combine(A a, A b) { return nmin(a, b); }
  static __device__ __forceinline__ A post(A a, long long) { return a; }
};

// every thread of the block gets the combination of all threads' `v` (blockDim.x a multiple of 32)
template <class Op, typename A> __device__ __forceinline__ A block_reduce(A v) {
  __shared__ A scratch[32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = Op::combine(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // the previous call's readers of scratch[0] are done
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = (static_cast<int>(threadIdx.x) < nwarps) ? scratch[threadIdx.x] : Op::init();
  if (warp == 0) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = Op::combine(v, __shfl_xor_sync(0xffffffffu, v, o));
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  return scratch[0];
}

// -- Reduce* ------------------------------------------------------------------------------------
template <class Op, typename A, typename TI, int KR, int RR, typename TO, int OR>
__device__ __forceinline__ void reduce_block(View<TI, KR> k, View<TI, RR> r, View<TO, OR> out) {
  const long long rows = k.numel(), n = r.numel();
  for (long long o = blockIdx.x; o < rows; o += gridDim.x) {
    const TI* base = k.p + off(k, o);
    A acc = Op::init();
    for (long long i = threadIdx.x; i < n; i += blockDim.x)
      acc = Op::combine(acc, Op::pre(static_cast<A>(load(base + off(r, i)))));
    acc = block_reduce<Op, A>(acc);
    if (threadIdx.x == 0) store(out.at_flat(o), Op::post(acc, n));
  }
}

template <class Op, typename A, typename TI, int KR, int RR, typename TO, int OR>
__device__ __forceinline__ void reduce_thread(View<TI, KR> k, View<TI, RR> r, View<TO, OR> out) {
  const long long rows = k.numel(), n = r.numel();
  for (long long o = global_thread(); o < rows; o += global_threads()) {
    const TI* base = k.p + off(k, o);
    A acc = Op::init();
    for (long long i = 0; i < n; ++i) acc = Op::combine(acc, Op::pre(static_cast<A>(load(base + off(r, i)))));
    store(out.at_flat(o), Op::post(acc, n));
  }
}

// -- ArgMax / ArgMin ------------------------------------------------------------------------------
// (v, i) beats (bv, bi): NaN beats numbers (numpy returns the first NaN); equal values go to the lower
// index, or the higher with select_last_index; index -1 marks "nothing yet".
template <bool IsMax, bool Last, typename A>
__device__ __forceinline__ bool arg_better(A v, long long i, A bv, long long bi) {
  if (i < 0) return false;
  if (bi < 0) return true;
  const bool vn = v != v, bn = bv != bv;
  if (vn || bn) return (vn && bn) ? (Last ? i > bi : i < bi) : vn;
  if (v == bv) return Last ? i > bi : i < bi;
  return IsMax ? v > bv : v < bv;
}

template <bool IsMax, bool Last, typename A>
__device__ __forceinline__ void arg_warp(A& v, long long& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const A ov = __shfl_xor_sync(0xffffffffu, v, o);
    const long long oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (arg_better<IsMax, Last>(ov, oi, v, i)) { v = ov; i = oi; }
  }
}

template <bool IsMax, bool Last, typename A, typename TI, int KR, int OR>
__device__ __forceinline__ void arg_block(View<TI, KR> k, View<TI, 1> r, View<long long, OR> out) {
  __shared__ A sv[32];
  __shared__ long long si[32];
  const long long rows = k.numel(), n = r.numel();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  for (long long o = blockIdx.x; o < rows; o += gridDim.x) {
    const TI* base = k.p + off(k, o);
    A bv = A(0);
    long long bi = -1;
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
      const A v = static_cast<A>(load(base + i * r.stride[0]));
      if (arg_better<IsMax, Last>(v, i, bv, bi)) { bv = v; bi = i; }
    }
    arg_warp<IsMax, Last>(bv, bi);
    __syncthreads();
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
      bv = lane < nwarps ? sv[lane] : A(0);
      bi = lane < nwarps ? si[lane] : -1;
      arg_warp<IsMax, Last>(bv, bi);
      if (lane == 0) *out.at_flat(o) = bi < 0 ? 0 : bi;
    }
  }
}

template <bool IsMax, bool Last, typename A, typename TI, int KR, int OR>
__device__ __forceinline__ void arg_thread(View<TI, KR> k, View<TI, 1> r, View<long long, OR> out) {
  const long long rows = k.numel(), n = r.numel();
  for (long long o = global_thread(); o < rows; o += global_threads()) {
    const TI* base = k.p + off(k, o);
    A bv = A(0);
    long long bi = -1;
    for (long long i = 0; i < n; ++i) {
      const A v = static_cast<A>(load(base + i * r.stride[0]));
      if (arg_better<IsMax, Last>(v, i, bv, bi)) { bv = v; bi = i; }
    }
    *out.at_flat(o) = bi < 0 ? 0 : bi;
  }
}

// -- Softmax / LogSoftmax (rows along one axis) -------------------------------------------------
// Softmax: m = max (taken as 0 when -inf, so a fully -inf row gives 0), e = exp(x - m), e / sum
// (a zero sum divides by 1). LogSoftmax: x - m - log(sum exp(x - m)), with no -inf special case,
// exactly like the reference.
template <bool Log, typename A>
__device__ __forceinline__ A softmax_value(A x, A m, A s) {
  if constexpr (Log) {
    return x - m - flog(s);
  } else {
    return fexp(x - m) / (s == A(0) ? A(1) : s);
  }
}

template <bool Log, typename A, typename T, int KR>
__device__ __forceinline__ void softmax_block(View<T, KR> xk, View<T, 1> xr, View<T, KR> yk, View<T, 1> yr) {
  const long long rows = xk.numel(), n = xr.numel();
  for (long long o = blockIdx.x; o < rows; o += gridDim.x) {
    const T* x = xk.p + off(xk, o);
    T* y = yk.p + off(yk, o);
    A m = Lim<A>::lowest();
    for (long long i = threadIdx.x; i < n; i += blockDim.x) m = nmax(m, static_cast<A>(load(x + i * xr.stride[0])));
    m = block_reduce<Max<A>, A>(m);
    if (!Log && m == Lim<A>::lowest()) m = A(0);
    A s = A(0);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) s += fexp(static_cast<A>(load(x + i * xr.stride[0])) - m);
    s = block_reduce<Sum<A>, A>(s);
    for (long long i = threadIdx.x; i < n; i += blockDim.x)
      store(y + i * yr.stride[0], softmax_value<Log, A>(static_cast<A>(load(x + i * xr.stride[0])), m, s));
  }
}

template <bool Log, typename A, typename T, int KR>
__device__ __forceinline__ void softmax_thread(View<T, KR> xk, View<T, 1> xr, View<T, KR> yk, View<T, 1> yr) {
  const long long rows = xk.numel(), n = xr.numel();
  for (long long o = global_thread(); o < rows; o += global_threads()) {
    const T* x = xk.p + off(xk, o);
    T* y = yk.p + off(yk, o);
    A m = Lim<A>::lowest();
    for (long long i = 0; i < n; ++i) m = nmax(m, static_cast<A>(load(x + i * xr.stride[0])));
    if (!Log && m == Lim<A>::lowest()) m = A(0);
    A s = A(0);
    for (long long i = 0; i < n; ++i) s += fexp(static_cast<A>(load(x + i * xr.stride[0])) - m);
    for (long long i = 0; i < n; ++i)
      store(y + i * yr.stride[0], softmax_value<Log, A>(static_cast<A>(load(x + i * xr.stride[0])), m, s));
  }
}

// -- LayerNormalization / RMSNormalization (block per row over the trailing normalized dims) ------
// Statistics in A (float for float16/float32): mean, then the variance as the mean of squared
// deviations (two passes, like the reference), inv = 1 / sqrt(var + eps). Scale and bias views span
// the normalized dims with stride 0 where they broadcast. Mean / InvStdDev are written when Stats.
template <bool Rms, bool Bias, bool Stats, typename A, typename T, typename TS, typename TB, int KR, int RR>
__device__ __forceinline__ void norm_block(View<T, KR> xk, View<T, RR> xr, View<T, KR> yk, View<T, RR> yr,
                                           View<TS, RR> scale, View<TB, RR> bias, View<float, KR> mean_out,
                                           View<float, KR> inv_out, A eps) {
  const long long rows = xk.numel(), n = xr.numel();
  for (long long o = blockIdx.x; o < rows; o += gridDim.x) {
    const T* x = xk.p + off(xk, o);
    T* y = yk.p + off(yk, o);
    A mean = A(0);
    if constexpr (!Rms) {
      A s = A(0);
      for (long long i = threadIdx.x; i < n; i += blockDim.x) s += static_cast<A>(load(x + off(xr, i)));
      mean = block_reduce<Sum<A>, A>(s) / static_cast<A>(n);
    }
    A q = A(0);
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
      const A d = static_cast<A>(load(x + off(xr, i))) - mean;
      q += d * d;
    }
    const A inv = A(1) / fsqrt(block_reduce<Sum<A>, A>(q) / static_cast<A>(n) + eps);
    if (Stats && threadIdx.x == 0) {
      if (mean_out.p) store(mean_out.p + off(mean_out, o), mean);
      if (inv_out.p) store(inv_out.p + off(inv_out, o), inv);
    }
    for (long long i = threadIdx.x; i < n; i += blockDim.x) {
      A v = (static_cast<A>(load(x + off(xr, i))) - mean) * inv * static_cast<A>(load(scale.p + off(scale, i)));
      if constexpr (Bias) v += static_cast<A>(load(bias.p + off(bias, i)));
      store(y + off(yr, i), v);
    }
  }
}

// AddRMSNormalization's prologue: s = a + b (rounded to T) for the rows this block owns, in the
// same grid-stride row order as norm_block, which then normalizes s (the block's own writes are
// visible to it after __syncthreads).
template <typename A, typename T, int KR, int RR>
__device__ __forceinline__ void add_rows(View<T, KR> ak, View<T, RR> ar, View<T, KR> bk, View<T, RR> br,
                                         View<T, KR> sk, View<T, RR> sr) {
  const long long rows = ak.numel(), n = ar.numel();
  for (long long o = blockIdx.x; o < rows; o += gridDim.x) {
    const T* a = ak.p + off(ak, o);
    const T* b = bk.p + off(bk, o);
    T* s = sk.p + off(sk, o);
    for (long long i = threadIdx.x; i < n; i += blockDim.x)
      store(s + off(sr, i), static_cast<A>(load(a + off(ar, i))) + static_cast<A>(load(b + off(br, i))));
  }
  __syncthreads();
}

// -- the same normalizations over rows contiguous along the normalized axis, 16 bytes at a time (ATLAS_NORM_VEC) -----
// norm_block and add_rows walk a row with one scalar load per element and thread, three times (the add, the
// statistics, the output): at a decode batch's 32 rows of 4096, 16 rounds of 2-byte loads per pass (an
// AddRMSNormalization took ~15 us for 1 MB on the H200, docs/perf.md v28; the cause read from the code, not ncu). Here each thread keeps VPT
// 16-byte pieces of its block's row in registers (n <= VPT * V * blockDim.x, V = 16 / sizeof(T)), so the row is read
// once (ADD: a and b, then s written) and y written once. Per element the arithmetic is norm_block's (s rounded to T
// first; A statistics, LayerNorm's variance from the deviations); only the order of the sums differs (per thread,
// then block_reduce). One block per row, grid-stride; the caller checks norm_vec_rows first.

// whether rows (kept dims k, normalized dim r) suit norm_rows_vec with `pieces` per thread: contiguous along r, a
// multiple of 16 bytes long and at most pieces x 16 bytes x the block's threads, every row start 16-byte aligned
template <typename T, int KR, int RR>
__device__ __forceinline__ bool norm_vec_rows(const View<T, KR>& k, const View<T, RR>& r, int pieces) {
  constexpr int V = 16 / sizeof(T);
  bool ok = RR == 1 && r.stride[0] == 1 && r.shape[0] % V == 0 && r.shape[0] <= 1LL * pieces * V * blockDim.x &&
            (reinterpret_cast<uintptr_t>(k.p) % 16 == 0);
#pragma unroll
  for (int i = 0; i < KR; ++i) ok = ok && (k.shape[i] == 1 || k.stride[i] % V == 0);
  return ok;
}

template <bool Rms, bool Bias, bool Stats, bool Add, int VPT, typename A, typename T, typename TS, typename TB, int KR>
__device__ __forceinline__ void norm_rows_vec(View<T, KR> xk, View<T, KR> bk, View<T, KR> sk, View<T, KR> yk,
                                              View<TS, 1> scale, View<TB, 1> bias, View<float, KR> mean_out,
                                              View<float, KR> inv_out, long long n, A eps) {
  constexpr int V = 16 / sizeof(T);
  const long long rows = xk.numel();
  for (long long o = blockIdx.x; o < rows; o += gridDim.x) {
    const T* x = xk.p + off(xk, o);
    A v[VPT][V];
    A total = A(0);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const long long i0 = (static_cast<long long>(j) * blockDim.x + threadIdx.x) * V;
      alignas(16) T t[V];  // (read and written as one uint4)
      if (i0 < n) {
        *reinterpret_cast<uint4*>(t) = *reinterpret_cast<const uint4*>(x + i0);
        if constexpr (Add) {  // s = a + b rounded to T, as add_rows stores it
          alignas(16) T u[V];
          *reinterpret_cast<uint4*>(u) = *reinterpret_cast<const uint4*>(bk.p + off(bk, o) + i0);
#pragma unroll
          for (int e = 0; e < V; ++e) store(t + e, static_cast<A>(load(t + e)) + static_cast<A>(load(u + e)));
          *reinterpret_cast<uint4*>(sk.p + off(sk, o) + i0) = *reinterpret_cast<const uint4*>(t);
        }
      }
#pragma unroll
      for (int e = 0; e < V; ++e) {
        v[j][e] = i0 < n ? static_cast<A>(load(t + e)) : A(0);
        total += v[j][e];
      }
    }
    A mean = A(0);
    if constexpr (!Rms) mean = block_reduce<Sum<A>, A>(total) / static_cast<A>(n);
    A q = A(0);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const long long i0 = (static_cast<long long>(j) * blockDim.x + threadIdx.x) * V;
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const A d = v[j][e] - mean;
        q += i0 < n ? d * d : A(0);
      }
    }
    const A inv = A(1) / fsqrt(block_reduce<Sum<A>, A>(q) / static_cast<A>(n) + eps);
    if (Stats && threadIdx.x == 0) {
      if (mean_out.p) store(mean_out.p + off(mean_out, o), mean);
      if (inv_out.p) store(inv_out.p + off(inv_out, o), inv);
    }
    T* y = yk.p + off(yk, o);
#pragma unroll
    for (int j = 0; j < VPT; ++j) {
      const long long i0 = (static_cast<long long>(j) * blockDim.x + threadIdx.x) * V;
      if (i0 < n) {
        alignas(16) T t[V];
#pragma unroll
        for (int e = 0; e < V; ++e) {
          A w = (v[j][e] - mean) * inv * static_cast<A>(load(scale.p + (i0 + e) * scale.stride[0]));
          if constexpr (Bias) w += static_cast<A>(load(bias.p + (i0 + e) * bias.stride[0]));
          store(t + e, w);
        }
        *reinterpret_cast<uint4*>(y + i0) = *reinterpret_cast<const uint4*>(t);
      }
    }
  }
}

}  // namespace rd
}  // namespace atlas
