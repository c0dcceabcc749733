// Tiled tensor-core GEMM for the prefill Linear (see gemm.py; chosen with ATLAS_LINEAR_PREFILL=tc, the
// M > 32 branch of linear.py's kernel): y[M, N] = x[M, K] @ w[N, K]^T (+ bias[N]). Uses View /
// lin_row_offset / lin_mma and the cp.async helpers lin_cp16, lin_cp_commit, lin_cp_wait, lin_smem (linear.cu), and
// the ldmatrix helper fa2_ldsm4 (flash_attention.cu).
//
// Layout: w is a contiguous [N, K] constant; x and y are Views whose leading dims flatten to M rows (any
// strides: row offsets computed once per tile into shared memory xoff / yoff, 128 entries each). float16
// only; requires (the caller checks lin_mma_ok at run time, else the launch takes another path) K % 32 ==
// 0, 16-byte aligned x rows with unit stride along K, a 16-byte aligned w, sm80+. x rows m >= M are read
// as row M - 1 and w rows n >= N as row N - 1; neither is stored (edge tiles need no zero fill).
//
// Work: a block of 8 warps per output tile of GEMM_BM = 128 rows x GEMM_BN = 128 features (blocks loop
// grid-stride over the tiles, row tiles fastest: the blocks of a wave share w tiles, and x, read once per
// feature tile, stays in L2 at prefill sizes). K advances in tiles of GEMM_BK = 32: the x tile [128][32]
// and the w tile [128][32] are copied to shared memory by cp.async (16 bytes per thread and row chunk,
// L1 bypassed) in GEMM_STAGES = 3 stages (tiles kt + 1 and kt + 2 in flight while kt is computed; one
// barrier per k tile). Shared rows are padded to GEMM_LD = 40 halves (80 bytes): the 8 row addresses of
// an ldmatrix phase then fall in 8 distinct 16-byte bank groups (row r at word 20 r mod 32), so the
// fragment loads are conflict-free; so are the 16-byte cp.async writes.
// Warp w computes the 64 x 32 sub-tile at rows 64 (w % 2), features 32 (w / 2): per k16 step 4 A
// fragments (x rows: the mma A operand, row-major [M x K]; ldmatrix.x4 of a 16 x 16 block) and 4 B
// fragments (w rows: w[n, k] row-major is B^T, i.e. B in the "col" layout, so ldmatrix without .trans;
// one x4 covers two 8-feature tiles), then 16 mma.sync m16n8k16 (fp16 in, fp32 accumulate) into 64 fp32
// accumulators per lane.
// Numerics: float32 accumulation (in k-tile order, a different order than the other paths), the bias
// added in float32, one rounding to fp16 at the store: the numerics of linear.cu's paths.
namespace atlas {

constexpr int GEMM_BM = 128;     // rows of x per tile (gemm.py GEMM_BM)
constexpr int GEMM_BN = 128;     // output features per tile (gemm.py GEMM_BN)
constexpr int GEMM_BK = 32;      // k per stage
constexpr int GEMM_STAGES = 3;   // cp.async pipeline depth (gemm.py GEMM_STAGES)
constexpr int GEMM_LD = GEMM_BK + 8;  // halves per shared row: the 16-byte pad (see the header)
constexpr int GEMM_TILE = GEMM_BM * GEMM_LD;  // halves of one operand tile (GEMM_BM == GEMM_BN)
static_assert(GEMM_BM == GEMM_BN, "one loader shape for both operands");

// dynamic shared memory: GEMM_STAGES x (x tile, w tile), 61440 bytes (gemm.py gemm_smem)
extern __shared__ __align__(128) unsigned char atlas_gemm_smem[];

template <typename T, int R, bool HAS_BIAS>
__device__ __forceinline__ void linear_gemm_tc(const View<T, R>& x, const T* __restrict__ w,
                                               const T* __restrict__ bias, long long bias_stride,
                                               const View<T, R>& y, long long M, long long N, long long K,
                                               long long* xoff, long long* yoff) {
  static_assert(LinVec<T>::MMA, "linear_gemm_tc takes float16 only");
  T* sm = reinterpret_cast<T*>(atlas_gemm_smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, c = lane & 3;
  const int wm = (warp & 1) * 64, wn = (warp >> 1) * 32;
  const long long tiles_m = (M + GEMM_BM - 1) / GEMM_BM, tiles_n = (N + GEMM_BN - 1) / GEMM_BN;
  const int kts = int(K / GEMM_BK);
  const long long yn = y.stride[R - 1];
  // loader: thread t copies 16-byte chunk t % 4 of rows t / 4 and t / 4 + 64 of both tiles
  const int lrow = tid >> 2, lcol = (tid & 3) * 8;
  const unsigned s_base = lin_smem(sm) + unsigned((lrow * GEMM_LD + lcol) * sizeof(T));
  constexpr unsigned HALF = 64 * GEMM_LD * sizeof(T), TILE_B = GEMM_TILE * sizeof(T);
  // fragment rows inside a stage: A (x) row wm + 16 i + lane % 16 at k (lane / 16) * 8; B (w) row
  // wn + 16 j + lane % 8 + 8 (lane / 16) at k ((lane / 8) % 2) * 8 (matrices: n 0-7 k 0-7, n 0-7 k 8-15,
  // n 8-15 k 0-7, n 8-15 k 8-15 = b0 / b1 of two 8-feature tiles)
  const int a_off = (wm + (lane & 15)) * GEMM_LD + (lane >> 4) * 8;
  const int b_off = GEMM_TILE + (wn + (lane & 7) + ((lane >> 4) << 3)) * GEMM_LD + ((lane >> 3) & 1) * 8;
  for (long long tile = blockIdx.x; tile < tiles_m * tiles_n; tile += gridDim.x) {
    const long long m0 = (tile % tiles_m) * GEMM_BM, n0 = (tile / tiles_m) * GEMM_BN;
    __syncthreads();  // the previous tile's readers of the stages and of xoff / yoff are done
    if (tid < GEMM_BM) {
      const long long m = imin(m0 + tid, M - 1);
      xoff[tid] = lin_row_offset(x, m);
      yoff[tid] = lin_row_offset(y, m);
    }
    __syncthreads();
    const T* gx0 = x.p + xoff[lrow] + lcol;
    const T* gx1 = x.p + xoff[lrow + 64] + lcol;
    const T* gw0 = w + imin(n0 + lrow, N - 1) * K + lcol;
    const T* gw1 = w + imin(n0 + lrow + 64, N - 1) * K + lcol;
    auto stage_in = [&](int kt, int stage) {  // k tile kt into stage `stage`: 4 x 16 bytes per thread
      const unsigned s = s_base + unsigned(stage) * 2 * TILE_B;
      const long long k0 = (long long)kt * GEMM_BK;
      lin_cp16(s, gx0 + k0, true);
      lin_cp16(s + HALF, gx1 + k0, true);
      lin_cp16(s + TILE_B, gw0 + k0, true);
      lin_cp16(s + TILE_B + HALF, gw1 + k0, true);
    };
#pragma unroll
    for (int s = 0; s < GEMM_STAGES - 1; ++s) {
      if (s < kts) stage_in(s, s);
      lin_cp_commit();  // one group per stage, empty or not: wait_group counts stay aligned
    }
    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.f;
    int stage = 0, next = GEMM_STAGES - 1;
    for (int kt = 0; kt < kts; ++kt) {
      lin_cp_wait<1>();   // GEMM_STAGES - 2 = 1 group may stay in flight: k tile kt has landed (this thread's)
      __syncthreads();  // ... every thread's; and every warp is done with the stage refilled next
      if (kt + GEMM_STAGES - 1 < kts) stage_in(kt + GEMM_STAGES - 1, next);
      lin_cp_commit();
      const T* st = sm + stage * 2 * GEMM_TILE;
#pragma unroll
      for (int ks = 0; ks < GEMM_BK; ks += 16) {
        unsigned bf[4][2];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          unsigned r[4];
          fa2_ldsm4(r, st + b_off + 16 * j * GEMM_LD + ks);
          bf[2 * j][0] = r[0];
          bf[2 * j][1] = r[1];
          bf[2 * j + 1][0] = r[2];
          bf[2 * j + 1][1] = r[3];
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // one A fragment live at a time (register pressure: no spills at sm90)
          unsigned af[4];
          fa2_ldsm4(af, st + a_off + 16 * i * GEMM_LD + ks);
#pragma unroll
          for (int j = 0; j < 4; ++j) lin_mma(acc[i][j], af[0], af[1], af[2], af[3], bf[j][0], bf[j][1]);
        }
      }
      stage = stage == GEMM_STAGES - 1 ? 0 : stage + 1;
      next = next == GEMM_STAGES - 1 ? 0 : next + 1;
    }
    // C fragment (i, j): rows wm + 16 i + g (q 0, 1) and + 8 (q 2, 3), features wn + 8 j + 2c (+ 1 for q odd)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const long long n = n0 + wn + 8 * j + 2 * c;
      float b0 = 0.f, b1 = 0.f;
      if constexpr (HAS_BIAS) {
        if (n < N) b0 = float(load(bias + n * bias_stride));
        if (n + 1 < N) b1 = float(load(bias + (n + 1) * bias_stride));
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wm + 16 * i + g + 8 * h;
          if (m0 + row >= M) continue;
          T* yr = y.p + yoff[row];
          if (n < N) store(yr + n * yn, acc[i][j][2 * h] + b0);
          if (n + 1 < N) store(yr + (n + 1) * yn, acc[i][j][2 * h + 1] + b1);
        }
    }
  }
}

}  // namespace atlas
