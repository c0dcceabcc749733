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
};

// PRESENT: bit 0 writes present_key, bit 1 present_value; QK_MODE: -1 none, else the qk output mode
template <typename T, typename MT, int ACC, bool HAS_PAST, bool HAS_MASK, bool CAUSAL, int PRESENT, int QK_MODE>
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
      if constexpr (HAS_MASK) {
        const View<MT, 4>& m = a.mask;
        bias = j < m.shape[3]
                   ? mask_bias(load(m.p + b * m.stride[0] + h * m.stride[1] + i * m.stride[2] + j * m.stride[3]))
                   : -INFINITY;
      }
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
