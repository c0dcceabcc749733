// atlasc kernel library: shared definitions included once at the top of every generated module.
//
// Layout assumptions: a tensor is a View: a typed pointer into the arena, its run-time shape and its
// element strides (row-major contiguous unless the memory plan says otherwise, e.g. a KV-cache view).
// Every generated kernel takes the arena base (a kernel shared by several nodes also their offsets in it:
// ArenaOffsets); run-time dims (batch, seq, past ...) are read from the int64 dims buffer inside the
// arena, so a captured CUDA graph replays any step.
// Kernels loop grid-stride over their work, so any grid size is correct; the grid recorded in the
// artifact is sized for the compile-time maxima.
// Numerics: float16 values are computed in float32 and rounded once when stored.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>

namespace atlas {

// Programmatic dependent launch (sm90+). pdl_enter, the first statement of every generated kernel (after
// its dims loads, generate.py DIMS_EARLY, and its weight prefetches, if any; a batch-1 projection's with early weights runs it after its first weight loads,
// linear.cu LinPro): wait until the grids this one depends on have completed and their writes are visible. pdl_leave, its last: let the next kernel's blocks be scheduled (a block that
// returns early counts as having done so). Leaving at the end, not next to the wait, keeps the next
// kernel's waiting blocks off the SMs while this kernel still has blocks to run (they would hold slots
// its later waves need); they launch during this kernel's last blocks and wait in pdl_enter in turn.
// A runtime that turns a graph's kernel-to-kernel edges into programmatic ones (runtime/cudagraph.py,
// ATLAS_PDL=1) overlaps a kernel's launch with the tail of the one before; with plain launches and
// edges both instructions return at once.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_leave() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ask L2 for the `bytes` bytes at p (16-byte aligned, a multiple of 16): one bulk prefetch, only a hint (sm90+:
// nothing on older arches)
__device__ __forceinline__ void l2_prefetch_bulk(const void* p, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// L2 prefetch of a constant (weights) before pdl_enter: the first `bytes` bytes (a multiple of 16) of
// rows [0, rows) of a row-major array whose rows start row_bytes apart (16-byte aligned), the rows split
// evenly over the grid's blocks, one cp.async.bulk.prefetch per row (sm90+; nothing on older arches).
// Only a hint: it changes no result. It runs before the wait because the weights are never written by
// an earlier kernel, so a kernel's first weight bytes are on their way while the previous kernel drains
// (programmatic launch) or while this one stages its norm prologue.
__device__ __forceinline__ void prefetch_rows_l2(const unsigned char* p, long long row_bytes, unsigned bytes,
                                                 int rows) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int per = (rows + int(gridDim.x) - 1) / int(gridDim.x);
  for (int i = threadIdx.x; i < per; i += blockDim.x) {
    const long long r = (long long)blockIdx.x * per + i;
    if (r < rows) l2_prefetch_bulk(p + r * row_bytes, bytes);
  }
#endif
}

// The arena offsets of a kernel shared by nodes whose code differs only in them (a model's layers,
// codegen/share.py), passed by value at each launch: v[i] stands for the node's i-th literal offset.
template <int N> struct ArenaOffsets { long long v[N]; };

__device__ __forceinline__ long long imax(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ long long imin(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long floordiv(long long a, long long b) {
  long long q = a / b;
  return (q * b != a && ((a < 0) != (b < 0))) ? q - 1 : q;
}
__device__ __forceinline__ long long floormod(long long a, long long b) { return a - floordiv(a, b) * b; }

// -- conversions between storage and compute types ---------------------------------------------
template <typename T> struct Compute { typedef T type; };
template <> struct Compute<__half> { typedef float type; };

template <typename T> __device__ __forceinline__ typename Compute<T>::type load(const T* p) { return *p; }
template <> __device__ __forceinline__ float load<__half>(const __half* p) { return __half2float(*p); }

template <typename T, typename C> __device__ __forceinline__ void store(T* p, C v) { *p = static_cast<T>(v); }
template <> __device__ __forceinline__ void store<__half, float>(__half* p, float v) { *p = __float2half_rn(v); }
template <> __device__ __forceinline__ void store<__half, double>(__half* p, double v) {
  *p = __float2half_rn(static_cast<float>(v));
}
template <> __device__ __forceinline__ void store<__half, long long>(__half* p, long long v) {
  *p = __float2half_rn(static_cast<float>(v));
}
template <> __device__ __forceinline__ void store<__half, int>(__half* p, int v) {
  *p = __float2half_rn(static_cast<float>(v));
}
template <> __device__ __forceinline__ void store<__half, bool>(__half* p, bool v) { *p = __float2half_rn(v ? 1.f : 0.f); }

// float -> integer casts truncate toward zero like numpy's astype after trunc; NaN/inf are undefined
template <typename To, typename From> __device__ __forceinline__ To cast_to(From v) { return static_cast<To>(v); }
template <> __device__ __forceinline__ bool cast_to<bool, float>(float v) { return v != 0.f; }
template <> __device__ __forceinline__ bool cast_to<bool, double>(double v) { return v != 0.0; }

// -- views --------------------------------------------------------------------------------------
template <typename T, int R> struct View {
  T* p;
  long long shape[R];
  long long stride[R];

  __device__ __forceinline__ long long numel() const {
    long long n = 1;
#pragma unroll
    for (int i = 0; i < R; ++i) n *= shape[i];
    return n;
  }
  // element offset of the row-major flat index `flat` over this view's own shape
  __device__ __forceinline__ long long offset_of_flat(long long flat) const {
    long long off = 0;
#pragma unroll
    for (int i = R - 1; i >= 0; --i) {
      long long c = flat % shape[i];
      flat /= shape[i];
      off += c * stride[i];
    }
    return off;
  }
  __device__ __forceinline__ T* at_flat(long long flat) const { return p + offset_of_flat(flat); }
};

// row-major coordinates of `flat` over `shape`
template <int R> __device__ __forceinline__ void unravel(long long flat, const long long* shape, long long* coord) {
#pragma unroll
  for (int i = R - 1; i >= 0; --i) {
    coord[i] = flat % shape[i];
    flat /= shape[i];
  }
}

__device__ __forceinline__ long long global_thread() { return (long long)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ long long global_threads() { return (long long)gridDim.x * blockDim.x; }

// -- block reductions (blockDim.x a multiple of 32, at most 1024) ---------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// every thread of the block gets the sum; `scratch` holds 32 floats of shared memory
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = (threadIdx.x < nwarps) ? scratch[threadIdx.x] : 0.f;
  if (warp == 0) v = warp_sum(v);
  if (threadIdx.x == 0) scratch[0] = v;
  __syncthreads();
  return scratch[0];
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) >> 5;
  v = (threadIdx.x < nwarps) ? scratch[threadIdx.x] : -INFINITY;
  if (warp == 0) v = warp_max(v);
  if (threadIdx.x == 0) scratch[0] = v;
  __syncthreads();
  return scratch[0];
}

}  // namespace atlas
