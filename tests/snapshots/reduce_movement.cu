// ln: LayerNormalization -> ln_out0: float16[b, n], ln_out1: float32[b, 1], ln_out2: float32[b, 1]
extern "C" __global__ void __launch_bounds__(256) snap_0000_LayerNormalization(unsigned char* __restrict__ arena) {
  const long long* __restrict__ dims_buf = reinterpret_cast<const long long*>(arena + 0LL);
  long long d[2] = {};  // the dims it reads, before the wait
  d[0] = dims_buf[0];
  d[1] = dims_buf[1];
  (void)d;
  atlas::pdl_enter();
  atlas::View<__half, 2> x;
  x.p = reinterpret_cast<__half*>(arena + 256LL);
  x.shape[0] = (d[0]);
  x.shape[1] = (d[1]);
  x.stride[1] = 1LL;
  x.stride[0] = x.shape[1] * x.stride[1];
  atlas::View<__half, 2> y;
  y.p = reinterpret_cast<__half*>(arena + 20992LL);
  y.shape[0] = (d[0]);
  y.shape[1] = (d[1]);
  y.stride[1] = 1LL;
  y.stride[0] = y.shape[1] * y.stride[1];
  atlas::View<__half, 1> xk; xk.p = x.p;
  xk.shape[0] = x.shape[0]; xk.stride[0] = x.stride[0];
  atlas::View<__half, 1> xr; xr.p = x.p;
  xr.shape[0] = x.shape[1]; xr.stride[0] = x.stride[1];
  atlas::View<__half, 1> yk; yk.p = y.p;
  yk.shape[0] = y.shape[0]; yk.stride[0] = y.stride[0];
  atlas::View<__half, 1> yr; yr.p = y.p;
  yr.shape[0] = y.shape[1]; yr.stride[0] = y.stride[1];
  atlas::View<__half, 1> scale_src;
  scale_src.p = reinterpret_cast<__half*>(arena + 16640LL);
  scale_src.shape[0] = (d[1]);
  scale_src.stride[0] = 1LL;
  atlas::View<__half, 1> scale; scale.p = reinterpret_cast<__half*>(arena + 16640LL);
  scale.shape[0] = x.shape[1]; scale.stride[0] = scale_src.stride[0];
  atlas::View<__half, 1> bias_src;
  bias_src.p = reinterpret_cast<__half*>(arena + 18688LL);
  bias_src.shape[0] = (d[1]);
  bias_src.stride[0] = 1LL;
  atlas::View<__half, 1> bias; bias.p = reinterpret_cast<__half*>(arena + 18688LL);
  bias.shape[0] = x.shape[1]; bias.stride[0] = bias_src.stride[0];
  atlas::View<float, 2> mean_all;
  mean_all.p = reinterpret_cast<float*>(arena + 37376LL);
  mean_all.shape[0] = (d[0]);
  mean_all.shape[1] = 1LL;
  mean_all.stride[1] = 1LL;
  mean_all.stride[0] = mean_all.shape[1] * mean_all.stride[1];
  atlas::View<float, 1> mean_k; mean_k.p = mean_all.p;
  mean_k.shape[0] = mean_all.shape[0]; mean_k.stride[0] = mean_all.stride[0];
  atlas::View<float, 2> inv_all;
  inv_all.p = reinterpret_cast<float*>(arena + 37632LL);
  inv_all.shape[0] = (d[0]);
  inv_all.shape[1] = 1LL;
  inv_all.stride[1] = 1LL;
  inv_all.stride[0] = inv_all.shape[1] * inv_all.stride[1];
  atlas::View<float, 1> inv_k; inv_k.p = inv_all.p;
  inv_k.shape[0] = inv_all.shape[0]; inv_k.stride[0] = inv_all.stride[0];
  if (atlas::rd::norm_vec_rows(xk, xr, 1) && atlas::rd::norm_vec_rows(yk, yr, 1))
    atlas::rd::norm_rows_vec<false, true, true, false, 1, float>(xk, xk, xk, yk, scale, bias, mean_k, inv_k, xr.shape[0], 1e-05f);
  else
    atlas::rd::norm_block<false, true, true, float>(xk, xr, yk, yr, scale, bias, mean_k, inv_k, 1e-05f);
  atlas::pdl_leave();
}

// cat: Concat -> cat_out0: float16[b, n + 16]
extern "C" __global__ void __launch_bounds__(256) snap_0001_Concat(unsigned char* __restrict__ arena) {
  const long long* __restrict__ dims_buf = reinterpret_cast<const long long*>(arena + 0LL);
  long long d[2] = {};  // the dims it reads, before the wait
  d[0] = dims_buf[0];
  d[1] = dims_buf[1];
  (void)d;
  atlas::pdl_enter();
  atlas::View<__half, 2> y;
  y.p = reinterpret_cast<__half*>(arena + 37888LL);
  y.shape[0] = (d[0]);
  y.shape[1] = (16LL + d[1]);
  y.stride[1] = 1LL;
  y.stride[0] = y.shape[1] * y.stride[1];
  atlas::View<__half, 2> in0;
  in0.p = reinterpret_cast<__half*>(arena + 256LL);
  in0.shape[0] = (d[0]);
  in0.shape[1] = (d[1]);
  in0.stride[1] = 1LL;
  in0.stride[0] = in0.shape[1] * in0.stride[1];
  atlas::View<__half, 2> in1;
  in1.p = reinterpret_cast<__half*>(arena + 20736LL);
  in1.shape[0] = (d[0]);
  in1.shape[1] = 16LL;
  in1.stride[1] = 1LL;
  in1.stride[0] = in1.shape[1] * in1.stride[1];
  long long shift = 0;
  { atlas::View<__half, 2> dst = y; dst.p += shift * y.stride[1];
    dst.shape[1] = in0.shape[1]; atlas::mv::copy(dst, in0);
    shift += in0.shape[1]; }
  { atlas::View<__half, 2> dst = y; dst.p += shift * y.stride[1];
    dst.shape[1] = in1.shape[1]; atlas::mv::copy(dst, in1);
    shift += in1.shape[1]; }
  atlas::pdl_leave();
}
