// Linear (see linear.py): y[..., N] = x[..., K] @ w[N, K]^T (+ bias[N]).
//
// Layout: w is a contiguous [N, K] constant (one row per output feature); x and y are Views whose
// leading dims flatten to M rows (any strides); bias is [N] with a stride. Numerics: float32
// accumulation, the bias added in float32, one rounding at the store (matches the reference).
//
// Paths, chosen at run time from M (the grid is static, so every block takes the same branch); which
// path serves which M bucket is fixed at code generation (linear.py):
// - GEMV (M <= 32, decode, CUDA cores): each warp owns F consecutive output features; its lanes walk
//   those F weight rows with 16-byte loads (8 halves / 4 floats), U vectors per row per lane in
//   flight (F*U*16 bytes per lane), streamed past L1 (ld.global.nc.L1::no_allocate) so that x, read
//   through the read-only cache with the same 16-byte loads and reused by the F rows, stays in L1.
//   MT (a power of two >= M) rows of x are accumulated in registers (acc[F][MT]), then each sum is
//   reduced across the warp with shuffles and lane m stores row m. Row offsets of x and y are
//   computed once per block into shared memory. The 16-byte path needs K * sizeof(T) % 16 == 0,
//   16-byte aligned x rows (unit stride along K) and w; otherwise the same loop runs with scalar
//   loads through the strides.
// - MMA decode (M <= 32, float16, tensor cores): mma.sync m16n8k16 (fp16 in, fp32 accumulate) with
//   A = 16 weight rows x 16 k and B = 16 k x 8 rows of x (B[k][m] = x[m][k]), C = 16 features x 8 rows.
//   A block of 8 warps owns 16 features (blocks loop grid-stride over the N / 16 feature blocks); its
//   warps split K into interleaved 32-k steps and each accumulates J = ceil(MT / 8) tiles of 8 rows
//   of x; the partial C fragments are summed through shared memory (in warp order: deterministic) and
//   stored. The weights keep their [N, K] layout: inside a k16 tile the k order is free as long as A
//   and B agree, so fragment k (2c, 2c+1, 2c+8, 2c+9) (c = lane % 4) is read at k 4c .. 4c+3 of the
//   tile; a 32-k step is then one 16-byte load per lane of each of the weight rows n0 + lane / 4 and
//   n0 + lane / 4 + 8 (at k0 + 8c .. 8c+7; streamed, U steps in flight) and one 16-byte load of x row
//   m = lane / 4 + 8j (through L1: every warp reads it), feeding two mma k16 steps. Narrow plain
//   projections also split K across KS blocks (linear.py decode_ks), the last block of each feature block
//   adding the KS partial sums from the scratch in a fixed order.
// - MMA prefill (M > 32, float16): the same fragments; each warp works on 16 features and a 64-row
//   tile of M (J = 8, each A fragment reused by the 8 tiles). A block (an item: blocks loop
//   grid-stride over them) is 8 warps = F blocks of 16 features x S ways of split-K over one M tile,
//   S = 1, 2, 4, 8 chosen at run time as the smallest that gives >= 512 items (at small M or N,
//   S = 1 would leave SMs idle); S > 1 sums the partial fragments through shared memory.
//   The MMA paths need K % 32 == 0, 16-byte aligned x rows with unit stride along K, a 16-byte aligned
//   w and sm80+ (lin_mma_ok, checked at run time); otherwise the GEMV / tiled path runs. Weight rows
//   n >= N are read as row N-1 and x rows m >= M as row M-1; neither is stored.
// - tiled (M > 32, prefill, CUDA cores): matmul_tiled of matmul.cu with B = w^T expressed through
//   strides (B[k, n] = w[n * K + k]: k-major loads stay coalesced) and the bias as a stride-0 row.
// Warps loop grid-stride over feature groups and blocks over tiles, so any grid is correct.
namespace atlas {

constexpr int LIN_THREADS = 256;
constexpr int LIN_WARPS = LIN_THREADS / 32;
constexpr int LIN_GEMV_MAX_M = 32;
constexpr int LIN_MMA_M = 64;  // rows of x per MMA prefill tile (8 mma n-tiles)
constexpr int LIN_MMA_ITEMS = 512;  // MMA prefill: split K until there are this many items (~4 per SM)

// a 16-byte load of weights that are read once: bypass L1
__device__ __forceinline__ uint4 lin_ld_stream(const void* p) {
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}

// the same with the L2 asked to fetch the aligned 256 bytes around it from DRAM (sm80+; lin_ld_stream before):
// the int8 weight loads (quant.cu QLIN_L2_HINT), where a lane reads 16 of a row's bytes and the warps of its block
// the neighbouring ones
__device__ __forceinline__ uint4 lin_ld_stream_l2(const void* p) {
#if __CUDA_ARCH__ >= 800
  uint4 r;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
#else
  return lin_ld_stream(p);
#endif
}

// cp.async and shared-space helpers (sm80+; nothing on older arches, where the paths that call them never run),
// shared by flash_attention.cu and gemm.cu
__device__ __forceinline__ unsigned lin_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared (dst: a shared address), bypassing L1; zero-filled when !full (nothing is read then)
__device__ __forceinline__ void lin_cp16(unsigned dst, const void* src, bool full = true) {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(full ? 16 : 0) : "memory");
#endif
}
__device__ __forceinline__ void lin_cp_commit() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
// this thread's copies of all but its N most recent groups have landed
template <int N> __device__ __forceinline__ void lin_cp_wait() {
#if __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

template <typename T> struct LinVec;
template <> struct LinVec<float> {
  static constexpr int N = 4;
  static constexpr bool MMA = false;  // the MMA paths take float16 only
  __device__ __forceinline__ static void unpack(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    f[2] = __uint_as_float(v.z); f[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 pack(const float* f) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
  }
};
template <> struct LinVec<__half> {
  static constexpr int N = 8;
  static constexpr bool MMA = true;
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
  __device__ __forceinline__ static uint4 pack(const float* f) {  // rounds each value to float16
    unsigned int u[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
      u[i] = *reinterpret_cast<const unsigned int*>(&h);
    }
    return make_uint4(u[0], u[1], u[2], u[3]);
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

// -- x sources of the decode paths (GEMV and MMA decode) ------------------------------------------
// A source hands out row m (< M) of the Linear's input at column k: `vec` 16 bytes (V values from a
// multiple of V; only called when the block's `vec` flag holds), `at` one value. XView reads a View;
// the fused projections (linear_prologue.py) first compute x from the tensors its producer would have
// read (XNorm, XFn), stage it in shared memory once per block, then read it through XSmem.
template <typename T> struct XView {
  const T* p;
  const long long* off;  // row offsets (shared memory)
  long long ks;          // stride along K
  __device__ __forceinline__ uint4 vec(int m, long long k) const {
    return __ldg(reinterpret_cast<const uint4*>(p + off[m] + k));
  }
  __device__ __forceinline__ float at(int m, long long k) const { return float(load(p + off[m] + k * ks)); }
};

// RMSNormalization (ADD: AddRMSNormalization) as the prologue, staged: lin_norm_stage writes
// x = T(h * inv * g) for the block's M rows into shared memory, h = a (ADD: h = T(a + b), the sum that
// AddRMSNormalization stores), inv = 1 / sqrt(mean(h^2) + eps): the float32 arithmetic of norm_block in
// reduce.cu. The decode loops then read x through XSmem.
template <typename T, bool ADD> struct XNorm {
  const T* a;
  const T* b;
  const T* g;
  const long long* aoff;
  const long long* boff;
  long long ak, bk, gk;  // strides along K
  __device__ __forceinline__ float h(int m, long long k) const {
    const float v = float(load(a + aoff[m] + k * ak));
    if constexpr (ADD) return float(T(v + float(load(b + boff[m] + k * bk))));
    return v;
  }
  // V values of h from k (16-byte reads; only when the rows allow)
  __device__ __forceinline__ void h_vec(int m, long long k, float* v) const {
    LinVec<T>::unpack(__ldg(reinterpret_cast<const uint4*>(a + aoff[m] + k)), v);
    if constexpr (ADD) {
      float w[LinVec<T>::N];
      LinVec<T>::unpack(__ldg(reinterpret_cast<const uint4*>(b + boff[m] + k)), w);
      add_b(v, w);
    }
  }
  // h_vec in two halves (lin_norm_stage's AHEAD form): the 16 bytes of a (and b) at k, then their V values of h
  __device__ __forceinline__ void h_load(int m, long long k, uint4& ra, uint4& rb) const {
    ra = __ldg(reinterpret_cast<const uint4*>(a + aoff[m] + k));
    if constexpr (ADD) rb = __ldg(reinterpret_cast<const uint4*>(b + boff[m] + k));
  }
  __device__ __forceinline__ void h_of(const uint4& ra, const uint4& rb, float* v) const {
    LinVec<T>::unpack(ra, v);
    if constexpr (ADD) {
      float w[LinVec<T>::N];
      LinVec<T>::unpack(rb, w);
      add_b(v, w);
    }
  }
  // h = T(a + b), the sum AddRMSNormalization stores
  __device__ __forceinline__ static void add_b(float* v, const float* w) {
#pragma unroll
    for (int e = 0; e < LinVec<T>::N; ++e) v[e] = float(T(v[e] + w[e]));
  }
};

constexpr int LIN_PRO_M = 8;  // most rows of a staged prologue (PROLOGUE_MAX_M in atlasc/ir/ops/prologue.py)

// the norm prologue staged into buf [M, K] (M <= LIN_PRO_M): one pass reads a (and b), keeps h in buf
// and sums h^2 per row in registers (block 0 also writes h to s, the sum output, when s is given); one
// block reduction for all rows; a second pass scales buf in place. scratch: LIN_WARPS * LIN_PRO_M + LIN_PRO_M
// floats of shared memory. Ends with __syncthreads.
// AHEAD > 0 (ATLAS_NORM_LOADS_AHEAD, linear_prologue.py; 16-byte rows with K <= AHEAD * blockDim.x * V): a thread
// issues the loads of all its chunks of a row (a, b) before it uses any, and its chunks of g with the first row's,
// so a row costs one memory latency instead of one per chunk of a / b and again one per chunk of g (up to four at K =
// 4096 float16 values); its second pass then scales the same chunks. Same values in the same order per element, so
// the staged x is bit-identical by construction (the GPU tests check both forms against numpy, not against each
// other). Opt-in: slower in the int4 step (docs/perf.md v38).
template <typename T, bool ADD, int R, int AHEAD = 0>
__device__ __forceinline__ void lin_norm_stage(const XNorm<T, ADD>& src, long long M, long long K, float eps, T* buf,
                                               const View<T, R>& s, bool has_s, float* scratch, bool vec) {
  constexpr int V = LinVec<T>::N;
  constexpr int P = AHEAD > 0 ? AHEAD : 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool write_s = has_s && blockIdx.x == 0;
  const bool ahead = AHEAD > 0 && vec && K <= (long long)P * blockDim.x * V;  // block-uniform
  uint4 gk[P];  // (ahead) this thread's chunks of g: k = (threadIdx.x + p blockDim.x) V
  float q[LIN_PRO_M];
#pragma unroll
  for (int m = 0; m < LIN_PRO_M; ++m) {
    q[m] = 0.f;
    if (m >= M) continue;
    T* srow = write_s ? s.p + lin_row_offset(s, m) : nullptr;
    if (ahead) {
      uint4 ra[P], rb[P];
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const long long k = ((long long)threadIdx.x + p * blockDim.x) * V;
        if (k < K) {
          src.h_load(m, k, ra[p], rb[p]);
          if (m == 0) gk[p] = __ldg(reinterpret_cast<const uint4*>(src.g + k));
        }
      }
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const long long k = ((long long)threadIdx.x + p * blockDim.x) * V;
        if (k >= K) continue;
        float v[V];
        src.h_of(ra[p], rb[p], v);
#pragma unroll
        for (int e = 0; e < V; ++e) q[m] += v[e] * v[e];
        const uint4 packed = LinVec<T>::pack(v);  // exact: h is a T value
        *reinterpret_cast<uint4*>(buf + m * K + k) = packed;
        if (srow) *reinterpret_cast<uint4*>(srow + k) = packed;
      }
    } else if (vec) {
      for (long long k = threadIdx.x * V; k < K; k += blockDim.x * V) {
        float v[V];
        src.h_vec(m, k, v);
#pragma unroll
        for (int e = 0; e < V; ++e) q[m] += v[e] * v[e];
        const uint4 packed = LinVec<T>::pack(v);  // exact: h is a T value
        *reinterpret_cast<uint4*>(buf + m * K + k) = packed;
        if (srow) *reinterpret_cast<uint4*>(srow + k) = packed;  // s rows: unit stride, aligned (s from the planner)
      }
    } else {
      for (long long k = threadIdx.x; k < K; k += blockDim.x) {
        const float v = src.h(m, k);
        q[m] += v * v;
        buf[m * K + k] = T(v);
        if (srow) store(srow + k * s.stride[R - 1], v);
      }
    }
  }
  float* inv = scratch + LIN_WARPS * LIN_PRO_M;
#pragma unroll
  for (int m = 0; m < LIN_PRO_M; ++m) {
    const float t = warp_sum(q[m]);
    if (lane == 0) scratch[warp * LIN_PRO_M + m] = t;
  }
  __syncthreads();
  if (threadIdx.x < M) {
    float t = 0.f;
    for (int w = 0; w < LIN_WARPS; ++w) t += scratch[w * LIN_PRO_M + threadIdx.x];
    inv[threadIdx.x] = 1.f / sqrtf(t / float(K) + eps);
  }
  __syncthreads();
  if (ahead) {  // the chunks this thread read, in every row, with its g from registers
    for (int m = 0; m < M; ++m) {
      const float r = inv[m];
#pragma unroll
      for (int p = 0; p < P; ++p) {
        const long long k = ((long long)threadIdx.x + p * blockDim.x) * V;
        if (k >= K) continue;
        float v[V], gv[V];
        LinVec<T>::unpack(*reinterpret_cast<const uint4*>(buf + m * K + k), v);
        LinVec<T>::unpack(gk[p], gv);
#pragma unroll
        for (int e = 0; e < V; ++e) v[e] = v[e] * r * gv[e];
        *reinterpret_cast<uint4*>(buf + m * K + k) = LinVec<T>::pack(v);  // rounds to T
      }
    }
  } else if (vec) {
    const long long kv = K / V;
    for (long long i = threadIdx.x; i < M * kv; i += blockDim.x) {
      const long long m = i / kv, k = (i - m * kv) * V;
      float v[V], gv[V];
      LinVec<T>::unpack(*reinterpret_cast<const uint4*>(buf + m * K + k), v);
      LinVec<T>::unpack(__ldg(reinterpret_cast<const uint4*>(src.g + k)), gv);
      const float r = inv[m];
#pragma unroll
      for (int e = 0; e < V; ++e) v[e] = v[e] * r * gv[e];
      *reinterpret_cast<uint4*>(buf + m * K + k) = LinVec<T>::pack(v);  // rounds to T
    }
  } else {
    for (long long i = threadIdx.x; i < M * K; i += blockDim.x) {
      const long long m = i / K, k = i - m * K;
      buf[i] = T(float(buf[i]) * inv[m] * float(load(src.g + k * src.gk)));
    }
  }
  __syncthreads();
}

// an elementwise program as the prologue: x = fn(m, k), already rounded to T by the generated code
template <typename T, typename Fn> struct XFn {
  Fn fn;
  __device__ __forceinline__ float at(int m, long long k) const { return fn(m, k); }
  __device__ __forceinline__ uint4 vec(int m, long long k) const {
    constexpr int V = LinVec<T>::N;
    float f[V];
#pragma unroll
    for (int e = 0; e < V; ++e) f[e] = fn(m, k + e);
    return LinVec<T>::pack(f);
  }
};

// x staged in shared memory: M rows of K values at p + m * K (lin_stage fills it once per block, so the
// decode loops read each x value from shared memory instead of recomputing it per warp and per step)
template <typename T> struct XSmem {
  const T* p;
  long long K;
  __device__ __forceinline__ uint4 vec(int m, long long k) const {
    return *reinterpret_cast<const uint4*>(p + m * K + k);
  }
  __device__ __forceinline__ float at(int m, long long k) const { return float(p[m * K + k]); }
};

// every x value of a prologue source into buf (16-byte pieces when vec: K % V == 0); ends with
// __syncthreads
template <typename T, typename XS>
__device__ __forceinline__ void lin_stage(const XS& src, long long M, long long K, T* buf, bool vec) {
  if (vec) {
    constexpr int V = LinVec<T>::N;
    const long long kv = K / V;
    for (long long i = threadIdx.x; i < M * kv; i += blockDim.x) {
      const long long m = i / kv, k = (i - m * kv) * V;
      *reinterpret_cast<uint4*>(buf + m * K + k) = src.vec(int(m), k);
    }
  } else {
    for (long long i = threadIdx.x; i < M * K; i += blockDim.x) buf[i] = T(src.at(int(i / K), i % K));
  }
  __syncthreads();
}

// whether this arch has the MMA paths (sm80+)
__device__ __forceinline__ bool lin_sm80() {
#if __CUDA_ARCH__ >= 800
  return true;
#else
  return false;
#endif
}

// whether a View's rows can be read with 16-byte loads: unit stride along K, 16-byte aligned rows
template <typename T, int R> __device__ __forceinline__ bool lin_vec_rows(const View<T, R>& v) {
  constexpr int V = LinVec<T>::N;
  bool ok = v.stride[R - 1] == 1 && (reinterpret_cast<uintptr_t>(v.p) % 16 == 0);
#pragma unroll
  for (int i = 0; i < R - 1; ++i) ok = ok && (v.shape[i] == 1 || v.stride[i] % V == 0);
  return ok;
}

// row offsets of the first M rows of a View into shared memory (no barrier)
template <typename T, int R> __device__ __forceinline__ void lin_offsets(const View<T, R>& v, long long M, long long* off) {
  if (threadIdx.x < M) off[threadIdx.x] = lin_row_offset(v, threadIdx.x);
}

// one round of the GEMV's 16-byte path: U vectors wv[u][f] of each of the F rows, at vector v0 + 32u
template <typename T, int MT, int F, int U, typename XS>
__device__ __forceinline__ void lin_round_vec(float (&acc)[F][MT], const uint4 (&wv)[U][F], const XS& xs, long long M,
                                              long long v0) {
  constexpr int V = LinVec<T>::N;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    float wf[F][V];
#pragma unroll
    for (int f = 0; f < F; ++f) LinVec<T>::unpack(wv[u][f], wf[f]);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < M) {
        float xf[V];
        LinVec<T>::unpack(xs.vec(m, (v0 + 32 * u) * V), xf);
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
          for (int e = 0; e < V; ++e) acc[f][m] = fmaf(wf[f][e], xf[e], acc[f][m]);
      }
    }
  }
}

// one feature group [n0, n0 + F) of the GEMV, 16-byte loads into wv. loaded: wv already holds the group's first
// round (loaded before the kernel's wait, linear_gemv; only when 32 * U <= K / V, so that it is a whole round).
// One buffer for both, so that the preloaded round takes no registers of its own.
template <typename T, int MT, int F, int U, typename XS>
__device__ __forceinline__ void lin_group_vec(float (&acc)[F][MT], const XS& xs, long long M,
                                              const T* __restrict__ w, long long n0, long long N, long long K,
                                              int lane, long long step, uint4 (&wv)[U][F], bool loaded) {
  constexpr int V = LinVec<T>::N;
  const long long KV = K / V;  // 16-byte vectors per row
  const T* wr[F];
#pragma unroll
  for (int f = 0; f < F; ++f) wr[f] = w + imin(n0 + f * step, N - 1) * K;  // rows past N: read row N-1, discard
  long long v0 = lane;
  for (; v0 + 32 * (U - 1) < KV; v0 += 32 * U) {
    if (!loaded) {
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int f = 0; f < F; ++f) wv[u][f] = lin_ld_stream(wr[f] + (v0 + 32 * u) * V);
    }
    loaded = false;
    lin_round_vec<T, MT, F, U>(acc, wv, xs, M, v0);
  }
  for (; v0 < KV; v0 += 32) {  // remainder: one vector per row at a time
    float wf[F][V];
#pragma unroll
    for (int f = 0; f < F; ++f) LinVec<T>::unpack(lin_ld_stream(wr[f] + v0 * V), wf[f]);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < M) {
        float xf[V];
        LinVec<T>::unpack(xs.vec(m, v0 * V), xf);
#pragma unroll
        for (int f = 0; f < F; ++f)
#pragma unroll
          for (int e = 0; e < V; ++e) acc[f][m] = fmaf(wf[f][e], xf[e], acc[f][m]);
      }
    }
  }
}

// the same with scalar loads (any alignment)
template <typename T, int MT, int F, typename XS>
__device__ __forceinline__ void lin_group_scalar(float (&acc)[F][MT], const XS& xs, long long M,
                                                 const T* __restrict__ w, long long n0, long long N, long long K,
                                                 int lane, long long step) {
  const T* wr[F];
#pragma unroll
  for (int f = 0; f < F; ++f) wr[f] = w + imin(n0 + f * step, N - 1) * K;
  for (long long k = lane; k < K; k += 32) {
    float wf[F];
#pragma unroll
    for (int f = 0; f < F; ++f) wf[f] = float(load(wr[f] + k));
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m < M) {
        const float xv = xs.at(m, k);
#pragma unroll
        for (int f = 0; f < F; ++f) acc[f][m] = fmaf(wf[f], xv, acc[f][m]);
      }
    }
  }
}

// Paired epilogues: output pair p reads weight rows row_a(p) and row_b(p) (row_a < row_b), N / 2 pairs;
// put(yrow, yn, m, p, za, zb) gets both sums (+ bias) rounded to T as the unfused Linear stores them and
// writes what the epilogue makes of them. LinNoEpi: none (a plain Linear).
struct LinNoEpi {
  static constexpr bool PAIRED = false;
  __device__ __forceinline__ long long row_a(long long p, long long) const { return p; }
  __device__ __forceinline__ long long row_b(long long p, long long) const { return p; }
  template <typename T>
  __device__ __forceinline__ void put(T*, long long, long long, long long, float, float) const {}
};
// gated (y[j] = f(gate_j, up_j), gate rows 0 .. H-1 and up rows H .. 2H-1 of w, y [.., H])
template <typename F>
struct LinGated {
  F f;
  static constexpr bool PAIRED = true;
  __device__ __forceinline__ long long row_a(long long p, long long) const { return p; }
  __device__ __forceinline__ long long row_b(long long p, long long n) const { return n / 2 + p; }
  template <typename T>
  __device__ __forceinline__ void put(T* yrow, long long yn, long long, long long p, float za, float zb) const {
    store(yrow + p * yn, f(za, zb));
  }
};
template <typename E> __host__ __device__ constexpr bool lin_gated() { return E::PAIRED; }
// a paired epilogue E over rows m0 + m: the epilogue projections (linear_epilogue.py) run the GEMV over more rows
// than its MT in chunks of MT rows, each chunk's row m being row m0 + m of the projection
template <typename E>
struct LinRowsFrom {
  E e;
  long long m0;
  static constexpr bool PAIRED = E::PAIRED;
  __device__ __forceinline__ long long row_a(long long p, long long n) const { return e.row_a(p, n); }
  __device__ __forceinline__ long long row_b(long long p, long long n) const { return e.row_b(p, n); }
  template <typename Y>
  __device__ __forceinline__ void put(Y* yrow, long long yn, long long m, long long p, float za, float zb) const {
    e.put(yrow, yn, m0 + m, p, za, zb);
  }
};
template <typename T> __device__ __forceinline__ float lin_round(float v) { return float(T(v)); }

// x * c + partner * s with each product and the sum rounded to T, as QKVRotary's reference rounds them
template <typename T>
__device__ __forceinline__ T lin_rot(float x, float partner, float c, float s) {
  return T(__fadd_rn(lin_round<T>(__fmul_rn(x, c)), lin_round<T>(__fmul_rn(partner, s))));
}

// rotary + KV-cache append (QKVRotary) as the merged QKV projection's paired epilogue. Row m = b * S + s of
// x; pair p of head h = p / (D / 2), i = p % (D / 2): dims (i, i + R / 2) when i < R / 2 (rotate-half over
// the first R dims of q and k heads), else (i + R / 2, i + D / 2) (passed through). q heads go to q
// [B, Hq, S, D]; k and v heads into the cache views pk / pv [B, Hk, past + S, D] (equal strides: the emitter
// checks both are cache views) at position past + s.
template <typename T>
struct LinRotary {
  View<T, 3> cs, sn;  // [1 or B, S, R]
  View<T, 4> q, pk, pv;
  long long Hq, Hk, D, R, S, past, max_batch, max_seq;
  static constexpr bool PAIRED = true;
  // 32-bit index math (pairs < 2^31): a 64-bit division is ~10x the instructions
  __device__ __forceinline__ int dim_a(int i) const { return i < int(R) / 2 ? i : i + int(R) / 2; }
  __device__ __forceinline__ int dim_b(int i) const { return i < int(R) / 2 ? i + int(R) / 2 : i + int(D) / 2; }
  __device__ __forceinline__ long long row_a(long long p, long long) const {
    return (int(p) / (int(D) / 2)) * D + dim_a(int(p) % (int(D) / 2));
  }
  __device__ __forceinline__ long long row_b(long long p, long long) const {
    return (int(p) / (int(D) / 2)) * D + dim_b(int(p) % (int(D) / 2));
  }
  template <typename Y>
  __device__ __forceinline__ void put(Y*, long long, long long m, long long p, float za, float zb) const {
    const int h = int(p) / (int(D) / 2), i = int(p) % (int(D) / 2), da = dim_a(i), db = dim_b(i);
    const long long b = m / S, s = m % S;
    T oa = T(za), ob = T(zb);
    if (h < Hq + Hk && i < int(R) / 2) {
      const long long cb = cs.shape[0] == 1 ? 0 : b;
      const T* cr = cs.p + cb * cs.stride[0] + s * cs.stride[1];
      const T* sr = sn.p + cb * sn.stride[0] + s * sn.stride[1];
      oa = lin_rot<T>(za, -zb, float(cr[da * cs.stride[2]]), float(sr[da * sn.stride[2]]));
      ob = lin_rot<T>(zb, za, float(cr[db * cs.stride[2]]), float(sr[db * sn.stride[2]]));
    }
    // scalar selects, not a reference to q / pk / pv: that would put the whole struct on the stack
    const bool is_q = h < Hq, is_k = h < Hq + Hk;
    if (!is_q && (b >= max_batch || past + s >= max_seq)) return;
    T* base = is_q ? q.p : is_k ? pk.p : pv.p;
    const long long s0 = is_q ? q.stride[0] : pk.stride[0], s1 = is_q ? q.stride[1] : pk.stride[1];
    const long long s2 = is_q ? q.stride[2] : pk.stride[2], s3 = is_q ? q.stride[3] : pk.stride[3];
    const long long hh = is_q ? h : is_k ? h - Hq : h - Hq - Hk, pos = is_q ? s : past + s;
    T* row = base + b * s0 + hh * s1 + pos * s2;
    row[da * s3] = oa;
    row[db * s3] = ob;
  }
};

// Early weights (linear.py early_mode): what a decode path runs once, with every thread of the block, after
// its warps have issued their first round of weight loads. LinNoPro: nothing (the kernel waited for the
// previous one at its start: pdl_enter). LinPro: f = the wait (pdl_enter) and whatever must follow it before x
// is read (a fused prologue's staging), so the first weights are on their way while the previous kernel drains
// and while x is staged; weights are constants, the only memory read before the wait (with the dims, which the
// step's input copy wrote before its first kernel). TRIGGER: a block also lets the next kernel launch
// (pdl_leave) as it starts its last item instead of at its end, so that kernel's first weight loads overlap
// this one's tail.
struct LinNoPro {
  static constexpr bool EARLY = false, TRIGGER = false;
  __device__ __forceinline__ void operator()() const {}
};
template <typename F, bool TRIG>
struct LinPro {
  F f;
  static constexpr bool EARLY = true, TRIGGER = TRIG;
  __device__ __forceinline__ void operator()() const { f(); }
};

// GEMV over every feature group (M <= MT <= 32); x from the source xs; yoff: row offsets in shared
// memory. Paired (EPI not LinNoEpi, F = 2): group p reads weight rows epi.row_a(p) and epi.row_b(p),
// rounds both sums (+ bias) to T as the unfused Linear stores them and hands them to epi.put. pro: see LinPro
// (each warp's first group's first round is loaded before it).
template <typename T, int R, int MT, int F, int U, bool HAS_BIAS, typename XS, typename EPI = LinNoEpi,
          typename PRO = LinNoPro>
__device__ __forceinline__ void linear_gemv(const XS& xs, const T* __restrict__ w, const T* __restrict__ bias,
                                            long long bias_stride, const View<T, R>& y, long long M, long long N,
                                            long long K, const long long* yoff, bool vec, EPI epi = EPI(),
                                            PRO pro = PRO()) {
  constexpr bool GATED = lin_gated<EPI>();
  constexpr int V = LinVec<T>::N;
  static_assert(!GATED || F == 2, "the paired GEMV holds two rows per group");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const long long H = N / 2;
  const long long groups = GATED ? H : (N + F - 1) / F;
  const long long yn = y.stride[R - 1];
  const long long g0 = (long long)blockIdx.x * LIN_WARPS + warp, gstride = (long long)gridDim.x * LIN_WARPS;
  uint4 wv[U][F];  // the 16-byte path's weight round (lin_group_vec)
  bool loaded = PRO::EARLY && vec && g0 < groups && 32 * U <= K / V;
  if (loaded) {
    const long long n0 = GATED ? epi.row_a(g0, N) : g0 * F, step = GATED ? epi.row_b(g0, N) - n0 : 1;
#pragma unroll
    for (int f = 0; f < F; ++f) {
      const T* wr = w + imin(n0 + f * step, N - 1) * K;
#pragma unroll
      for (int u = 0; u < U; ++u) wv[u][f] = lin_ld_stream(wr + (lane + 32 * u) * V);
    }
  }
  pro();
  for (long long g = g0; g < groups; g += gstride) {
    if constexpr (PRO::TRIGGER) {
      if (g + gstride >= groups) pdl_leave();  // this warp's last group (the block's first such warp counts)
    }
    const long long n0 = GATED ? epi.row_a(g, N) : g * F, step = GATED ? epi.row_b(g, N) - n0 : 1;
    float acc[F][MT];
#pragma unroll
    for (int f = 0; f < F; ++f)
#pragma unroll
      for (int m = 0; m < MT; ++m) acc[f][m] = 0.f;
    if (vec) {
      lin_group_vec<T, MT, F, U>(acc, xs, M, w, n0, N, K, lane, step, wv, loaded);
      loaded = false;
    } else {
      lin_group_scalar<T, MT, F>(acc, xs, M, w, n0, N, K, lane, step);
    }
    if constexpr (GATED) {
      float bg = 0.f, bu = 0.f;
      if constexpr (HAS_BIAS) {
        bg = float(load(bias + n0 * bias_stride));
        bu = float(load(bias + (n0 + step) * bias_stride));
      }
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float sg = warp_sum(acc[0][m]), su = warp_sum(acc[F - 1][m]);
        if (m < M && lane == m) epi.put(y.p + yoff[m], yn, m, g, lin_round<T>(sg + bg), lin_round<T>(su + bu));
      }
    } else {
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

// -- tensor-core paths (see the header) ----------------------------------------------------------

// whether the MMA paths apply: float16, sm80+, K % 32 == 0, 16-byte aligned x rows (unit stride
// along K) and w
// x rows 16-byte aligned with unit stride along K, and w 16-byte aligned (shared with quant.cu)
template <typename T, int R>
__device__ __forceinline__ bool lin_rows_aligned(const View<T, R>& x, const void* w) {
  bool ok = x.stride[R - 1] == 1 && (reinterpret_cast<uintptr_t>(x.p) % 16 == 0) &&
            (reinterpret_cast<uintptr_t>(w) % 16 == 0);
#pragma unroll
  for (int i = 0; i < R - 1; ++i) ok = ok && (x.shape[i] == 1 || x.stride[i] % 8 == 0);
  return ok;
}

template <typename T, int R>
__device__ __forceinline__ bool lin_mma_ok(const View<T, R>& x, const T* w, long long K) {
#if __CUDA_ARCH__ >= 800
  return LinVec<T>::MMA && K % 32 == 0 && lin_rows_aligned(x, w);
#else
  return false;
#endif
}

// d += A * B for one m16n8k16 tile: a = {a0a1, a2a3, a4a5, a6a7}, b = {b0b1, b2b3} (f16x2 registers)
__device__ __forceinline__ void lin_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                        unsigned b0, unsigned b1) {
#if __CUDA_ARCH__ >= 800
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// one 32-k step: wlo / whi hold weight rows n0 + g / n0 + g + 8 at k0 + 8c .. 8c+7, xv x row m at the
// same k. Fragment k (2c, 2c+1 | 2c+8, 2c+9) of the first k16 step is k0 + 8c + (0, 1 | 2, 3), of the
// second k0 + 8c + (4, 5 | 6, 7): A and B use the same permutation, so the products are unchanged.
__device__ __forceinline__ void lin_mma_step(float (&d)[4], const uint4& wlo, const uint4& whi, const uint4& xv) {
  lin_mma(d, wlo.x, whi.x, wlo.y, whi.y, xv.x, xv.y);
  lin_mma(d, wlo.z, whi.z, wlo.w, whi.w, xv.z, xv.w);
}

// MMA decode (M <= 8 * J <= 32): a block per 16 * FT features, its warps split K; x from the source xs
// (16-byte reads); yoff: row offsets (linear_gemv_setup), red: 1024 * J floats of shared memory.
// FT > 1 (not paired): each warp multiplies FT feature tiles of 16 by the same x fragments, so a block
// reads x once per 16 * FT features instead of once per 16 (at M = 32, x is 32 rows: per 16 features it
// is twice the weight bytes, served from L2); the FT tiles' partial sums are reduced one tile at a time
// through red.
// Paired (see linear_gemv): a block holds 8 pairs p0 + g, its A rows g are rows epi.row_a(p0 + g) and its
// rows g + 8 rows epi.row_b(p0 + g); each row_a partial is reduced with its row_b partial (q, q + 2).
// KS > 1 (plain, FT = 1; narrow outputs, whose N / 16 blocks alone leave SMs short of loads in flight): K is
// also split across ks_n <= KS blocks (an item is a feature block and one of ks_n contiguous runs of its
// steps; ks_n is a run-time argument, so one inlined copy serves M = 1 and M > 1 with different splits: two
// copies took the kernel from 56 to 80-104 registers, docs/perf.md v19). With ks_n > 1 each block writes its
// reduced 16 x 8J partial sums to ws (float32, [item][4J x 32 slots]) and bumps the feature block's counter
// cnt; the block that arrives last adds the ks_n partials in run order (deterministic), then adds the bias
// and stores, and puts the counter back to 0 (the scratch's counters start and end at 0).
// pro: see LinPro (the block's first item's first round of U steps is loaded before it).
template <typename T, int R, int J, int U, bool HAS_BIAS, int FT = 1, int KS = 1, typename XS, typename EPI = LinNoEpi,
          typename PRO = LinNoPro>
__device__ __forceinline__ void linear_mma_decode(const XS& xs, const T* __restrict__ w,
                                                  const T* __restrict__ bias, long long bias_stride,
                                                  const View<T, R>& y, long long M, long long N, long long K,
                                                  const long long* yoff, float* red, EPI epi = EPI(),
                                                  float* __restrict__ ws = nullptr, unsigned int* cnt = nullptr,
                                                  int ks_n = KS, PRO pro = PRO()) {
  constexpr bool GATED = lin_gated<EPI>();
  static_assert(FT == 1 || !GATED, "paired epilogues hold one feature tile per warp");
  static_assert(KS == 1 || (FT == 1 && !GATED), "a K split across blocks is for plain one-tile projections");
  constexpr int SLOTS = 4 * J * 32;  // one feature block's partial sums (red's rows r = 4j + q x 32 lanes)
  __shared__ bool lin_last;  // KS > 1: this block is the feature block's last run to finish
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const long long H = N / 2;
  const long long steps = K / 32, blocks_n = GATED ? (H + 7) / 8 : (N + 16 * FT - 1) / (16 * FT);
  if constexpr (KS == 1) ks_n = 1;
  const bool split = KS > 1 && ks_n > 1;
  const long long run = (steps + ks_n - 1) / ks_n;  // steps per run of the K split
  const long long yn = y.stride[R - 1];
  int xm[J];
#pragma unroll
  for (int j = 0; j < J; ++j) xm[j] = int(imin(8 * j + g, M - 1));
  const long long items = blocks_n * ks_n;
  uint4 wlo[U][FT], whi[U][FT];  // a round of weights: one buffer for the preloaded round and the loop's
  bool loaded = false;
  if constexpr (PRO::EARLY) {  // the block's first item's first round (the same addresses as in the loop below)
    const long long item = blockIdx.x, ks = item % ks_n, s = ks * run + warp;
    loaded = item < items && s + LIN_WARPS * (U - 1) < imin(steps, (ks + 1) * run);
    if (loaded) {
      const long long nblk = GATED ? (item / ks_n) * 8 : (item / ks_n) * 16 * FT;
#pragma unroll
      for (int f = 0; f < FT; ++f) {
        const long long n0 = nblk + 16 * f;
        const long long r0 = GATED ? epi.row_a(imin(n0 + g, H - 1), N) : imin(n0 + g, N - 1);
        const long long r1 = GATED ? epi.row_b(imin(n0 + g, H - 1), N) : imin(n0 + g + 8, N - 1);
#pragma unroll
        for (int u = 0; u < U; ++u) {
          wlo[u][f] = lin_ld_stream(w + r0 * K + 8 * c + (s + LIN_WARPS * u) * 32);
          whi[u][f] = lin_ld_stream(w + r1 * K + 8 * c + (s + LIN_WARPS * u) * 32);
        }
      }
    }
  }
  pro();
  for (long long item = blockIdx.x; item < items; item += gridDim.x) {
    if constexpr (PRO::TRIGGER) {
      if (item + gridDim.x >= items) pdl_leave();  // the block's last item
    }
    const long long nb = item / ks_n, ks = item % ks_n;
    const long long s_end = imin(steps, (ks + 1) * run);
    const long long nblk = GATED ? nb * 8 : nb * 16 * FT;
    const T* w0[FT];
    const T* w1[FT];
#pragma unroll
    for (int f = 0; f < FT; ++f) {
      const long long n0 = nblk + 16 * f;
      const long long r0 = GATED ? epi.row_a(imin(n0 + g, H - 1), N) : imin(n0 + g, N - 1);
      const long long r1 = GATED ? epi.row_b(imin(n0 + g, H - 1), N) : imin(n0 + g + 8, N - 1);
      w0[f] = w + r0 * K + 8 * c;
      w1[f] = w + r1 * K + 8 * c;
    }
    float acc[FT][J][4];
#pragma unroll
    for (int f = 0; f < FT; ++f)
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[f][j][q] = 0.f;
    long long s = ks * run + warp;
    for (; s + LIN_WARPS * (U - 1) < s_end; s += LIN_WARPS * U) {
      if (!loaded) {  // (PRO::EARLY: the first item's first round is loaded before pro)
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int f = 0; f < FT; ++f) {
            wlo[u][f] = lin_ld_stream(w0[f] + (s + LIN_WARPS * u) * 32);
            whi[u][f] = lin_ld_stream(w1[f] + (s + LIN_WARPS * u) * 32);
          }
      }
      loaded = false;
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const uint4 xv = xs.vec(xm[j], (s + LIN_WARPS * u) * 32 + 8 * c);
#pragma unroll
          for (int f = 0; f < FT; ++f) lin_mma_step(acc[f][j], wlo[u][f], whi[u][f], xv);
        }
    }
    for (; s < s_end; s += LIN_WARPS) {
      uint4 wlo[FT], whi[FT];
#pragma unroll
      for (int f = 0; f < FT; ++f) {
        wlo[f] = lin_ld_stream(w0[f] + s * 32);
        whi[f] = lin_ld_stream(w1[f] + s * 32);
      }
#pragma unroll
      for (int j = 0; j < J; ++j) {
        const uint4 xv = xs.vec(xm[j], s * 32 + 8 * c);
#pragma unroll
        for (int f = 0; f < FT; ++f) lin_mma_step(acc[f][j], wlo[f], whi[f], xv);
      }
    }
#pragma unroll
    for (int f = 0; f < FT; ++f) {
      const long long n0 = nblk + 16 * f;
      // red[r][warp][lane], r = 4j + q: conflict-free writes here and reads below
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) red[((4 * j + q) * LIN_WARPS + warp) * 32 + lane] = acc[f][j][q];
      __syncthreads();
      if constexpr (GATED) {
        for (int slot = threadIdx.x; slot < 2 * J * 32; slot += LIN_THREADS) {
          const int r = 4 * (slot >> 6) + ((slot >> 5) & 1), l = slot & 31, q = r & 3;  // q = 0, 1: gate rows
          float sg = 0.f, su = 0.f;
#pragma unroll
          for (int v = 0; v < LIN_WARPS; ++v) {
            sg += red[(r * LIN_WARPS + v) * 32 + l];
            su += red[((r + 2) * LIN_WARPS + v) * 32 + l];
          }
          const long long n = n0 + (l >> 2);
          const long long m = 8 * (r >> 2) + 2 * (l & 3) + (q & 1);
          if (m < M && n < H) {
            float bg = 0.f, bu = 0.f;
            if constexpr (HAS_BIAS) {
              bg = float(load(bias + epi.row_a(n, N) * bias_stride));
              bu = float(load(bias + epi.row_b(n, N) * bias_stride));
            }
            epi.put(y.p + yoff[m], yn, m, n, lin_round<T>(sg + bg), lin_round<T>(su + bu));
          }
        }
      } else {
        // C fragment: c0, c1 = C[g][2c, 2c+1], c2, c3 = C[g+8][2c, 2c+1] (row = feature, column = x row)
        auto put = [&](int slot, float sum) {
          const int r = slot >> 5, l = slot & 31, q = r & 3;
          const long long n = n0 + (l >> 2) + (q >= 2 ? 8 : 0);
          const long long m = 8 * (r >> 2) + 2 * (l & 3) + (q & 1);
          if (m < M && n < N) {
            float b = 0.f;
            if constexpr (HAS_BIAS) b = float(load(bias + n * bias_stride));
            store(y.p + yoff[m] + n * yn, sum + b);
          }
        };
        for (int slot = threadIdx.x; slot < SLOTS; slot += LIN_THREADS) {
          const int r = slot >> 5, l = slot & 31;
          float sum = 0.f;
#pragma unroll
          for (int v = 0; v < LIN_WARPS; ++v) sum += red[(r * LIN_WARPS + v) * 32 + l];
          if (split) {
            ws[item * SLOTS + slot] = sum;
          } else {
            put(slot, sum);
          }
        }
        if (split) {  // the feature block's last run adds the ks_n partials in run order
          __threadfence();
          __syncthreads();
          if (threadIdx.x == 0) lin_last = atomicAdd(cnt + nb, 1u) == (unsigned int)(ks_n - 1);
          __syncthreads();
          if (lin_last) {
            __threadfence();
            for (int slot = threadIdx.x; slot < SLOTS; slot += LIN_THREADS) {
              float sum = 0.f;
              for (int k = 0; k < ks_n; ++k) sum += __ldcg(ws + (nb * ks_n + k) * SLOTS + slot);
              put(slot, sum);
            }
            if (threadIdx.x == 0) cnt[nb] = 0u;  // ready for the next launch
          }
        }
      }
      __syncthreads();  // red is rewritten by the next feature tile or block
    }
  }
}

// MMA prefill (M > 32): an item is (16 * F features, 64 rows of x); its 8 warps are F feature blocks
// of 16 x S ways of split-K (S * F = 8, S the smallest that makes >= LIN_MMA_ITEMS items: small M
// and N would leave SMs idle otherwise). xoff / yoff: LIN_MMA_M row offsets of the item's tile in
// shared memory; red: 8192 floats of shared memory (the S > 1 partial sums)
template <typename T, int R, int U, bool HAS_BIAS>
__device__ __forceinline__ void linear_mma_prefill(const View<T, R>& x, const T* __restrict__ w,
                                                   const T* __restrict__ bias, long long bias_stride,
                                                   const View<T, R>& y, long long M, long long N, long long K,
                                                   long long* xoff, long long* yoff, float* red) {
  constexpr int J = LIN_MMA_M / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const long long steps = K / 32, yn = y.stride[R - 1];
  const long long tiles_m = (M + LIN_MMA_M - 1) / LIN_MMA_M, fb16 = (N + 15) / 16;
  int S = 1;
  while (S < LIN_WARPS && (fb16 + LIN_WARPS / S - 1) / (LIN_WARPS / S) * tiles_m < LIN_MMA_ITEMS) S *= 2;
  const int F = LIN_WARPS / S, ks = warp % S;
  const long long blocks_n = (fb16 + F - 1) / F;
  for (long long item = blockIdx.x; item < blocks_n * tiles_m; item += gridDim.x) {
    const long long nb0 = (item / tiles_m) * (16 * F), n0 = nb0 + 16 * (warp / S);
    const long long m0 = (item % tiles_m) * LIN_MMA_M;
    __syncthreads();  // the previous item's readers of xoff / yoff / red are done
    if (threadIdx.x < LIN_MMA_M) {
      const long long m = imin(m0 + threadIdx.x, M - 1);
      xoff[threadIdx.x] = lin_row_offset(x, m);
      yoff[threadIdx.x] = lin_row_offset(y, m);
    }
    __syncthreads();
    float acc[J][4];
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[j][q] = 0.f;
    if (n0 < N) {
      const T* w0 = w + imin(n0 + g, N - 1) * K + 8 * c;
      const T* w1 = w + imin(n0 + g + 8, N - 1) * K + 8 * c;
      const T* xr[J];
#pragma unroll
      for (int j = 0; j < J; ++j) xr[j] = x.p + xoff[8 * j + g] + 8 * c;
      long long s = ks;
      for (; s + S * (U - 1) < steps; s += S * U) {
        uint4 wlo[U], whi[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
          wlo[u] = lin_ld_stream(w0 + (s + S * u) * 32);
          whi[u] = lin_ld_stream(w1 + (s + S * u) * 32);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int j = 0; j < J; ++j)
            lin_mma_step(acc[j], wlo[u], whi[u], __ldg(reinterpret_cast<const uint4*>(xr[j] + (s + S * u) * 32)));
      }
      for (; s < steps; s += S) {
        const uint4 wlo = lin_ld_stream(w0 + s * 32), whi = lin_ld_stream(w1 + s * 32);
#pragma unroll
        for (int j = 0; j < J; ++j)
          lin_mma_step(acc[j], wlo, whi, __ldg(reinterpret_cast<const uint4*>(xr[j] + s * 32)));
      }
    }
    if (S == 1) {  // no split-K: each warp stores its own C fragments
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const long long n = n0 + g + (q >= 2 ? 8 : 0);
        float b = 0.f;
        if constexpr (HAS_BIAS) b = n < N ? float(load(bias + n * bias_stride)) : 0.f;
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int mi = 8 * j + 2 * c + (q & 1);
          if (m0 + mi < M && n < N) store(y.p + yoff[mi] + n * yn, acc[j][q] + b);
        }
      }
      continue;
    }
    // red[r][warp][lane], r = 4j + q; warps f * S .. f * S + S - 1 hold feature block f's partials
#pragma unroll
    for (int j = 0; j < J; ++j)
#pragma unroll
      for (int q = 0; q < 4; ++q) red[((4 * j + q) * LIN_WARPS + warp) * 32 + lane] = acc[j][q];
    __syncthreads();
    for (int slot = threadIdx.x; slot < F * 4 * J * 32; slot += LIN_THREADS) {
      const int f = slot / (4 * J * 32), r = (slot >> 5) % (4 * J), l = slot & 31, q = r & 3;
      float sum = 0.f;
      for (int v = 0; v < S; ++v) sum += red[(r * LIN_WARPS + f * S + v) * 32 + l];
      const long long n = nb0 + 16 * f + (l >> 2) + (q >= 2 ? 8 : 0);
      const int mi = 8 * (r >> 2) + 2 * (l & 3) + (q & 1);
      if (m0 + mi < M && n < N) {
        float b = 0.f;
        if constexpr (HAS_BIAS) b = float(load(bias + n * bias_stride));
        store(y.p + yoff[mi] + n * yn, sum + b);
      }
    }
  }
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
