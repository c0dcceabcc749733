// FlashAttention-2-style prefill attention on tensor cores (see flash_attention.py; chosen with
// ATLAS_ATTENTION_PREFILL=fa2). Uses AttnArgs / row_key_bias / attention_rows (attention.cu), lin_mma
// (linear.cu: mma.sync m16n8k16, fp16 in, fp32 accumulate) and linear.cu's cp.async helpers (lin_cp16, lin_smem).
//
// Layout: Q, K, V, Y are the rank-4 Views [B, H, S, D] the other attention kernels get (K/V may be
// KV-cache views with a row stride; Y may be [B, S, H*D] by strides). float16 only, head dim D a
// compile-time multiple of 16 up to 128, Dk == Dv. Requires (checked at run time; otherwise the launch
// runs attention_rows, which takes any layout, as on sm < 80): unit stride along D, K/V (and past) rows
// 16-byte aligned, Q rows 4-byte aligned.
//
// Work: one block of NW warps per item (b, query head h, tile of BR = 16 NW query rows); items are
// ordered (b, kv head, row tile from the last, head of the GQA group), so the heads that share a kv head
// run side by side (their K/V tiles come from L2) and the longest causal tiles start first. Warp w owns
// rows 16w .. 16w + 15 of the tile: its Q fragments (A operands, D / 16 k-steps) stay in registers.
// K and V tiles of BC = 64 keys are staged in shared memory ([BC][D + 8] halves each: the 16-byte pad
// makes ldmatrix rows conflict-free) by cp.async, two stages (tile t + 1 loads while t is computed);
// keys past the end are zero-filled. Per tile and warp: S = Q K^T (ldmatrix of K rows as B), then
// s = S * scale + bias in float32 (log2 units), online softmax on the accumulator fragments (row max
// over the quad by shuffles; l summed per lane from the fp16-rounded P, reduced at the end), P rounded
// to fp16 becomes the A operand of O += P V (ldmatrix.trans of V rows as B) without leaving registers.
// At the end O / l is rounded once to fp16 and stored.
//
// Masks, as attention_rows (reference: Attention in atlasc/ir/ops/nn.py): the mask tensor (bool or
// additive, broadcast to [B, Hq, Sq, T], keys past its last dim hidden), the KEYS form (key_bias_of: the
// attention_mask [B, T] with causal / window / fill), the causal attribute (query i at P + i), keys past
// Skv. Skipping: (1) CAUSAL: key tiles past the block's last row are never loaded (their bias is -inf,
// exact). (2) KEYS causal / window with a fill at or below FA2_HIDDEN: key tiles outside the block's
// visible range are never loaded. (3) with a mask, a warp skips the mma work of a tile whose every bias
// for its rows is at or below FA2_HIDDEN (any_sync vote). A skipped key's term is exp(s + fill - M):
// exactly 0 for fill -inf, and 0 in float32 for a finite fill <= FA2_HIDDEN whenever the row has a
// visible key (M >= that key's score) and scores differ by less than |fill| - 104 (exp underflow;
// 29896 at FA2_HIDDEN: fp16 models do not come near). A row that has no visible key at all gets what
// the reference gives (0 for an all -inf row, else the softmax over every key with its fill added):
// if a warp has such a row and the mask form may hold finite fills, the block recomputes that warp's
// rows over every key without skipping (a second pass).
// Numerics: float32 scores and accumulation; exp2 by ex2.approx (about 2 ulp); scores in log2 units by
// one FMA (dot * scale * log2 e + bias * log2 e), except in the second pass, whose rows sit near a finite
// fill (-65504 + s): there the scores are rounded as the reference rounds them and s - max is taken
// before the conversion (log2 units at that magnitude would move each weight by up to 0.5%); P rounded
// to fp16 for the tensor cores (relative error 2^-11 per weight, the same P in l); one rounding of Y.
namespace atlas {

constexpr int FA2_BC = 64;               // keys per tile (flash_attention.py FA2_BC)
constexpr float FA2_HIDDEN = -30000.f;   // a bias at or below this hides its key (skipping, see above)
constexpr float FA2_LOG2E = 1.4426950408889634f;

__device__ __forceinline__ float fa2_exp2(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// four 8x8 b16 matrices from shared memory: lane L gives the address of row L % 8 of matrix L / 8
__device__ __forceinline__ void fa2_ldsm4(unsigned (&r)[4], const void* p) {
#if __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(lin_smem(p)) : "memory");
#endif
}
__device__ __forceinline__ void fa2_ldsm4_t(unsigned (&r)[4], const void* p) {
#if __CUDA_ARCH__ >= 800
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(lin_smem(p)) : "memory");
#endif
}

// Q rows readable as 4-byte words: unit stride along D, even strides, a 4-byte aligned base
__device__ __forceinline__ bool fa2_q_ok(const View<__half, 4>& q) {
  if (q.stride[3] != 1 || (reinterpret_cast<unsigned long long>(q.p) & 3ULL) != 0) return false;
  for (int i = 0; i < 3; ++i)
    if (q.shape[i] > 1 && q.stride[i] % 2 != 0) return false;
  return true;
}

// the tile loop of one item (see the header); smem: [2 stages][K, V][BC][D + 8] halves
template <typename MT, int D, int NW, bool HAS_PAST, bool HAS_MASK, bool CAUSAL, bool KEYS>
__device__ __forceinline__ void attention_fa2_item(const AttnArgs<__half, MT>& a, __half* smem, long long b,
                                                   long long h, long long hk, long long row0, long long Sq,
                                                   long long P, long long Skv, float scale) {
  constexpr int BC = FA2_BC, KS = D / 16, NT = D / 8, SN = BC / 8, LD = D + 8, TILE = BC * LD, CH = D / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const float sl2 = scale * FA2_LOG2E;
  const long long wrow = row0 + 16 * warp;  // this warp's first row; the lane's rows: wrow + g, wrow + g + 8
  // a finite fill may hide keys (mask tensor values, KEYS fill): then rows without a visible key need pass 2
  bool finite_form = false;
  if constexpr (HAS_MASK) finite_form = KEYS ? a.keys_fill != -INFINITY : !std::is_same<MT, bool>::value;

  unsigned qf[KS][4];
  {
    const __half* qb = a.q.p + b * a.q.stride[0] + h * a.q.stride[1];
    const __half* q0 = qb + imin(wrow + g, Sq - 1) * a.q.stride[2] + 2 * c;
    const __half* q1 = qb + imin(wrow + g + 8, Sq - 1) * a.q.stride[2] + 2 * c;
#pragma unroll
    for (int ks = 0; ks < KS; ++ks) {
      qf[ks][0] = __ldg(reinterpret_cast<const unsigned*>(q0 + 16 * ks));
      qf[ks][1] = __ldg(reinterpret_cast<const unsigned*>(q1 + 16 * ks));
      qf[ks][2] = __ldg(reinterpret_cast<const unsigned*>(q0 + 16 * ks + 8));
      qf[ks][3] = __ldg(reinterpret_cast<const unsigned*>(q1 + 16 * ks + 8));
    }
  }
  long long moff[2] = {0, 0}, pos[2];
#pragma unroll
  for (int hr = 0; hr < 2; ++hr) {
    const long long i = imin(wrow + g + 8 * hr, Sq - 1);
    if constexpr (HAS_MASK) moff[hr] = b * a.mask.stride[0] + h * a.mask.stride[1] + i * a.mask.stride[2];
    pos[hr] = Skv - Sq + i;  // KEYS: the query's position
  }
  // the block's key range: all keys, cut by causal (exact) and by KEYS causal / window when hidden keys skip
  const long long last = imin(row0 + 16 * NW, Sq) - 1;
  long long klo = 0, khi = Skv;
  if constexpr (CAUSAL) khi = imin(khi, last + P + 1);
  if constexpr (KEYS && HAS_MASK) {
    if (a.keys_fill <= FA2_HIDDEN) {
      if (a.keys_causal) khi = imin(khi, Skv - Sq + last + 1);
      if (a.keys_window > 0) klo = imax(0, Skv - Sq + row0 - a.keys_window + 1);
    }
  }
  const long long causal_hi = CAUSAL ? imin(Skv, last + P + 1) : Skv;

  // staging: thread t copies 16-byte chunk t % CH of rows t / CH + RPI * it (shared addresses as offsets
  // from one base, so the copies take immediate offsets); keys past Skv are zero-filled
  constexpr int RPI = NW * 32 / CH, ITERS = (BC + RPI - 1) / RPI;
  const int lr = threadIdx.x / CH, lch = threadIdx.x % CH;
  const unsigned sbase = lin_smem(smem) + (unsigned)(lr * LD + lch * 8) * 2u;
  const __half* kb = a.k.p + b * a.k.stride[0] + hk * a.k.stride[1] + lch * 8;
  const __half* vb = a.v.p + b * a.v.stride[0] + hk * a.v.stride[1] + lch * 8;
  const __half* pkb = HAS_PAST ? a.pk.p + b * a.pk.stride[0] + hk * a.pk.stride[1] + lch * 8 : kb;
  const __half* pvb = HAS_PAST ? a.pv.p + b * a.pv.stride[0] + hk * a.pv.stride[1] + lch * 8 : vb;
  auto load_tile = [&](long long kt, int buf) {
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      if (RPI * ITERS > BC && lr + RPI * it >= BC) break;
      const long long j = kt * BC + lr + RPI * it;
      const bool in = j < Skv;
      const long long jj = in ? j : Skv - 1;
      const bool old = HAS_PAST && jj < P;
      const __half* kp = old ? pkb + jj * a.pk.stride[2] : kb + (jj - P) * a.k.stride[2];
      const __half* vp = old ? pvb + jj * a.pv.stride[2] : vb + (jj - P) * a.v.stride[2];
      const unsigned dst = sbase + (unsigned)(buf * 2 * TILE + RPI * it * LD) * 2u;
      lin_cp16(dst, kp, in);
      lin_cp16(dst + TILE * 2u, vp, in);
    }
  };

  bool redo = false;  // this warp has a row without a visible key and the form may hold finite fills
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1) {
      if (!__syncthreads_or(redo)) break;
      klo = 0;
      khi = causal_hi;
    }
    const bool active = pass == 0 || redo;
    float o[NT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    bool seen[2] = {false, false};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
    const long long kt0 = klo / BC, kt1 = (khi + BC - 1) / BC;
    if (kt0 < kt1) load_tile(kt0, 0);
    lin_cp_commit();
    for (long long kt = kt0; kt < kt1; ++kt) {
      const int buf = (int)((kt - kt0) & 1);
      if (kt + 1 < kt1) load_tile(kt + 1, buf ^ 1);
      lin_cp_commit();
      lin_cp_wait<1>();
      __syncthreads();
      const int j0 = (int)(kt * BC);
      // the bias of the lane's element e of key n-tile nt (natural-log units): mask, causal, keys past Skv
      auto bias_at = [&](int nt, int e) -> float {
        const int hr = e >> 1, j = j0 + nt * 8 + 2 * c + (e & 1);
        if (j >= Skv) return -INFINITY;
        float bb = 0.f;
        if constexpr (HAS_MASK) bb = row_key_bias<KEYS>(a, moff[hr], j, pos[hr]);
        if (CAUSAL && j > wrow + g + 8 * hr + P) bb = -INFINITY;
        return bb;
      };
      bool work = active && wrow < Sq;
      if (CAUSAL && work && j0 > wrow + 15 + P) work = false;  // every key of the tile is after every row
      if constexpr (HAS_MASK || CAUSAL) {
        if (work) {  // which rows see a key of this tile; the warp skips the tile when none does (pass 0)
          bool vis = false;
#pragma unroll
          for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const bool v = bias_at(nt, e) > FA2_HIDDEN;
              seen[e >> 1] |= v;
              vis |= v;
            }
          if (pass == 0 && !__any_sync(0xffffffffu, vis)) work = false;  // warp-uniform
        }
      } else {
        seen[0] = seen[1] = true;  // no mask: every row sees its keys
      }
      if (work) {
        const __half* ks_ = smem + buf * 2 * TILE;
        const __half* vs_ = ks_ + TILE;
        const int mi = lane >> 3, mr = lane & 7;
        float s[SN][4];
#pragma unroll
        for (int nt = 0; nt < SN; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) s[nt][e] = 0.f;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks)
#pragma unroll
          for (int n2 = 0; n2 < SN / 2; ++n2) {  // key n-tiles 2 n2, 2 n2 + 1: (n-tile, k half) per matrix
            unsigned kb[4];
            fa2_ldsm4(kb, ks_ + (n2 * 16 + (mi >> 1) * 8 + mr) * LD + ks * 16 + (mi & 1) * 8);
            lin_mma(s[2 * n2], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], kb[0], kb[1]);
            lin_mma(s[2 * n2 + 1], qf[ks][0], qf[ks][1], qf[ks][2], qf[ks][3], kb[2], kb[3]);
          }
        // online softmax, rows g (hr 0) and g + 8 (hr 1). Pass 0 in log2 units (one FMA per score); pass 2
        // (rows without a visible key: scores near a finite fill such as -65504) in natural units rounded
        // as the reference rounds them (raw = dot * scale, then + bias), converted after the max is taken
        const float em = pass == 0 ? 1.f : FA2_LOG2E;
#pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
          float mx = -INFINITY;
#pragma unroll
          for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int e = 2 * hr; e < 2 * hr + 2; ++e) {
              s[nt][e] = pass == 0 ? fmaf(s[nt][e], sl2, bias_at(nt, e) * FA2_LOG2E)
                                   : __fmul_rn(s[nt][e], scale) + bias_at(nt, e);
              mx = fmaxf(mx, s[nt][e]);
            }
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
          mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
          const float mn = fmaxf(m[hr], mx);
          const float mu = mn == -INFINITY ? 0.f : mn;  // a row with nothing visible yet: p = 0
          const float corr = fa2_exp2((m[hr] - mu) * em);  // 0 when m was -inf
          m[hr] = mn;
          l[hr] *= corr;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            o[nt][2 * hr] *= corr;
            o[nt][2 * hr + 1] *= corr;
          }
#pragma unroll
          for (int nt = 0; nt < SN; ++nt)
#pragma unroll
            for (int e = 2 * hr; e < 2 * hr + 2; ++e) s[nt][e] = fa2_exp2((s[nt][e] - mu) * em);
        }
        // O += P V: P's C fragments of key n-tiles 2 kt2, 2 kt2 + 1 are the A fragment of k-step kt2
#pragma unroll
        for (int kt2 = 0; kt2 < BC / 16; ++kt2) {
          const unsigned p0 = att_pack(s[2 * kt2][0], s[2 * kt2][1], l[0]);
          const unsigned p1 = att_pack(s[2 * kt2][2], s[2 * kt2][3], l[1]);
          const unsigned p2 = att_pack(s[2 * kt2 + 1][0], s[2 * kt2 + 1][1], l[0]);
          const unsigned p3 = att_pack(s[2 * kt2 + 1][2], s[2 * kt2 + 1][3], l[1]);
#pragma unroll
          for (int d2 = 0; d2 < NT / 2; ++d2) {  // head-dim n-tiles 2 d2, 2 d2 + 1: (k half, n-tile) per matrix
            unsigned vb[4];
            fa2_ldsm4_t(vb, vs_ + (kt2 * 16 + (mi & 1) * 8 + mr) * LD + d2 * 16 + (mi >> 1) * 8);
            lin_mma(o[2 * d2], p0, p1, p2, p3, vb[0], vb[1]);
            lin_mma(o[2 * d2 + 1], p0, p1, p2, p3, vb[2], vb[3]);
          }
        }
      }
      __syncthreads();  // the buffer is reloaded two tiles on
    }
    if (pass == 0) {  // a real row without a visible key, where skipped keys may hold finite fills: pass 2
      bool lost = false;
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        bool sn = seen[hr];
        sn |= __shfl_xor_sync(0xffffffffu, sn, 1);
        sn |= __shfl_xor_sync(0xffffffffu, sn, 2);
        lost |= !sn && wrow + g + 8 * hr < Sq;
      }
      redo = finite_form && __any_sync(0xffffffffu, lost);
      if (redo) continue;
    } else if (!redo) {
      continue;
    }
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      float lt = l[hr];
      lt += __shfl_xor_sync(0xffffffffu, lt, 1);
      lt += __shfl_xor_sync(0xffffffffu, lt, 2);
      const float inv = lt > 0.f ? 1.f / lt : 0.f;  // no visible key and -inf fills: 0, as the reference
      const long long i = wrow + g + 8 * hr;
      if (i >= Sq) continue;
      __half* yp = a.y.p + b * a.y.stride[0] + h * a.y.stride[1] + i * a.y.stride[2];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) store(yp + (nt * 8 + 2 * c + e) * a.y.stride[3], o[nt][2 * hr + e] * inv);
    }
  }
}

// ACC: attention_rows' accumulators per lane (the fallback)
template <typename MT, int D, int NW, int ACC, bool HAS_PAST, bool HAS_MASK, bool CAUSAL, bool KEYS = false>
__device__ __forceinline__ void attention_fa2(const AttnArgs<__half, MT>& a) {
  static_assert(D % 16 == 0 && D >= 16 && D <= 128, "fa2: head dim a multiple of 16 up to 128");
  static_assert(NW >= 1 && NW <= 8, "fa2: 1 to 8 warps");
  const long long B = a.q.shape[0], Hq = a.q.shape[1], Sq = a.q.shape[2];
  const long long Hk = a.k.shape[1];
  const long long P = HAS_PAST ? a.past : 0;
  const long long Skv = P + a.k.shape[2];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  bool ok = Hk > 0 && Hq % Hk == 0 && Skv > 0 && a.q.shape[3] == D && a.k.shape[3] == D && a.v.shape[3] == D &&
            rows_vec_ok(a.k, 8) && rows_vec_ok(a.v, 8) && fa2_q_ok(a.q);
  if constexpr (HAS_PAST) ok = ok && rows_vec_ok(a.pk, 8) && rows_vec_ok(a.pv, 8);
  if (ok) {  // uniform over the launch
    const long long group = Hq / Hk, tiles = (Sq + 16 * NW - 1) / (16 * NW);
    const float scale = a.scale != 0.f ? a.scale : (float)(1.0 / sqrt((double)D));
    __half* smem = reinterpret_cast<__half*>(atlas_attn_smem);
    for (long long item = blockIdx.x; item < B * Hk * tiles * group; item += gridDim.x) {
      const long long gi = item % group, tile = tiles - 1 - (item / group) % tiles;
      const long long hk = (item / (group * tiles)) % Hk, b = item / (group * tiles * Hk);
      attention_fa2_item<MT, D, NW, HAS_PAST, HAS_MASK, CAUSAL, KEYS>(a, smem, b, hk * group + gi, hk,
                                                                       tile * 16 * NW, Sq, P, Skv, scale);
    }
    return;
  }
#endif
  (void)B, (void)Hq, (void)Sq, (void)Hk, (void)Skv;
  attention_rows<__half, MT, ACC, HAS_PAST, HAS_MASK, CAUSAL, 0, -1, KEYS>(a);
}

}  // namespace atlas
