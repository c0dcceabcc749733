

// matmul1: MatMul -> matmul1_out0: float16[m, 48]
extern "C" __global__ void __launch_bounds__(256) snap_0000_MatMul(unsigned char* __restrict__ arena) {
  const long long* __restrict__ dims_buf = reinterpret_cast<const long long*>(arena + 0LL);
  long long d[1] = {};  // the dims it reads, before the wait
  d[0] = dims_buf[0];
  (void)d;
  atlas::pdl_enter();
  atlas::View<__half, 2> a_src;
  a_src.p = reinterpret_cast<__half*>(arena + 4352LL);
  a_src.shape[0] = (d[0]);
  a_src.shape[1] = 32LL;
  a_src.stride[1] = 1LL;
  a_src.stride[0] = a_src.shape[1] * a_src.stride[1];
  atlas::View<__half, 2> b_src;
  b_src.p = reinterpret_cast<__half*>(arena + 8448LL);
  b_src.shape[0] = 32LL;
  b_src.shape[1] = 48LL;
  b_src.stride[1] = 1LL;
  b_src.stride[0] = b_src.shape[1] * b_src.stride[1];
  atlas::View<__half, 2> c_src;
  c_src.p = reinterpret_cast<__half*>(arena + 12032LL);
  c_src.shape[0] = (d[0]);
  c_src.shape[1] = 48LL;
  c_src.stride[1] = 1LL;
  c_src.stride[0] = c_src.shape[1] * c_src.stride[1];
  atlas::View<__half, 2> A;
  A.p = a_src.p;
  A.shape[0] = a_src.shape[0]; A.stride[0] = a_src.stride[0];
  A.shape[1] = a_src.shape[1]; A.stride[1] = a_src.stride[1];
  atlas::View<__half, 2> B;
  B.p = b_src.p;
  B.shape[0] = b_src.shape[0]; B.stride[0] = b_src.stride[0];
  B.shape[1] = b_src.shape[1]; B.stride[1] = b_src.stride[1];
  atlas::View<__half, 2> C;
  C.p = c_src.p;
  C.shape[0] = c_src.shape[0]; C.stride[0] = c_src.stride[0];
  C.shape[1] = c_src.shape[1]; C.stride[1] = c_src.stride[1];
  atlas::View<__half, 2> bias; bias.p = nullptr;
  atlas::matmul_tiled<__half, 2, false, false>(A, B, C, bias, 1, 1);
  atlas::pdl_leave();
}

// kvappend2: KVAppend -> kvappend2_out0: float16[batch, 2, past_seq + seq, 8]
extern "C" __global__ void __launch_bounds__(256) snap_0001_KVAppend(unsigned char* __restrict__ arena) {
  const long long* __restrict__ dims_buf = reinterpret_cast<const long long*>(arena + 0LL);
  long long d[4] = {};  // the dims it reads, before the wait
  d[1] = dims_buf[1];
  d[2] = dims_buf[2];
  d[3] = dims_buf[3];
  (void)d;
  atlas::pdl_enter();
  atlas::View<__half, 4> x;
  x.p = reinterpret_cast<__half*>(arena + 11520LL);
  x.shape[0] = (d[3]);
  x.shape[1] = 2LL;
  x.shape[2] = (d[2]);
  x.shape[3] = 8LL;
  x.stride[3] = 1LL;
  x.stride[2] = x.shape[3] * x.stride[3];
  x.stride[1] = x.shape[2] * x.stride[2];
  x.stride[0] = x.shape[1] * x.stride[1];
  atlas::View<__half, 4> present;
  present.p = reinterpret_cast<__half*>(arena + 3328LL);
  present.shape[0] = (d[3]);
  present.shape[1] = 2LL;
  present.shape[2] = (d[1] + d[2]);
  present.shape[3] = 8LL;
  present.stride[3] = 1LL;
  present.stride[2] = 8LL;
  present.stride[1] = 128LL;
  present.stride[0] = 256LL;
  atlas::kv_append<__half>(x, present, (d[1]), 2LL, 16LL);
  atlas::pdl_leave();
}
