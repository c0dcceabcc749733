// The kernel labs' floors (examples/lab_floor.py): what a kernel that only streams n bytes, or does
// nothing, costs in the labs' timing harness (a captured graph of launches rotating among arenas).
// Arena layout: n (long long) at offset 0, the bytes to read from offset 256, one int of output after them.
#include <cuda_runtime.h>

// every thread reads 16-byte pieces, 4 in flight, grid-stride; the xor of them is stored only when it
// equals an arbitrary constant (so the compiler keeps the loads; on zeroed data nothing is written)
extern "C" __global__ void __launch_bounds__(256) lab_read(unsigned char* arena) {
  const long long n = *reinterpret_cast<const long long*>(arena) / 16;
  const uint4* p = reinterpret_cast<const uint4*>(arena + 256);
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  unsigned acc = 0;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x9e3779b9u && threadIdx.x == 0) reinterpret_cast<unsigned*>(arena + 256 + n * 16)[0] = acc;
}

extern "C" __global__ void lab_empty(unsigned char*) {}
