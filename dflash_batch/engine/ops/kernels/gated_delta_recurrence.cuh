// CUDA: grid (32, Dv, B*Hv), block (32, 4, 1). One warp per state row (b, hv, dv); lane l owns
// columns l, l + 32, ... (coalesced loads). Same operation order as the Metal kernel.
    const int n = blockIdx.z;
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    const int lane = threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    constexpr int per_lane = Dk / 32;
    const int steps = k_shape[1];

    const int64_t row = ((int64_t)n * Dv + dv) * Dk + lane;
    float s[per_lane];
    #pragma unroll
    for (int i = 0; i < per_lane; ++i) {
      s[i] = static_cast<float>(state_in[row + 32 * i]);
    }
    for (int t = 0; t < steps; ++t) {
      const int64_t kq = ((int64_t)(b * steps + t) * Hk + hk) * Dk + lane;
      const int64_t vh = (int64_t)(b * steps + t) * Hv + hv;
      const float gt = static_cast<float>(g[vh]);
      float kc[per_lane];
      float kv = 0.0f;
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        kc[i] = static_cast<float>(k[kq + 32 * i]);
        s[i] = s[i] * gt;
        kv += s[i] * kc[i];
      }
      #pragma unroll
      for (int m = 16; m > 0; m >>= 1) {
        kv += __shfl_xor_sync(0xffffffffu, kv, m);
      }
      const float delta = (static_cast<float>(v[vh * Dv + dv]) - kv) * static_cast<float>(beta[vh]);
      float out = 0.0f;
      #pragma unroll
      for (int i = 0; i < per_lane; ++i) {
        s[i] = fmaf(kc[i], delta, s[i]);
        out += s[i] * static_cast<float>(q[kq + 32 * i]);
        s[i] = static_cast<float>(static_cast<StT>(s[i]));
      }
      #pragma unroll
      for (int m = 16; m > 0; m >>= 1) {
        out += __shfl_xor_sync(0xffffffffu, out, m);
      }
      if (lane == 0) {
        y[vh * Dv + dv] = static_cast<InT>(out);
        if (Record) {
          tape[vh * Dv + dv] = delta;
        }
      }
    }
    #pragma unroll
    for (int i = 0; i < per_lane; ++i) {
      state_out[row + 32 * i] = static_cast<StT>(s[i]);
    }
