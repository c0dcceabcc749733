// Attention, RotaryEmbedding, KVAppend (see attention.py).
//
// Attention: every tensor is a rank-4 View [batch, heads, seq, head_dim] (the emitter turns 3-D
// [B, S, H*D] inputs and outputs into such views by strides; K/V may be KV-cache views). One block
// of ATT_THREADS threads per (b, q_head, query row), grid-stride over rows. The query row is staged
// in shared memory as float; each warp takes keys j = warp, warp + nwarps, ... (lanes split the dot
// product over head_dim, warp_sum combines) and keeps an online softmax (running max m, sum l,
// accumulator acc[Dv] spread over lanes, ATT_ACC values per lane). Masked keys (-inf) are skipped; the
// warps' partial states are merged through shared memory. A row whose every key is masked yields 0
// (the reference's softmax of an all -inf row). float32 throughout; Y is rounded once when stored.
namespace atlas {

extern __shared__ __align__(16) unsigned char atlas_attn_smem[];

__device__ __forceinline__ float mask_bias(bool m) { return m ? 0.f : -INFINITY; }
__device__ __forceinline__ float mask_bias(float m) { return m; }

// pointer to v[b, h, s, 0]
template <typename T> __device__ __forceinline__ T* row_ptr(const View<T, 4>& v, long long b, long long h, long long s) {
  return v.p + b * v.stride[0] + h * v.stride[1] + s * v.stride[2];
}

template <typename T, typename MT> struct AttnArgs {
  View<T, 4> q, k, v, pk, pv;  // pk/pv: past key/value (used when has_past)
  View<T, 4> y, present_k, present_v, qk;
  View<MT, 4> mask;  // aligned to [B, Hq, Sq, mask_len] (stride 0 on broadcast dims); mask_len <= Skv
  long long past;    // past length P (0 without past inputs); total keys = P + k.shape[2]
  float scale;       // 0: 1/sqrt(Dk)
  float softcap;     // <= 0: none
  // KEYS (key_mask=1, set by mask-as-lengths; unset otherwise): see key_bias_of
  int keys_causal;
  long long keys_window;  // 0: none
  float keys_fill;        // what a hidden key adds: -INFINITY or the export mask dtype's lowest value
};

// KEYS: `mask` is attention_mask [B, T] (0/1, any integer or bool type) viewed as [B, Hq, Sq, T] with
// stride 0 on heads and queries (moff: its row offset for (b, h, i)). Key j is visible to the query at
// position pos = Skv - Sq + i iff mask[b, j] != 0, and (keys_causal) j <= pos, and (keys_window > 0)
// pos - j < keys_window; a hidden key adds keys_fill, as the materialized mask it replaces did (the
// reference: key_mask_visible, atlasc/ir/ops/nn.py), so every score and the all-hidden rows are unchanged.
// Otherwise the mask tensor's value (mask_bias). Keys past the mask's last dim are hidden.
template <bool KEYS, typename T, typename MT>
__device__ __forceinline__ float key_bias_of(const AttnArgs<T, MT>& a, MT v, long long j, long long pos) {
  const View<MT, 4>& m = a.mask;
  if constexpr (KEYS) {
    const bool keep = j < m.shape[3] && v != MT(0) && (!a.keys_causal || j <= pos) &&
                      (a.keys_window <= 0 || pos - j < a.keys_window);
    return keep ? 0.f : a.keys_fill;
  } else {
    return j < m.shape[3] ? mask_bias(load(&v)) : -INFINITY;
  }
}

// the additive bias of key j for the query row whose mask offset is moff (at position pos): key_bias_of on
// the mask element, read only when j is inside the mask
template <bool KEYS, typename T, typename MT>
__device__ __forceinline__ float row_key_bias(const AttnArgs<T, MT>& a, long long moff, long long j, long long pos) {
  const View<MT, 4>& m = a.mask;
  if (j >= m.shape[3]) return KEYS ? a.keys_fill : -INFINITY;
  return key_bias_of<KEYS>(a, m.p[moff + j * m.stride[3]], j, pos);
}

// row_key_bias in two steps, for a caller that issues all its mask reads before it uses the first (a read
// under row_key_bias's conditions is a branch, and ptxas then waits for each read in turn): mask_at reads
// key j's element unconditionally (j clamped into the mask's last dim: in bounds), then key_bias_of
template <typename T, typename MT>
__device__ __forceinline__ MT mask_at(const AttnArgs<T, MT>& a, long long moff, long long j) {
  const View<MT, 4>& m = a.mask;
  return m.p[moff + (j < m.shape[3] ? j : m.shape[3] - 1) * m.stride[3]];
}

// PRESENT: bit 0 writes present_key, bit 1 present_value; QK_MODE: -1 none, else the qk output mode;
// KEYS: the mask is attention_mask with causal / window applied here (key_bias_of)
template <typename T, typename MT, int ACC, bool HAS_PAST, bool HAS_MASK, bool CAUSAL, int PRESENT, int QK_MODE,
          bool KEYS = false>
__device__ __forceinline__ void attention_rows(const AttnArgs<T, MT>& a) {
  const long long B = a.q.shape[0], Hq = a.q.shape[1], Sq = a.q.shape[2], Dk = a.q.shape[3];
  const long long Hk = a.k.shape[1], S_new = a.k.shape[2], Dv = a.v.shape[3];
  const long long P = HAS_PAST ? a.past : 0;
  const long long Skv = P + S_new;
  const long long group = Hk > 0 ? Hq / Hk : 1;
  const float scale = a.scale != 0.f ? a.scale : (float)(1.0 / sqrt((double)Dk));

  // present_key / present_value = concat(past, new) along seq: a grid-stride copy (independent of the
  // attention below, which reads past and new directly)
  if constexpr (PRESENT != 0) {
    const long long nk = (PRESENT & 1) ? B * Hk * Skv * Dk : 0, nv = (PRESENT & 2) ? B * Hk * Skv * Dv : 0;
    for (long long i = global_thread(); i < nk + nv; i += global_threads()) {
      const bool is_v = i >= nk;
      const long long f = is_v ? i - nk : i;
      const long long D = is_v ? Dv : Dk;
      const long long d = f % D, t = (f / D) % Skv, h = (f / (D * Skv)) % Hk, b = f / (D * Skv * Hk);
      const T* sp;
      if (is_v)
        sp = t < P ? row_ptr(a.pv, b, h, t) + d * a.pv.stride[3] : row_ptr(a.v, b, h, t - P) + d * a.v.stride[3];
      else
        sp = t < P ? row_ptr(a.pk, b, h, t) + d * a.pk.stride[3] : row_ptr(a.k, b, h, t - P) + d * a.k.stride[3];
      T* dp = is_v ? row_ptr(a.present_v, b, h, t) + d * a.present_v.stride[3]
                   : row_ptr(a.present_k, b, h, t) + d * a.present_k.stride[3];
      store(dp, load(sp));
    }
  }

  float* q_s = reinterpret_cast<float*>(atlas_attn_smem);  // [Dk]
  const int nwarps = blockDim.x >> 5, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float* part = q_s + ((Dk + 3) & ~3LL);                    // per warp: m, l, acc[Dv]
  const long long part_stride = Dv + 2;
  const long long rows = B * Hq * Sq;

  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long i = row % Sq, h = (row / Sq) % Hq, b = row / (Sq * Hq);
    const long long hk = h / group;
    __syncthreads();  // the previous row's readers of q_s / part are done
    for (long long d = threadIdx.x; d < Dk; d += blockDim.x)
      q_s[d] = load(a.q.p + b * a.q.stride[0] + h * a.q.stride[1] + i * a.q.stride[2] + d * a.q.stride[3]);
    __syncthreads();

    // score of key j: (q . k_j) * scale, softcapped, plus mask and causal bias; `raw`/`capped` for qk
    auto score = [&](long long j, float& raw, float& capped) -> float {
      const bool old = HAS_PAST && j < P;
      const T* kp = old ? row_ptr(a.pk, b, hk, j) : row_ptr(a.k, b, hk, j - P);
      const long long ks = old ? a.pk.stride[3] : a.k.stride[3];
      float dot = 0.f;
      for (long long d = lane; d < Dk; d += 32) dot += q_s[d] * load(kp + d * ks);
      dot = warp_sum(dot);
      raw = dot * scale;
      capped = a.softcap > 0.f ? a.softcap * tanhf(raw / a.softcap) : raw;
      float bias = 0.f;
      if constexpr (HAS_MASK)
        bias = row_key_bias<KEYS>(a, b * a.mask.stride[0] + h * a.mask.stride[1] + i * a.mask.stride[2], j,
                                  Skv - Sq + i);
      if constexpr (CAUSAL) {
        if (j > i + P) bias += -INFINITY;
      }
      return capped + bias;
    };

    float m_run = -INFINITY, l_run = 0.f;
    float acc[ACC];
#pragma unroll
    for (int t = 0; t < ACC; ++t) acc[t] = 0.f;
    for (long long j = warp; j < Skv; j += nwarps) {
      float raw, capped;
      const float s = score(j, raw, capped);
      if constexpr (QK_MODE >= 0 && QK_MODE <= 2) {
        if (lane == 0) {
          const float w = QK_MODE == 0 ? raw : (QK_MODE == 1 ? capped : s);
          store(a.qk.p + b * a.qk.stride[0] + h * a.qk.stride[1] + i * a.qk.stride[2] + j * a.qk.stride[3], w);
        }
      }
      if (s == -INFINITY) continue;  // contributes exp(-inf) = 0
      const float m_new = fmaxf(m_run, s);
      const float corr = expf(m_run - m_new);
      const float p = expf(s - m_new);
      l_run = l_run * corr + p;
      const bool old = HAS_PAST && j < P;
      const T* vp = old ? row_ptr(a.pv, b, hk, j) : row_ptr(a.v, b, hk, j - P);
      const long long vs = old ? a.pv.stride[3] : a.v.stride[3];
#pragma unroll
      for (int t = 0; t < ACC; ++t) {
        const long long d = lane + 32LL * t;
        const float x = d < Dv ? load(vp + d * vs) : 0.f;
        acc[t] = acc[t] * corr + p * x;
      }
      m_run = m_new;
    }

    // merge the warps' (m, l, acc)
    float* mine = part + warp * part_stride;
    if (lane == 0) {
      mine[0] = m_run;
      mine[1] = l_run;
    }
#pragma unroll
    for (int t = 0; t < ACC; ++t) {
      const long long d = lane + 32LL * t;
      if (d < Dv) mine[2 + d] = acc[t];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < nwarps; ++w) M = fmaxf(M, part[w * part_stride]);
    float L = 0.f;
    if (M != -INFINITY)
      for (int w = 0; w < nwarps; ++w) L += part[w * part_stride + 1] * expf(part[w * part_stride] - M);
    for (long long d = threadIdx.x; d < Dv; d += blockDim.x) {
      float o = 0.f;
      if (M != -INFINITY) {
        for (int w = 0; w < nwarps; ++w) o += part[w * part_stride + 2 + d] * expf(part[w * part_stride] - M);
        o = o / L;
      }
      store(a.y.p + b * a.y.stride[0] + h * a.y.stride[1] + i * a.y.stride[2] + d * a.y.stride[3], o);
    }
    if constexpr (QK_MODE == 3) {  // the softmax itself: recompute the scores with the final max and sum
      for (long long j = warp; j < Skv; j += nwarps) {
        float raw, capped;
        const float s = score(j, raw, capped);
        const float p = (M == -INFINITY || s == -INFINITY) ? 0.f : expf(s - M) / L;
        if (lane == 0)
          store(a.qk.p + b * a.qk.stride[0] + h * a.qk.stride[1] + i * a.qk.stride[2] + j * a.qk.stride[3], p);
      }
    }
  }
}

// -- decode path (attention.py: ATLAS_ATTENTION_PATH=fast) --------------------------------------
// One block of NW warps per item (b, kv head hk, tile of up to R query rows): the rows of a tile are
// the (query head, query row) pairs that share hk (GQA: rows rr = i * group + g of head hk * group + g),
// so every K/V row is read from DRAM once per tile (once per (b, hk) at decode, where group * Sq <= R).
// Warps take blocks of 32 keys (kb = warp, warp + NW, ...). With MMA (float16, head dim 64 / 128) a warp
// computes its blocks on tensor cores (decode_warp_mma, below); otherwise (SIMT) the tile's query rows are
// staged in shared memory as float, and per block: lane l owns key kb * 32 + l and reads its whole K row with
// 16-byte loads (KC vectors in flight), dotting it with every row of the tile. Online softmax per row
// over the block (warp max; each lane keeps its partial sum l). Values: lanes split the head dim
// (EV elements per lane and load, LPR = D / EV lanes cover one V row, coalesced, KPI = 32 / LPR rows
// per warp-wide load, or VPL = LPR / 32 loads per lane and row when D > 32 * EV; VC loads in flight per
// lane); a key's probability comes from its owner lane by a shuffle. The warps'
// (m, l, acc[R][D]) are merged through shared memory and Y is rounded once when stored.
// Numerics as attention_rows: float32 scores and accumulation (MMA: P rounded to fp16 for the values, as
// attention_fa2); masked keys contribute 0; a row whose every key is masked (-inf) yields 0. Requires unit
// stride along the head dim and 16-byte aligned K/V rows (checked at run time: otherwise the whole launch
// runs attention_rows, which takes any layout).
template <typename T> __device__ __forceinline__ void to_float16B(const uint4& u, float* f);
template <> __device__ __forceinline__ void to_float16B<__half>(const uint4& u, float* f) {
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 x = __half22float2(h[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}
template <> __device__ __forceinline__ void to_float16B<float>(const uint4& u, float* f) {
  f[0] = __uint_as_float(u.x);
  f[1] = __uint_as_float(u.y);
  f[2] = __uint_as_float(u.z);
  f[3] = __uint_as_float(u.w);
}

// N elements of T (N * sizeof(T) in 2, 4, 8, 16 bytes, aligned to that size) as raw bits
template <int BYTES> struct RawVec;
template <> struct RawVec<2> { typedef unsigned short type; };
template <> struct RawVec<4> { typedef unsigned int type; };
template <> struct RawVec<8> { typedef uint2 type; };
template <> struct RawVec<16> { typedef uint4 type; };

template <typename T, int N> __device__ __forceinline__ typename RawVec<N * sizeof(T)>::type ldg_vec(const T* p) {
  return __ldg(reinterpret_cast<const typename RawVec<N * sizeof(T)>::type*>(p));
}
template <typename T, int N, typename R> __device__ __forceinline__ void raw_to_float(const R& u, float* f) {
  const T* x = reinterpret_cast<const T*>(&u);
  if constexpr (sizeof(T) == 2) {
    if constexpr (N == 1) {
      f[0] = __half2float(x[0]);
    } else {
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float2 y = __half22float2(reinterpret_cast<const __half2*>(x)[i]);
        f[2 * i] = y.x;
        f[2 * i + 1] = y.y;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = static_cast<float>(x[i]);
  }
}

// the largest divisor of n that is at most cap
__host__ __device__ constexpr int att_divisor_upto(int n, int cap) { return cap <= 1 ? 1 : (n % cap == 0 ? cap : att_divisor_upto(n, cap - 1)); }

// every 16-byte vector of every K/V row is aligned: unit stride along D, base and strides in whole vectors
template <typename T> __device__ __forceinline__ bool rows_vec_ok(const View<T, 4>& v, long long vec) {
  if (v.stride[3] != 1 || (reinterpret_cast<unsigned long long>(v.p) & 15ULL) != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (v.shape[i] > 1 && v.stride[i] % vec != 0) return false;
  return true;
}

constexpr int ATT_DECODE_KC = 16;  // K vectors (16 bytes) in flight per lane
constexpr int ATT_DECODE_VC = 16;  // V loads in flight per lane

// Sequence split (SPLIT > 1): a (b, kv head, tile) item's keys are cut into `splits` contiguous runs of
// 32-key blocks, each run a separate work unit (so batch 1 at a long context still fills the GPU).
// A unit writes its rows' unnormalized output, max and sum to the scratch `ws`, then bumps the item's
// counter `cnt`; the unit that arrives last merges the runs (flash-decoding) and writes y, then puts
// the counter back to 0. WMERGE (attention.py WARP_MERGE): that merge reads every run's (m, l) of a row
// at once, a warp per row and a lane per run, and every run's value of an output element at once; otherwise
// one thread per row walks the runs (the first form, kept for A/B timing). splits is chosen at run time
// from the launch: enough units for TARGET blocks (default ATT_SPLIT_TARGET, ceil(TARGET / items) runs), or, for
// any other TARGET, as many runs as keep the units within it (attention.py split_target: one wave of an H200 for the
// 8-warp tensor-core kernel, which fits one block per SM), each run at least MIN_KEYS keys (default
// ATT_SPLIT_MIN_KEYS), at most SPLIT, at least 1.
// VPF: each lane prefetches its key's V row into L2 before it reads the K row, so the values' DRAM latency
// overlaps the scores' instead of following it (attention.py: ATLAS_ATTENTION_VPREFETCH); the MMA path in blocks of
// 8 warps loads a block's V fragments together with its K rows instead (decode_warp_mma's VEARLY).
// MMA: scores and values on tensor cores (decode_warp_mma; attention.py: ATLAS_ATTENTION_MMA).
constexpr int ATT_SPLIT_TARGET = 256;
constexpr int ATT_SPLIT_MIN_KEYS = 256;  // docs/perf.md v14: 64 lost up to 13 us at batch 1

// a warp merges up to 32 softmax states, one per lane (m: its max, l: its sum of exp(s - m); a lane without one
// passes -inf, 0): M = the states' max, L = their sum relative to M, and the lane's weight exp(m - M), 0 for a
// lane whose state saw no key or when none did (M = -inf)
__device__ __forceinline__ float att_merge_lanes(float m, float l, float& M, float& L) {
  M = warp_max(m);
  const float f = M == -INFINITY ? 0.f : expf(m - M);
  L = warp_sum(l * f);
  return f;
}

// prefetch the bytes [p, p + n) into L2, one request per 128-byte line
template <int N> __device__ __forceinline__ void prefetch_l2(const void* p) {
  const char* c = reinterpret_cast<const char*>(p);
#pragma unroll
  for (int o = 0; o < N; o += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
}

// d += A * B for one m16n8k16 tile (linear.cu, included after this file)
__device__ __forceinline__ void lin_mma(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                        unsigned b0, unsigned b1);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr bool ATT_MMA_ARCH = false;  // no mma.sync: the MMA decode path runs the SIMT one
#else
constexpr bool ATT_MMA_ARCH = true;
#endif

__device__ __forceinline__ unsigned att_word(const uint4& v, int w) {  // w a compile-time constant once unrolled
  return w == 0 ? v.x : (w == 1 ? v.y : (w == 2 ? v.z : v.w));
}
// two floats rounded to a half2 (lo, hi); their rounded values added to sum
__device__ __forceinline__ unsigned att_pack(float lo, float hi, float& sum) {
  const __half2 h = __floats2half2_rn(lo, hi);
  const float2 f = __half22float2(h);
  sum += f.x + f.y;
  return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ unsigned att_pair(__half lo, __half hi) {
  const __half2 h = __halves2half2(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}

// the column at which attention_decode's shared `part` keeps element `col` of partial row `prow` (warp * R + row):
// bits 0-3 of col XORed by (prow & 7, col's bit 5). The MMA path's stores (a lane per row g and column 16 c + const)
// then spread over 16 banks instead of 2 (ncu, 8B batch 1, 4096 keys: 7.6-way conflicts on its shared stores,
// docs/perf.md v35). A bijection within each 16 aligned columns, the same one over the 32 columns of a 32-aligned
// range, so a warp reading 32 consecutive columns of one row stays free of conflicts; head dims that are not a
// multiple of 16 keep the plain layout.
template <int D> __device__ __forceinline__ int att_part_col(int prow, int col) {
  if constexpr (D % 16 == 0) return col ^ ((prow & 7) | ((col >> 2) & 8));
  return col;
}

// MMA decode (attention.py: ATLAS_ATTENTION_MMA): one warp's share of a unit's keys on tensor cores, float16,
// R <= 8 rows, D 64 or 128; the rest of attention_decode (split, merges) is the SIMT path's. Per block of 32
// keys: S = Q K^T by mma.m16n8k16 with the tile's rows as M (rows R..15 zero) and 4 n-tiles of 8 keys; then
// O += P V with P (rounded to fp16) as the A operand taken straight from S's accumulators (keys 16 kk + 2c,
// 2c + 1 | 2c + 8, 2c + 9 of k-step kk). K's B fragments come from 16-byte row loads (lane g, c: key row g of
// the n-tile, dims 32 p + 8 c .. + 7: k of the first k16 step is 32 p + 8 c + (0, 1 | 2, 3), of the second
// + (4, 5 | 6, 7), Q's A fragments are built with the same permutation, as lin_mma_step's). V's B fragments
// come from 16-byte loads of the four key rows the lane's fragment needs, dims 64 h + 8 g .. + 7, paired by
// byte_perm: output column n of n-tile nt is dim 64 (nt / 8) + 8 n + nt % 8. The warp's (m, l, O) rows go to
// mls / part as the SIMT path writes them. Numerics: q, K, V exact in fp16, float32 scores and accumulation,
// P rounded to fp16 (the same P summed in l), as attention_fa2.
// The lane's row g of the tile is given by the caller: qrow (its q row, nullptr past the tile's rows; 16-byte
// loads when q_vec, else element loads along q's head-dim stride), lim_g (its last visible key, -1: no row),
// moff_g and pos_g (its mask offset and query position), so the q tile needs no staging nor barrier.
// VEARLY (the caller: blocks of 8 warps, i.e. the batch <= 8 kernels): a block's V loads are issued with its K loads,
// before any score (one memory latency per block of 32 keys instead of three; 250 registers on sm90, 252 on sm80 at
// D = 128, no spills). Otherwise each k16 half's V is loaded after the softmax, prefetched into L2 with K when VPF:
// in the 4-warp kernels of batches above 8 the early form was 5% faster alone but 6.6% slower in an 8-layer Llama-3-8B
// batch-32 step at 4096 keys (graphs and programmatic launches on; docs/perf.md v36, runs 4-6).
template <typename MT, int D, int R, bool HAS_MASK, bool KEYS, bool VEARLY, bool VPF, typename KROW, typename VROW>
__device__ __forceinline__ void decode_warp_mma(const AttnArgs<__half, MT>& a, const __half* qrow, bool q_vec,
                                                int lim_g, long long moff_g, long long pos_g, float* part,
                                                float* mls, int kb_lo, int kb_hi, int kend, int nw, float scale,
                                                KROW krow, VROW vrow) {
  static_assert(R <= 8 && (D == 64 || D == 128), "MMA decode: at most 8 rows, head dim 64 or 128");
  constexpr int KP = D / 32, KS = D / 16, NT = D / 8, VH = D / 64;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  unsigned qa[KS][2];  // row g's A fragments (rows g + 8, and rows past the tile: zero)
#pragma unroll
  for (int p = 0; p < KP; ++p) {
    uint4 qv = make_uint4(0u, 0u, 0u, 0u);
    if (qrow != nullptr) {
      if (q_vec) {
        qv = __ldg(reinterpret_cast<const uint4*>(qrow + 32 * p + 8 * c));
      } else {
        const long long qs = a.q.stride[3];
        const __half* q = qrow + (32 * p + 8 * c) * qs;
        qv = make_uint4(att_pair(q[0], q[qs]), att_pair(q[2 * qs], q[3 * qs]), att_pair(q[4 * qs], q[5 * qs]),
                        att_pair(q[6 * qs], q[7 * qs]));
      }
    }
    qa[2 * p][0] = qv.x;
    qa[2 * p][1] = qv.y;
    qa[2 * p + 1][0] = qv.z;
    qa[2 * p + 1][1] = qv.w;
  }
  float o[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m_run = -INFINITY, l_part = 0.f;
  for (int kb = kb_lo + warp; kb < kb_hi; kb += nw) {
    const int j0 = kb * 32;
    if constexpr (!VEARLY && VPF) prefetch_l2<D * 2>(vrow(imin(j0 + lane, kend - 1)));
    uint4 kv[4][KP];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const uint4* kp = reinterpret_cast<const uint4*>(krow(imin(j0 + 8 * nt + g, kend - 1)));
#pragma unroll
      for (int p = 0; p < KP; ++p) kv[nt][p] = __ldg(kp + 4 * p + c);
    }
    // V fragments of k16 half kk: key rows 16 kk + 2c + (0, 1 | 8, 9), past the end the last key (its p is 0)
    uint4 v[2][4][VH];
    auto load_v = [&](int kk) {
#pragma unroll
      for (int q4 = 0; q4 < 4; ++q4) {
        const int j = j0 + 16 * kk + 2 * c + (q4 & 1) + 8 * (q4 >> 1);
        const uint4* vp = reinterpret_cast<const uint4*>(vrow(imin(j, kend - 1)));
#pragma unroll
        for (int h = 0; h < VH; ++h) v[kk][q4][h] = __ldg(vp + 8 * h + g);
      }
    };
    if constexpr (VEARLY) {  // with the K rows, before any score: one memory latency per block instead of three
      load_v(0);
      load_v(1);
    }
    // the mask's part of each score, read while the K rows are on their way (-inf: not visible): every
    // element first (all 8 reads in flight at once), then the biases
    MT mv[4][2];
    if constexpr (HAS_MASK) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) mv[nt][e] = mask_at(a, moff_g, j0 + 8 * nt + 2 * c + e);
    }
    float bias[4][2];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int j = j0 + 8 * nt + 2 * c + e;
        bias[nt][e] = -INFINITY;
        if (j < kend && j <= lim_g) bias[nt][e] = HAS_MASK ? key_bias_of<KEYS>(a, mv[nt][e], j, pos_g) : 0.f;
      }
    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int p = 0; p < KP; ++p) {
        lin_mma(s[nt], qa[2 * p][0], 0u, qa[2 * p][1], 0u, kv[nt][p].x, kv[nt][p].y);
        lin_mma(s[nt], qa[2 * p + 1][0], 0u, qa[2 * p + 1][1], 0u, kv[nt][p].z, kv[nt][p].w);
      }
    }
    // online softmax of row g over the block (the quad c = 0..3 holds its 32 scores)
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[nt][e] = bias[nt][e] == -INFINITY ? -INFINITY : s[nt][e] * scale + bias[nt][e];
        mx = fmaxf(mx, s[nt][e]);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (!__any_sync(0xffffffffu, mx != -INFINITY)) continue;  // every key of the block hidden: no change
    const float mn = fmaxf(m_run, mx);
    const float mu = mn == -INFINITY ? 0.f : mn;  // a row with nothing visible yet: p = 0
    const float corr = expf(m_run - mu);          // 0 when m_run was -inf
    m_run = mn;
    l_part *= corr;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      o[nt][0] *= corr;
      o[nt][1] *= corr;
    }
    unsigned pa[2][2];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      pa[kk][0] = att_pack(expf(s[2 * kk][0] - mu), expf(s[2 * kk][1] - mu), l_part);
      pa[kk][1] = att_pack(expf(s[2 * kk + 1][0] - mu), expf(s[2 * kk + 1][1] - mu), l_part);
    }
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      if constexpr (!VEARLY) load_v(kk);  // after the softmax (VPF: from L2)
#pragma unroll
      for (int h = 0; h < VH; ++h)
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const unsigned sel = (e & 1) ? 0x7632u : 0x5410u;
          const unsigned b0 = __byte_perm(att_word(v[kk][0][h], e >> 1), att_word(v[kk][1][h], e >> 1), sel);
          const unsigned b1 = __byte_perm(att_word(v[kk][2][h], e >> 1), att_word(v[kk][3][h], e >> 1), sel);
          lin_mma(o[8 * h + e], pa[kk][0], 0u, pa[kk][1], 0u, b0, b1);
        }
    }
  }
  float l = l_part;
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  if (g < R) {
    const int prow = warp * R + g;
    float* pr = part + prow * D;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      pr[att_part_col<D>(prow, 64 * (nt / 8) + 8 * (2 * c) + nt % 8)] = o[nt][0];
      pr[att_part_col<D>(prow, 64 * (nt / 8) + 8 * (2 * c + 1) + nt % 8)] = o[nt][1];
    }
    if (c == 0) {
      mls[(warp * R + g) * 2] = m_run;
      mls[(warp * R + g) * 2 + 1] = l;
    }
  }
}

// the runs attention_decode cuts each of `items` items' Skv keys into (see the sequence split above)
template <int SPLIT, int MIN_KEYS, int TARGET = ATT_SPLIT_TARGET>
__host__ __device__ __forceinline__ long long att_decode_splits(long long items, long long Skv) {
  static_assert(TARGET >= 1, "a split aims for at least one block");
  if constexpr (SPLIT > 1) {
    // a 32-bit division: attention_decode checks items < 2^26 (attention_prefetch_kv's value is only a hint).
    // TARGET = ATT_SPLIT_TARGET (the kernels without a one-wave rule) keeps v14-v38's ceil(256 / items) runs; any
    // other TARGET is a cap, rounded down so that items * splits stays within it (the 8-warp kernels' one wave of an
    // H200, docs/perf.md v39)
    const unsigned t = (unsigned)TARGET, n = (unsigned)items;
    const long long want = TARGET == ATT_SPLIT_TARGET ? (t + n - 1) / n : t / n;
    const long long by_len = (Skv + MIN_KEYS - 1) / MIN_KEYS;
    const long long splits = want < by_len ? want : by_len;
    return splits < 1 ? 1 : (splits > SPLIT ? SPLIT : splits);
  }
  return 1;
}

// L2 prefetch of rows [j0, j1) of a K or V view's (b, h): one bulk prefetch per 32 KB of adjacent rows (row stride
// D), else one per row (16-byte aligned rows only); nothing unless every element read lies in [0, extent) from v.p
// (the value's allocation). The block's threads share the requests.
template <typename T, int D>
__device__ __forceinline__ void att_prefetch_rows(const View<T, 4>& v, long long extent, long long b, long long h,
                                                  long long j0, long long j1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr unsigned ROW = D * sizeof(T);
  constexpr long long PER = (32768 / ROW) > 0 ? 32768 / ROW : 1;  // rows per request when adjacent
  constexpr long long VEC = 16 / (long long)sizeof(T);
  const long long rs = v.stride[2], first = b * v.stride[0] + h * v.stride[1] + j0 * rs;
  if (j1 <= j0 || first < 0 || rs < D || rs % VEC != 0 || v.stride[3] != 1 || first + (j1 - 1 - j0) * rs + D > extent)
    return;
  const T* base = v.p + first;
  if ((reinterpret_cast<unsigned long long>(base) & 15ULL) != 0) return;
  if (rs == D) {
    for (long long r = threadIdx.x * PER; r < j1 - j0; r += (long long)blockDim.x * PER) {
      const long long n = j1 - j0 - r < PER ? j1 - j0 - r : PER;
      l2_prefetch_bulk(base + r * D, (unsigned)(n * ROW));
    }
  } else {
    for (long long r = threadIdx.x; r < j1 - j0; r += blockDim.x)
      l2_prefetch_bulk(base + r * rs, ROW);
  }
#endif
}

// Early KV (attention.py ATLAS_ATTENTION_EARLY_KV): before the kernel's pdl_enter, an L2 prefetch of the K and V
// rows of the block's first unit of attention_decode at one query position (the same units, runs and key limit), at
// most ATT_EARLY_KV_BYTES of each, so they stream in while the kernel before (the QKV projection that appends this
// step's row) still runs: all of a batch-1 run of 256 keys at head dim 128 (64 KB of K, 64 of V), and at most 33.5 MB
// over a 256-block grid (batch 32), within the H200's 50 MB L2 (not measured: what it evicts at batch 32 is for the
// A/B to say). Only a hint: it changes no result. It reads the dims before the wait: the step's input copy or staging
// kernel wrote them before its first kernel (the staging kernel's graph edges stay plain, runtime/cudagraph.py); even
// so every request is bounded by its value's allocation (ke, ve, pke, pve: elements from the view's base), whatever
// the dims hold. Sq is taken as at most 1 (the emitter asks for it only there).
constexpr long long ATT_EARLY_KV_BYTES = 65536;

template <typename T, typename MT, int D, int R, bool HAS_PAST, bool CAUSAL, int SPLIT = 1,
          int MIN_KEYS = ATT_SPLIT_MIN_KEYS, int TARGET = ATT_SPLIT_TARGET>
__device__ __forceinline__ void attention_prefetch_kv(const AttnArgs<T, MT>& a, long long ke, long long ve,
                                                      long long pke = 0, long long pve = 0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const long long B = imin(a.q.shape[0], 1LL << 20), Hq = a.q.shape[1], Sq = imin(a.q.shape[2], 1);
  const long long Hk = a.k.shape[1];
  if (B <= 0 || Hk <= 0 || Hq % Hk != 0 || Sq <= 0) return;
  const long long P = HAS_PAST ? imax(0, imin(a.past, 1LL << 30)) : 0;
  const long long Skv = imin(P + imax(0, imin(a.k.shape[2], 1LL << 30)), 1LL << 30);
  const long long group = Hq / Hk, rows = group * Sq;
  const long long tiles = (rows + R - 1) / R, items = B * Hk * tiles;
  const long long splits = att_decode_splits<SPLIT, MIN_KEYS, TARGET>(items, Skv);
  const long long unit = blockIdx.x;
  if (unit >= items * splits) return;
  const long long item = unit / splits, sp = unit % splits;
  const long long tile = item % tiles, hk = (item / tiles) % Hk, b = item / (tiles * Hk);
  long long kend = Skv;  // as attention_decode (KEYS' causal limit is Skv at one query position)
  if constexpr (CAUSAL) kend = imin(Skv, (imin(rows, tile * R + R) - 1) / group + P + 1);
  const long long nblk = (kend + 31) / 32, cap = ATT_EARLY_KV_BYTES / (D * (long long)sizeof(T));
  const long long j0 = sp * nblk / splits * 32, j1 = imin(imin(kend, (sp + 1) * nblk / splits * 32), j0 + cap);
  if constexpr (HAS_PAST) {
    att_prefetch_rows<T, D>(a.pk, pke, b, hk, j0, imin(j1, P));
    att_prefetch_rows<T, D>(a.pv, pve, b, hk, j0, imin(j1, P));
    att_prefetch_rows<T, D>(a.k, ke, b, hk, imax(j0, P) - P, j1 - P);
    att_prefetch_rows<T, D>(a.v, ve, b, hk, imax(j0, P) - P, j1 - P);
  } else {
    att_prefetch_rows<T, D>(a.k, ke, b, hk, j0, j1);
    att_prefetch_rows<T, D>(a.v, ve, b, hk, j0, j1);
  }
#endif
}

template <typename T, typename MT, int D, int EV, int R, int NW, int ACC, bool HAS_PAST, bool HAS_MASK, bool CAUSAL,
          int SPLIT = 1, bool KEYS = false, int MIN_KEYS = ATT_SPLIT_MIN_KEYS, bool VPF = true, bool MMA = false,
          bool WMERGE = true, int TARGET = ATT_SPLIT_TARGET>
__device__ __forceinline__ void attention_decode(const AttnArgs<T, MT>& a, float* ws = nullptr,
                                                 unsigned int* cnt = nullptr) {
  constexpr int VEC = 16 / (int)sizeof(T);  // elements per 16-byte K vector
  constexpr int NV = D / VEC;                 // K vectors per row
  // K vectors in flight: the whole row up to 256 bytes, half of ATT_DECODE_KC for longer rows (ptxas
  // hoists the next chunk's loads: fp32 D=256 spilled with 16)
  constexpr int KC = att_divisor_upto(NV, NV <= ATT_DECODE_KC ? ATT_DECODE_KC : ATT_DECODE_KC / 2);
  constexpr int LPR = D / EV < 32 ? D / EV : 32;  // lanes per V row
  constexpr int KPI = 32 / LPR;                   // V rows per warp-wide load
  constexpr int VPL = D / EV / LPR;               // V loads per lane and row
  constexpr int NA = VPL * EV;                    // accumulators per lane and query row
  constexpr int ITERS = 32 / KPI;                 // warp-wide V loads per block of 32 keys
  constexpr int IC = att_divisor_upto(ITERS, ATT_DECODE_VC / VPL > 0 ? ATT_DECODE_VC / VPL : 1);
  static_assert(NV * VEC == D && NV % KC == 0, "K: whole 16-byte vectors");
  static_assert(MIN_KEYS >= 1, "a run has at least one key");
  static_assert(EV <= VEC && LPR * KPI == 32 && VPL * LPR * EV == D, "V: lanes split the head dim");
  static_assert(!MMA || std::is_same<T, __half>::value, "MMA decode: float16");

  const long long B = a.q.shape[0], Hq = a.q.shape[1], Sq = a.q.shape[2];
  const long long Hk = a.k.shape[1], S_new = a.k.shape[2];
  const long long P = HAS_PAST ? a.past : 0;
  const long long Skv = P + S_new;
  bool ok = Hk > 0 && Hq % Hk == 0 && a.q.shape[3] == D && a.k.shape[3] == D && a.v.shape[3] == D &&
            rows_vec_ok(a.k, VEC) && rows_vec_ok(a.v, VEC) && Skv < (1LL << 30) && B * Hq * Sq < (1LL << 26);
  if constexpr (HAS_PAST) ok = ok && rows_vec_ok(a.pk, VEC) && rows_vec_ok(a.pv, VEC);
  if (!ok) {  // uniform over the launch
    attention_rows<T, MT, ACC, HAS_PAST, HAS_MASK, CAUSAL, 0, -1, KEYS>(a);
    return;
  }
  const long long group = Hq / Hk;
  const float scale = a.scale != 0.f ? a.scale : (float)(1.0 / sqrt((double)D));
  const long long rows = group * Sq;  // query rows per (b, kv head)
  // KEYS, causal, fill -inf: a hidden future key adds exactly 0, so keys past a row's position are skipped
  // like CAUSAL's (query i at Skv - Sq + i); with a finite fill every key counts, as with the mask tensor
  const bool keys_causal = KEYS && a.keys_causal && a.keys_fill == -INFINITY;
  const bool q_vec = MMA && rows_vec_ok(a.q, VEC);  // MMA: q rows read as 16-byte vectors
  const long long tiles = (rows + R - 1) / R;
  const long long items = B * Hk * tiles;
  const long long splits = att_decode_splits<SPLIT, MIN_KEYS, TARGET>(items, Skv);
  __shared__ bool last_unit;

  // shared memory (attention.py fast_smem: 16 * ceil(12 R / 16) + 4 * (R D + NW R D + 3 NW R) bytes)
  long long* moff = reinterpret_cast<long long*>(atlas_attn_smem);  // [R] mask row offsets
  int* lim = reinterpret_cast<int*>(moff + R);                        // [R] last key allowed (-1: no row)
  float* q_s = reinterpret_cast<float*>(atlas_attn_smem + 16 * ((12 * R + 15) / 16));  // [R][D]
  float* part = q_s + R * D;                                          // [NW][R][D] warps' accumulators
  float* mls = part + NW * R * D;                                     // [NW][R][2] warps' m, l
  float* fac = mls + 2 * NW * R;                                      // [NW][R] weight of a warp's acc
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kk = lane / LPR, vi = lane % LPR;

  // the unit's coordinates in 32-bit arithmetic (units < 2^31: items < 2^26 by the check above, splits <= 32): a
  // 64-bit division tests the high words and branches even when it then runs the ~20-instruction 32-bit sequence,
  // and four of them sat on every block's way to its first K load (ncu source counters, docs/perf.md v36)
  const unsigned u_splits = (unsigned)splits, u_tiles = (unsigned)tiles, u_hk = (unsigned)Hk;
  for (unsigned unit = blockIdx.x; unit < (unsigned)(items * splits); unit += gridDim.x) {
    const unsigned u_item = unit / u_splits, u_th = u_item / u_tiles;
    const long long item = u_item, sp = unit - u_item * u_splits;
    const long long tile = u_item - u_th * u_tiles, hk = u_th % u_hk, b = u_th / u_hk;
    const long long r0 = tile * R;
    // keys this tile can see: all, or (causal) up to its last row's limit
    int kend = (int)Skv;
    if constexpr (CAUSAL) kend = (int)imin(Skv, (imin(rows, r0 + R) - 1) / group + P + 1);
    if (keys_causal) kend = (int)imin(Skv, (imin(rows, r0 + R) - 1) / group + Skv - Sq + 1);
    const T* kbase = a.k.p + b * a.k.stride[0] + hk * a.k.stride[1];
    const T* vbase = a.v.p + b * a.v.stride[0] + hk * a.v.stride[1];
    const T* pkbase = HAS_PAST ? a.pk.p + b * a.pk.stride[0] + hk * a.pk.stride[1] : kbase;
    const T* pvbase = HAS_PAST ? a.pv.p + b * a.pv.stride[0] + hk * a.pv.stride[1] : vbase;
    auto krow = [&](int j) -> const T* {
      if (HAS_PAST && j < P) return pkbase + j * a.pk.stride[2];
      return kbase + (j - P) * a.k.stride[2];
    };
    auto vrow = [&](int j) -> const T* {
      if (HAS_PAST && j < P) return pvbase + j * a.pv.stride[2];
      return vbase + (j - P) * a.v.stride[2];
    };
    const int nblk = (kend + 31) / 32;
    const int kb_lo = (int)((unsigned)sp * (unsigned)nblk / u_splits);  // nblk <= 2^25, sp < 32: no overflow
    const int kb_hi = (int)(((unsigned)sp + 1u) * (unsigned)nblk / u_splits);
    __syncthreads();  // the previous item's readers of the shared arrays are done
    if constexpr (MMA && ATT_MMA_ARCH) {  // the lane's row g: no q staging (decode_warp_mma)
      const long long rr = r0 + (lane >> 2);
      const bool has_row = (lane >> 2) < R && rr < rows;
      const long long h = hk * group + rr % group, i = rr / group;
      const int lim_g = has_row ? (int)(CAUSAL ? imin(i + P, Skv - 1)
                                               : (keys_causal ? imin(Skv - Sq + i, Skv - 1) : Skv - 1))
                                : -1;
      const long long moff_g =
          HAS_MASK && has_row ? b * a.mask.stride[0] + h * a.mask.stride[1] + i * a.mask.stride[2] : 0;
      const T* qrow = has_row ? a.q.p + b * a.q.stride[0] + h * a.q.stride[1] + i * a.q.stride[2] : nullptr;
      decode_warp_mma<MT, D, R, HAS_MASK, KEYS, (NW >= 8), VPF>(a, qrow, q_vec, lim_g, moff_g, Skv - Sq + i, part,
                                                                 mls, kb_lo, kb_hi, kend, NW, scale, krow, vrow);
    } else {
      for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
        const int r = idx / D, dd = idx % D;
        const long long rr = r0 + r;
        float x = 0.f;
        if (rr < rows) {
          const long long h = hk * group + rr % group, i = rr / group;
          x = load(a.q.p + b * a.q.stride[0] + h * a.q.stride[1] + i * a.q.stride[2] + dd * a.q.stride[3]);
        }
        q_s[idx] = x;
      }
      if (threadIdx.x < R) {
        const long long rr = r0 + threadIdx.x;
        const long long h = hk * group + rr % group, i = rr / group;
        lim[threadIdx.x] = rr < rows ? (int)(CAUSAL ? imin(i + P, Skv - 1)
                                                    : (keys_causal ? imin(Skv - Sq + i, Skv - 1) : Skv - 1))
                                     : -1;
        moff[threadIdx.x] = HAS_MASK ? b * a.mask.stride[0] + h * a.mask.stride[1] + i * a.mask.stride[2] : 0;
      }
      __syncthreads();
      int kpos[R];  // KEYS: each row's query position
#pragma unroll
      for (int r = 0; r < R; ++r) kpos[r] = KEYS ? (int)(Skv - Sq + (r0 + r) / group) : 0;
      float m_run[R], l_part[R], acc[R][NA];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        m_run[r] = -INFINITY;
        l_part[r] = 0.f;
#pragma unroll
        for (int t = 0; t < NA; ++t) acc[r][t] = 0.f;
      }
      for (int kb = kb_lo + warp; kb < kb_hi; kb += NW) {
        // scores of the block's 32 keys: lane owns key j
        const int j = kb * 32 + lane;
        const bool valid = j < kend;
        const uint4* kp = reinterpret_cast<const uint4*>(krow(valid ? j : kend - 1));
        if constexpr (VPF) prefetch_l2<D * (int)sizeof(T)>(vrow(valid ? j : kend - 1));
        float dot0[R], dot1[R];
#pragma unroll
        for (int r = 0; r < R; ++r) dot0[r] = dot1[r] = 0.f;
#pragma unroll 1
        for (int c = 0; c < NV; c += KC) {  // chunks not unrolled: ptxas would hoist every chunk's loads
          uint4 kv[KC];
#pragma unroll
          for (int u = 0; u < KC; ++u) kv[u] = __ldg(kp + c + u);
#pragma unroll
          for (int u = 0; u < KC; ++u) {
            float kf[VEC];
            to_float16B<T>(kv[u], kf);
#pragma unroll
            for (int r = 0; r < R; ++r) {
              const float4* qv = reinterpret_cast<const float4*>(q_s + r * D + (c + u) * VEC);
              float& dot = (u & 1) ? dot1[r] : dot0[r];
#pragma unroll
              for (int e = 0; e < VEC / 4; ++e) {
                const float4 qq = qv[e];
                dot = fmaf(qq.x, kf[4 * e], dot);
                dot = fmaf(qq.y, kf[4 * e + 1], dot);
                dot = fmaf(qq.z, kf[4 * e + 2], dot);
                dot = fmaf(qq.w, kf[4 * e + 3], dot);
              }
            }
          }
        }
        // online softmax over the block, per query row
        float p[R];
        bool live = false;
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float s = -INFINITY;
          if (valid && j <= lim[r]) {
            float bias = 0.f;
            if constexpr (HAS_MASK) bias = row_key_bias<KEYS>(a, moff[r], j, kpos[r]);
            s = (dot0[r] + dot1[r]) * scale + bias;
          }
          const float m_new = fmaxf(m_run[r], warp_max(s));
          if (m_new == -INFINITY) {  // every key so far masked for this row: nothing to add
            p[r] = 0.f;
            continue;
          }
          live = true;
          const float corr = expf(m_run[r] - m_new);  // 0 when m_run was -inf
          p[r] = expf(s - m_new);                     // 0 for masked keys
          l_part[r] = l_part[r] * corr + p[r];
#pragma unroll
          for (int t = 0; t < NA; ++t) acc[r][t] *= corr;
          m_run[r] = m_new;
        }
        if (!live) continue;  // warp-uniform: a fully masked block reads no values
        // values: lane reads elements (vi + w * LPR) * EV + [0, EV) of key row kb * 32 + it * KPI + kk
        // V chunks: unrolled for one load per lane and row; rows of more than 32 loads run them as a
        // loop (fp32 D=256 spilled when unrolled)
#pragma unroll(VPL == 1 ? ITERS / IC : 1)
        for (int it0 = 0; it0 < ITERS; it0 += IC) {
          typename RawVec<EV * sizeof(T)>::type vv[IC][VPL];
#pragma unroll
          for (int it = 0; it < IC; ++it) {
            const int jj = kb * 32 + (it0 + it) * KPI + kk;
            const T* vp = vrow(jj);
#pragma unroll
            for (int w = 0; w < VPL; ++w) {  // keys past the end: zeros (their p is 0)
              vv[it][w] = {};
              if (jj < kend) vv[it][w] = ldg_vec<T, EV>(vp + (vi + w * LPR) * EV);
            }
          }
#pragma unroll
          for (int it = 0; it < IC; ++it) {
            float pj[R];
#pragma unroll
            for (int r = 0; r < R; ++r) pj[r] = __shfl_sync(0xffffffffu, p[r], (it0 + it) * KPI + kk);
#pragma unroll
            for (int w = 0; w < VPL; ++w) {
              float vf[EV];
              raw_to_float<T, EV>(vv[it][w], vf);
#pragma unroll
              for (int r = 0; r < R; ++r)
#pragma unroll
                for (int e = 0; e < EV; ++e) acc[r][w * EV + e] = fmaf(pj[r], vf[e], acc[r][w * EV + e]);
            }
          }
        }
      }

      // the warp's state: lanes with the same vi hold partial sums over different keys
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float l = warp_sum(l_part[r]);
#pragma unroll
        for (int o = LPR; o < 32; o <<= 1)
#pragma unroll
          for (int t = 0; t < NA; ++t) acc[r][t] += __shfl_xor_sync(0xffffffffu, acc[r][t], o);
        if (lane < LPR) {
#pragma unroll
          for (int w = 0; w < VPL; ++w)
#pragma unroll
            for (int e = 0; e < EV; ++e)
              part[(warp * R + r) * D + att_part_col<D>(warp * R + r, (vi + w * LPR) * EV + e)] = acc[r][w * EV + e];
        }
        if (lane == 0) {
          mls[(warp * R + r) * 2] = m_run[r];
          mls[(warp * R + r) * 2 + 1] = l;
        }
      }
    }
    __syncthreads();
    // row r: the final max M and sum L, then each warp's weight exp(m_w - M) / L; a warp per row and a lane per
    // warp (NW <= 32), so every warp's (m, l) is read at once instead of by one thread walking the warps in turn
    static_assert(NW <= 32, "a lane per warp");
    for (int r = warp; r < R; r += NW) {
      const bool wl = lane < NW;
      float M, L;
      const float f = att_merge_lanes(wl ? mls[(lane * R + r) * 2] : -INFINITY, wl ? mls[(lane * R + r) * 2 + 1] : 0.f,
                                      M, L);
      if (splits == 1) {
        if (wl) fac[lane * R + r] = (M == -INFINITY || L == 0.f) ? 0.f : f / L;
      } else {  // this run's unnormalized output relative to its max M, with M and L for the merge
        if (wl) fac[lane * R + r] = f;
        if (lane == 0) {
          float* slot = ws + ((item * SPLIT + sp) * R + r) * (D + 2);
          slot[D] = M;
          slot[D + 1] = L;
        }
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
      const int r = idx / D, dd = idx % D;
      const long long rr = r0 + r;
      if (rr >= rows) continue;
      float o = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w)
        o = fmaf(part[(w * R + r) * D + att_part_col<D>(w * R + r, dd)], fac[w * R + r], o);
      if (splits > 1) {
        ws[((item * SPLIT + sp) * R + r) * (D + 2) + dd] = o;
        continue;
      }
      const long long h = hk * group + rr % group, i = rr / group;
      store(a.y.p + b * a.y.stride[0] + h * a.y.stride[1] + i * a.y.stride[2] + dd * a.y.stride[3], o);
    }
    if (splits == 1) continue;
    // the last run of this item to finish merges every run's rows. The barrier orders every thread's scratch
    // writes before thread 0's fence, which (cumulative) releases them with its counter update, and in the last
    // run acquires the other runs' writes before the barrier lets the block read them: cooperative groups' grid
    // sync order, one fence per block instead of one per warp on each side
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      last_unit = atomicAdd(cnt + item, 1u) == (unsigned int)(splits - 1);
      if (last_unit) __threadfence();
    }
    __syncthreads();
    if (!last_unit) continue;
    // each run's weight exp(m_s - M) / L per row, once (into `part`: free after the loop above)
    float* wgt = part;  // [R][SPLIT]
    constexpr long long RUN = (long long)R * (D + 2);  // floats between one row's slots of two runs
    if constexpr (WMERGE) {  // a warp per row, a lane per run (SPLIT <= 32): every run's m, l read at once
      static_assert(SPLIT <= 32, "WMERGE: a lane per run");
      for (int r = warp; r < R; r += NW) {
        const float* run0 = ws + (item * SPLIT * R + r) * (D + 2);
        const bool run = lane < splits;
        float M, L;
        const float f = att_merge_lanes(run ? __ldcg(run0 + lane * RUN + D) : -INFINITY,
                                        run ? __ldcg(run0 + lane * RUN + D + 1) : 0.f, M, L);
        if (run) wgt[r * SPLIT + lane] = L == 0.f ? 0.f : f / L;
      }
    } else if (threadIdx.x < R) {
      const int r = threadIdx.x;
      const float* run0 = ws + (item * SPLIT * R + r) * (D + 2);
      float M = -INFINITY;
      for (long long s2 = 0; s2 < splits; ++s2) M = fmaxf(M, __ldcg(run0 + s2 * RUN + D));
      float L = 0.f;
      for (long long s2 = 0; s2 < splits; ++s2) {
        const float f = M == -INFINITY ? 0.f : expf(__ldcg(run0 + s2 * RUN + D) - M);  // 0: a run with no key
        wgt[r * SPLIT + s2] = f;
        L = fmaf(__ldcg(run0 + s2 * RUN + D + 1), f, L);
      }
      const float inv = L == 0.f ? 0.f : 1.f / L;
      for (long long s2 = 0; s2 < splits; ++s2) wgt[r * SPLIT + s2] *= inv;
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < R * D; idx += blockDim.x) {
      const int r = idx / D, dd = idx % D;
      const long long rr = r0 + r;
      if (rr >= rows) continue;
      const float* run0 = ws + (item * SPLIT * R + r) * (D + 2) + dd;
      float o = 0.f;
      if constexpr (WMERGE) {  // every run's value in flight at once
        float v[SPLIT];
#pragma unroll
        for (int s2 = 0; s2 < SPLIT; ++s2) v[s2] = s2 < splits ? __ldcg(run0 + s2 * RUN) : 0.f;
#pragma unroll
        for (int s2 = 0; s2 < SPLIT; ++s2)
          if (s2 < splits) o = fmaf(v[s2], wgt[r * SPLIT + s2], o);
      } else {
#pragma unroll 8
        for (int s2 = 0; s2 < (int)splits; ++s2) o = fmaf(__ldcg(run0 + s2 * RUN), wgt[r * SPLIT + s2], o);
      }
      const long long h = hk * group + rr % group, i = rr / group;
      store(a.y.p + b * a.y.stride[0] + h * a.y.stride[1] + i * a.y.stride[2] + dd * a.y.stride[3], o);
    }
    if (threadIdx.x == 0) cnt[item] = 0u;  // ready for the next launch
  }
}

// RotaryEmbedding: x and out as [B, S, H, D] views; cos/sin as [rows, S?, half] (see attention.py):
// with position ids cs[pos[b, s], k], else cs[b, s, k]. One thread per output element, grid-stride.
template <typename T, typename CT, bool HAS_POS, bool INTERLEAVED>
__device__ __forceinline__ void rotary(const View<T, 4>& x, const View<T, 4>& out, const View<CT, 3>& cs,
                                       const View<CT, 3>& sn, const View<long long, 2>& pos, long long rot) {
  const long long B = out.shape[0], S = out.shape[1], H = out.shape[2], D = out.shape[3];
  const long long n = B * S * H * D;
  const long long half = rot / 2;
  for (long long f = global_thread(); f < n; f += global_threads()) {
    const long long d = f % D, h = (f / D) % H, s = (f / (D * H)) % S, b = f / (D * H * S);
    const T* xp = x.p + b * x.stride[0] + s * x.stride[1] + h * x.stride[2];
    float o;
    if (d >= rot) {
      o = load(xp + d * x.stride[3]);
    } else {
      const long long k = INTERLEAVED ? d / 2 : (d < half ? d : d - half);
      const long long i1 = INTERLEAVED ? 2 * k : k, i2 = INTERLEAVED ? 2 * k + 1 : k + half;
      long long cb, sb;
      if constexpr (HAS_POS) {
        const long long p = load(pos.p + b * pos.stride[0] + s * pos.stride[1]);
        cb = p * cs.stride[0];
        sb = p * sn.stride[0];
      } else {
        cb = b * cs.stride[0] + s * cs.stride[1];
        sb = b * sn.stride[0] + s * sn.stride[1];
      }
      const float c = load(cs.p + cb + k * cs.stride[2]), si = load(sn.p + sb + k * sn.stride[2]);
      const float x1 = load(xp + i1 * x.stride[3]), x2 = load(xp + i2 * x.stride[3]);
      const bool first = INTERLEAVED ? (d % 2 == 0) : (d < half);
      o = first ? c * x1 - si * x2 : si * x1 + c * x2;
    }
    store(out.p + b * out.stride[0] + s * out.stride[1] + h * out.stride[2] + d * out.stride[3], o);
  }
}

// KVAppend: present is the cache slot's view [B, H, past + S, D]; write new[b, h, s, :] at past + s.
// Positions beyond max_seq or batches beyond max_batch are dropped (the runtime rejects such steps).
template <typename T>
__device__ __forceinline__ void kv_append(const View<T, 4>& x, const View<T, 4>& present, long long past,
                                          long long max_batch, long long max_seq) {
  const long long B = x.shape[0], H = x.shape[1], S = x.shape[2], D = x.shape[3];
  const long long n = B * H * S * D;
  for (long long f = global_thread(); f < n; f += global_threads()) {
    const long long d = f % D, s = (f / D) % S, h = (f / (D * S)) % H, b = f / (D * S * H);
    if (b >= max_batch || past + s >= max_seq) continue;
    const T v = x.p[b * x.stride[0] + h * x.stride[1] + s * x.stride[2] + d * x.stride[3]];
    present.p[b * present.stride[0] + h * present.stride[1] + (past + s) * present.stride[2] + d * present.stride[3]] = v;
  }
}

// QKVRotary: qkv [B, S, (Hq + 2Hk) * D] (rows of any stride, unit stride inside a row) -> q [B, Hq, S, D]
// rotated; rotated k and v written into the cache views at positions past + s. cos/sin are
// [Bc, S, R] with Bc = 1 (shared) or B. One thread per element; each product and the sum are
// rounded to T like the reference (an fp16 export rotates in fp16), so the kernel is bit-exact.
template <typename T> __device__ __forceinline__ T rot_round(float v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half rot_round<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__device__ __forceinline__ void qkv_rotary(const View<T, 3>& qkv, const View<T, 3>& cs, const View<T, 3>& sn,
                                           const View<T, 4>& q, const View<T, 4>& pk, const View<T, 4>& pv,
                                           long long Hq, long long Hk, long long D, long long past,
                                           long long max_batch, long long max_seq) {
  const long long B = qkv.shape[0], S = qkv.shape[1], H = Hq + 2 * Hk, R = cs.shape[2], half = R / 2;
  const long long n = B * S * H * D;
  for (long long f = global_thread(); f < n; f += global_threads()) {
    const long long d = f % D, h = (f / D) % H, s = (f / (D * H)) % S, b = f / (D * H * S);
    const T* row = qkv.p + b * qkv.stride[0] + s * qkv.stride[1] + h * D * qkv.stride[2];
    const float x = float(row[d * qkv.stride[2]]);
    T out;
    if (h < Hq + Hk && d < R) {
      const long long cb = cs.shape[0] == 1 ? 0 : b;
      const float c = float(cs.p[cb * cs.stride[0] + s * cs.stride[1] + d * cs.stride[2]]);
      const float si = float(sn.p[cb * sn.stride[0] + s * sn.stride[1] + d * sn.stride[2]]);
      const float partner = d < half ? -float(row[(d + half) * qkv.stride[2]]) : float(row[(d - half) * qkv.stride[2]]);
      const float a = float(rot_round<T>(x * c)), r = float(rot_round<T>(partner * si));
      out = rot_round<T>(a + r);
    } else {
      out = row[d * qkv.stride[2]];
    }
    if (h < Hq) {
      q.p[b * q.stride[0] + h * q.stride[1] + s * q.stride[2] + d * q.stride[3]] = out;
    } else if (b < max_batch && past + s < max_seq) {
      const View<T, 4>& c = h < Hq + Hk ? pk : pv;
      const long long hh = h < Hq + Hk ? h - Hq : h - Hq - Hk;
      c.p[b * c.stride[0] + hh * c.stride[1] + (past + s) * c.stride[2] + d * c.stride[3]] = out;
    }
  }
}

}  // namespace atlas
