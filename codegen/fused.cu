// FusedElementwise helpers (see fused.py). A fused group computes its steps in registers, one
// thread per output element; where the unfused graph would have stored a float16 tensor between two
// kernels, the step's value is rounded to float16 and back, so the results match the unfused kernels.
namespace atlas {

__device__ __forceinline__ float round_f16(float v) { return __half2float(__float2half_rn(v)); }

}  // namespace atlas
