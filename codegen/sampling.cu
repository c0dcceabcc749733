// Sample: the next token per sequence from the last position's logits (see atlasc/ir/ops/sampling.py
// for the definition this implements). One 1024-thread block per sequence, grid-stride over sequences.
// Thresholds (top-k by count, top-p by mass) are found by radix selection on the bit patterns of the
// unnormalized probabilities p = exp(z - max z) >= 0, whose unsigned bit order is their value order.
// Float mass histograms use shared-memory atomics, so top-p thresholds can differ from numpy's
// float64 sums by rounding; counts (top-k) and greedy are exact.
namespace atlas {
namespace smp {

__device__ __forceinline__ double uniform(unsigned long long seed, long long step, long long row) {
  unsigned long long x = seed + 0x9E3779B97F4A7C15ULL * (unsigned long long)(step * 1024 + row + 1);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return (double)(x >> 11) * (1.0 / 9007199254740992.0);
}

struct Scratch {
  float f[32];
  long long i[32];
  unsigned int hist_c[256];
  float hist_m[256];
  float scan[1024];
  unsigned int prefix;
  float fvalue;
  long long ivalue;
};

// (value, index) max over the block, ties to the smaller index; every thread gets the result
__device__ __forceinline__ void block_argmax(float& v, long long& idx, Scratch& s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float ov = __shfl_xor_sync(0xffffffffu, v, o);
    long long oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) { s.f[warp] = v; s.i[warp] = idx; }
  __syncthreads();
  if (warp == 0) {
    const int nw = (blockDim.x + 31) >> 5;
    v = lane < nw ? s.f[lane] : -INFINITY;
    idx = lane < nw ? s.i[lane] : 0x7fffffffffffffffLL;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      float ov = __shfl_xor_sync(0xffffffffu, v, o);
      long long oi = __shfl_xor_sync(0xffffffffu, idx, o);
      if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    if (lane == 0) { s.fvalue = v; s.ivalue = idx; }
  }
  __syncthreads();
  v = s.fvalue;
  idx = s.ivalue;
}

__device__ __forceinline__ bool same_high_bits(unsigned int bits, unsigned int prefix, int shift) {
  return shift >= 24 ? true : ((bits ^ prefix) >> (shift + 8)) == 0u;
}

// Largest bit pattern t with count(bits >= t) >= k (by_mass false) or mass(bits >= t) >= target
// (by_mass true), among elements whose bits are >= floor.
template <typename T, bool by_mass>
__device__ unsigned int radix_select(const T* row, long long V, float inv_t, float zmax, unsigned int floor,
                                     long long k, float target, Scratch& s) {
  unsigned int prefix = 0;
  float above_m = 0.f;
  long long above_c = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int d = threadIdx.x; d < 256; d += blockDim.x) { s.hist_c[d] = 0; s.hist_m[d] = 0.f; }
    __syncthreads();
    for (long long i = threadIdx.x; i < V; i += blockDim.x) {
      const float p = expf(atlas::load(row + i) * inv_t - zmax);
      const unsigned int bits = __float_as_uint(p);
      if (bits >= floor && same_high_bits(bits, prefix, shift)) {
        const unsigned int digit = (bits >> shift) & 255u;
        if (by_mass) atomicAdd(&s.hist_m[digit], p); else atomicAdd(&s.hist_c[digit], 1u);
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int chosen = 0;
      for (int d = 255; d >= 0; --d) {
        if (by_mass) {
          if (above_m + s.hist_m[d] >= target) { chosen = d; break; }
          above_m += s.hist_m[d];
        } else {
          if (above_c + (long long)s.hist_c[d] >= k) { chosen = d; break; }
          above_c += s.hist_c[d];
        }
      }
      s.prefix = prefix | ((unsigned int)chosen << shift);
    }
    __syncthreads();
    prefix = s.prefix;
    __syncthreads();
  }
  return prefix;
}

// This thread's (max, first index) over its share of a row. A contiguous 16-byte-aligned row is read
// with 16-byte loads, ARGMAX_UNROLL of them in flight per thread: the scalar loop kept one load in
// flight and took ~50 us for a 128256-entry fp16 row on an H200 (atlasc profile, docs/perf.md v5).
// Each thread visits its indices in increasing order, so ties keep the first index like the scalar loop.
constexpr int ARGMAX_UNROLL = 4;
template <typename T>
__device__ __forceinline__ void row_argmax(const T* row, long long V, long long stride, float& best, long long& bi) {
  constexpr int E = 16 / sizeof(T);
  long long done = 0;
  if (stride == 1 && (reinterpret_cast<unsigned long long>(row) & 15ull) == 0) {
    const long long nv = V / E;
    const uint4* r4 = reinterpret_cast<const uint4*>(row);
    for (long long j = threadIdx.x; j < nv; j += ARGMAX_UNROLL * (long long)blockDim.x) {
      uint4 u[ARGMAX_UNROLL];
#pragma unroll
      for (int k = 0; k < ARGMAX_UNROLL; ++k) {
        const long long jj = j + k * (long long)blockDim.x;
        if (jj < nv) u[k] = __ldg(r4 + jj);
      }
#pragma unroll
      for (int k = 0; k < ARGMAX_UNROLL; ++k) {
        const long long jj = j + k * (long long)blockDim.x;
        if (jj >= nv) break;
        const T* e = reinterpret_cast<const T*>(&u[k]);
#pragma unroll
        for (int q = 0; q < E; ++q) {
          const float v = atlas::load(e + q);
          const long long i = jj * E + q;
          if (v > best || (v == best && i < bi)) { best = v; bi = i; }
        }
      }
    }
    done = nv * E;
  }
  for (long long i = done + threadIdx.x; i < V; i += blockDim.x) {
    const float v = atlas::load(row + i * stride);
    if (v > best || (v == best && i < bi)) { best = v; bi = i; }
  }
}

// Row b's token once its maximum `best` (first index bi) is known: greedy writes bi; otherwise the
// temperature / top-k / top-p draw over the whole row by this block. Ends with __syncthreads.
template <typename T>
__device__ void sample_finish(const T* row, long long V, float best, long long bi, float temperature, float top_p,
                              long long seed, long long step, long long top_k, long long b,
                              atlas::View<long long, 1>& out, Scratch& s) {
  if (temperature <= 0.f || top_k == 1) {
    if (threadIdx.x == 0) out.p[b * out.stride[0]] = bi;
    __syncthreads();
    return;
  }
  // 2. p_i = exp(z_i - max z), z = logits / temperature
  const float inv_t = 1.0f / temperature;
  const float zmax = best * inv_t;
  // logits rows are contiguous in the last dim (checked by the emitter)
  unsigned int floor = 0;
  if (top_k > 0 && top_k < V) floor = radix_select<T, false>(row, V, inv_t, zmax, 0u, top_k, 0.f, s);
  float mass = 0.f;
  for (long long i = threadIdx.x; i < V; i += blockDim.x) {
    const float p = expf(atlas::load(row + i) * inv_t - zmax);
    if (__float_as_uint(p) >= floor) mass += p;
  }
  mass = atlas::block_sum(mass, s.f);
  if (top_p > 0.f && top_p < 1.f) {
    const unsigned int t = radix_select<T, true>(row, V, inv_t, zmax, floor, 0, top_p * mass, s);
    floor = t > floor ? t : floor;
    mass = 0.f;
    for (long long i = threadIdx.x; i < V; i += blockDim.x) {
      const float p = expf(atlas::load(row + i) * inv_t - zmax);
      if (__float_as_uint(p) >= floor) mass += p;
    }
    mass = atlas::block_sum(mass, s.f);
  }
  // 3. the first kept index whose running mass exceeds u * mass (threads own contiguous chunks)
  const float target = (float)(uniform((unsigned long long)seed, step, b) * (double)mass);
  const long long chunk = (V + blockDim.x - 1) / blockDim.x;
  const long long lo = threadIdx.x * chunk, hi = lo + chunk < V ? lo + chunk : V;
  float local = 0.f;
  long long last_kept = -1;
  for (long long i = lo; i < hi; ++i) {
    const float p = expf(atlas::load(row + i) * inv_t - zmax);
    if (__float_as_uint(p) >= floor) { local += p; last_kept = i; }
  }
  s.scan[threadIdx.x] = local;
  __syncthreads();
  for (int off = 1; off < blockDim.x; off <<= 1) {  // inclusive Hillis-Steele scan
    const float add = threadIdx.x >= off ? s.scan[threadIdx.x - off] : 0.f;
    __syncthreads();
    s.scan[threadIdx.x] += add;
    __syncthreads();
  }
  const float base = s.scan[threadIdx.x] - local;
  if (threadIdx.x == 0) s.ivalue = -1;
  __syncthreads();
  if (local > 0.f && base <= target && target < base + local) {
    float run = base;
    for (long long i = lo; i < hi; ++i) {
      const float p = expf(atlas::load(row + i) * inv_t - zmax);
      if (__float_as_uint(p) >= floor) {
        run += p;
        if (run > target) { atomicMax(&s.ivalue, i); break; }
      }
    }
  }
  __syncthreads();
  long long picked = s.ivalue;
  if (picked < 0) {  // rounding left the target past the end: the last kept index
    float lk = (float)last_kept;
    long long dummy = last_kept;
    block_argmax(lk, dummy, s);
    picked = (long long)lk;
  }
  if (threadIdx.x == 0) out.p[b * out.stride[0]] = picked;
  __syncthreads();
}

// One block per row (the whole row's maximum, then sample_finish), grid-stride over rows.
template <typename T>
__device__ void sample_rows(const atlas::View<T, 3>& logits, float temperature, float top_p, long long seed,
                            long long step, long long top_k, atlas::View<long long, 1>& out) {
  __shared__ Scratch s;
  const long long B = logits.shape[0], S = logits.shape[1], V = logits.shape[2];
  for (long long b = blockIdx.x; b < B; b += gridDim.x) {
    const T* row = logits.p + b * logits.stride[0] + (S - 1) * logits.stride[1];
    // 1. greedy: the first index of the maximum
    float best = -INFINITY;
    long long bi = 0x7fffffffffffffffLL;
    row_argmax(row, V, logits.stride[2], best, bi);
    block_argmax(best, bi, s);
    sample_finish(row, V, best, bi, temperature, top_p, seed, step, top_k, b, out, s);
  }
}

// The maximum split over `parts` blocks per row (a row's blocks are items b * parts + q, grid-stride): each
// takes the first maximum of its part (chunk values, a multiple of 8 so that every part starts 16-byte
// aligned), writes it to wv / wi [rows x parts] and bumps the row's counter cnt[b]; the block that arrives
// last merges the parts (ties to the smaller index, as one block would), puts the counter back to 0 (the
// scratch's counters start and end at 0) and runs sample_finish for the row. A greedy step then reads each
// logit in one round of loads across parts blocks instead of 16 rounds in one.
template <typename T>
__device__ void sample_rows_split(const atlas::View<T, 3>& logits, float temperature, float top_p, long long seed,
                                  long long step, long long top_k, atlas::View<long long, 1>& out, int parts,
                                  float* __restrict__ wv, long long* __restrict__ wi, unsigned int* cnt) {
  __shared__ Scratch s;
  __shared__ bool last;
  const long long B = logits.shape[0], S = logits.shape[1], V = logits.shape[2];
  const long long chunk = ((V + parts - 1) / parts + 7) / 8 * 8;
  for (long long item = blockIdx.x; item < B * parts; item += gridDim.x) {
    const long long b = item / parts, lo = (item % parts) * chunk;
    const T* row = logits.p + b * logits.stride[0] + (S - 1) * logits.stride[1];
    float best = -INFINITY;
    long long bi = 0x7fffffffffffffffLL;
    if (lo < V) {
      row_argmax(row + lo * logits.stride[2], (V - lo < chunk ? V - lo : chunk), logits.stride[2], best, bi);
      if (bi != 0x7fffffffffffffffLL) bi += lo;
    }
    block_argmax(best, bi, s);
    if (threadIdx.x == 0) {
      wv[item] = best;
      wi[item] = bi;
      __threadfence();
      last = atomicAdd(cnt + b, 1u) == (unsigned int)(parts - 1);
    }
    __syncthreads();
    if (!last) continue;
    __threadfence();
    best = -INFINITY;
    bi = 0x7fffffffffffffffLL;
    for (long long k = threadIdx.x; k < parts; k += blockDim.x) {
      const float v = __ldcg(wv + b * parts + k);
      const long long i = __ldcg(wi + b * parts + k);
      if (v > best || (v == best && i < bi)) { best = v; bi = i; }
    }
    block_argmax(best, bi, s);
    if (threadIdx.x == 0) cnt[b] = 0u;  // ready for the next launch
    sample_finish(row, V, best, bi, temperature, top_p, seed, step, top_k, b, out, s);
  }
}

}  // namespace smp
}  // namespace atlas
