// Elementwise helpers (see elementwise.py). numpy semantics: max/min propagate NaN; integer `%`
// takes the divisor's sign (Python / numpy `mod`), float `mod` likewise.
namespace atlas {

template <typename T> __device__ __forceinline__ T vmax(T a, T b) { return (a > b || a != a) ? a : b; }
template <typename T> __device__ __forceinline__ T vmin(T a, T b) { return (a < b || a != a) ? a : b; }
template <typename T> __device__ __forceinline__ T vadd(T a, T b) { return a + b; }

template <typename T> __device__ __forceinline__ T pymod(T a, T b) {
  T r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? r + b : r;
}
template <> __device__ __forceinline__ float pymod<float>(float a, float b) {
  float r = fmodf(a, b);
  return (r != 0.f && ((r < 0.f) != (b < 0.f))) ? r + b : r;
}
template <> __device__ __forceinline__ double pymod<double>(double a, double b) {
  double r = fmod(a, b);
  return (r != 0.0 && ((r < 0.0) != (b < 0.0))) ? r + b : r;
}

}  // namespace atlas
