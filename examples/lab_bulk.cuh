// Shared by the copy-engine labs (examples/w4_bulk_lab.cu, examples/chain_lab.cu; their .py prepends this file to
// the lab's source): shared-memory addresses, mbarriers, the global timer, the float16 MMA and the int4 / int8
// dequantization of quant.cu's layouts, in registers.
#include <cuda_fp16.h>
#include <stdint.h>

namespace {

__device__ __forceinline__ unsigned smem_u32(const void* p) { return unsigned(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void bar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

// waits for the phase of parity to complete; traps (a launch error) after 2 s instead of hanging the device call
__device__ __forceinline__ void bar_wait(uint64_t* bar, unsigned parity) {
  unsigned long long t0 = 0;
  for (unsigned tries = 0;; ++tries) {
    unsigned done;
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (done) return;
    if ((tries & 1023u) == 0u) {
      if (t0 == 0) t0 = now_ns();
      else if (now_ns() - t0 > 2000000000ull) __trap();
    }
  }
}

__device__ __forceinline__ void bar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// bytes (a multiple of 16) at src (16-byte aligned) into dst, completing on bar: the copy engine's 1-D bulk copy
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}


__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned hsub2(unsigned a, unsigned b) {
  unsigned r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ unsigned hfma2(unsigned a, unsigned b, unsigned c) {
  unsigned r;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
template <unsigned MASK> __device__ __forceinline__ unsigned nibbles(unsigned a) {
  unsigned r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "r"(0x64006400u));  // (a & b) | c
  return r;
}
// 8 int4 (k 0..7 of a word) -> half2 (k0, k4), (k1, k5), (k2, k6), (k3, k7) of nibble - 8, exact (quant.cu)
__device__ __forceinline__ void q4_pairs(unsigned u, unsigned (&p)[4]) {
  const unsigned v = u >> 8;
  p[0] = hsub2(nibbles<0x000F000Fu>(u), 0x64086408u);
  p[1] = hfma2(nibbles<0x00F000F0u>(u), 0x2C002C00u, 0xD480D480u);
  p[2] = hsub2(nibbles<0x000F000Fu>(v), 0x64086408u);
  p[3] = hfma2(nibbles<0x00F000F0u>(v), 0x2C002C00u, 0xD480D480u);
}
__device__ __forceinline__ unsigned lo2(unsigned a, unsigned b) { return __byte_perm(a, b, 0x5410); }
__device__ __forceinline__ unsigned hi2(unsigned a, unsigned b) { return __byte_perm(a, b, 0x7632); }
__device__ __forceinline__ unsigned hmul2(unsigned a, unsigned b) {
  unsigned r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// the two halves of a half2 (as its bits), added in float32
__device__ __forceinline__ float half2_sum(unsigned u) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(u & 0xFFFFu))) +
         __half2float(__ushort_as_half(static_cast<unsigned short>(u >> 16)));
}
__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }
// 4 int8 of one row (k 0..3 of a word) -> half2 q pairs (k0, k2), (k1, k3), exact: (1024 + q + 128) - 1152 (quant.cu)
__device__ __forceinline__ void q8_pairs(unsigned u, unsigned (&p)[2]) {
  const unsigned v = u ^ 0x80808080u;
  p[0] = hsub2(__byte_perm(v, 0x64646464u, 0x4240), 0x64806480u);
  p[1] = hsub2(__byte_perm(v, 0x64646464u, 0x4341), 0x64806480u);
}

}  // namespace
