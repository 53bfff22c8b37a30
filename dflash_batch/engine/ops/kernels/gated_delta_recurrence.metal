// Metal: grid (32, Dv, B*Hv), threadgroup (32, 4, 1). One simdgroup per state row (b, hv, dv);
// lane l owns columns [l * Dk/32, (l+1) * Dk/32).
    const int n = thread_position_in_grid.z;
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    const int lane = thread_position_in_threadgroup.x;
    const int dv = thread_position_in_grid.y;
    constexpr int per_lane = Dk / 32;
    const int steps = T;

    const int64_t row = (int64_t(n) * Dv + dv) * Dk + lane * per_lane;
    float s[per_lane];
    for (int i = 0; i < per_lane; ++i) {
      s[i] = static_cast<float>(state_in[row + i]);
    }
    for (int t = 0; t < steps; ++t) {
      const int64_t kq = (int64_t(b * steps + t) * Hk + hk) * Dk + lane * per_lane;
      const int64_t vh = int64_t(b * steps + t) * Hv + hv;
      const float gt = static_cast<float>(g[vh]);
      float kv = 0.0f;
      for (int i = 0; i < per_lane; ++i) {
        s[i] = s[i] * gt;
        kv += s[i] * static_cast<float>(k[kq + i]);
      }
      kv = simd_sum(kv);
      const float delta = (static_cast<float>(v[vh * Dv + dv]) - kv) * static_cast<float>(beta[vh]);
      float out = 0.0f;
      for (int i = 0; i < per_lane; ++i) {
        s[i] = fma(static_cast<float>(k[kq + i]), delta, s[i]);
        out += s[i] * static_cast<float>(q[kq + i]);
        s[i] = static_cast<float>(static_cast<StT>(s[i]));
      }
      out = simd_sum(out);
      if (lane == 0) {
        y[vh * Dv + dv] = static_cast<InT>(out);
        if (Record) {
          tape[vh * Dv + dv] = delta;
        }
      }
    }
    for (int i = 0; i < per_lane; ++i) {
      state_out[row + i] = static_cast<StT>(s[i]);
    }
