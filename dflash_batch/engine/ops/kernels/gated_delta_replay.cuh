// grid (Dk, Dv, B*Hv), block (32, 4, 1): one thread per state element.
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int dv = blockIdx.y * blockDim.y + threadIdx.y;
    const int n = blockIdx.z;
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    const int steps = k_shape[1];
    const int64_t at = ((int64_t)n * Dv + dv) * Dk + c;
    float s = static_cast<float>(state_in[at]);
    for (int t = 0; t < steps; ++t) {
      const int64_t vh = (int64_t)(b * steps + t) * Hv + hv;
      s = s * static_cast<float>(g[vh]);
      s = fmaf(static_cast<float>(k[((int64_t)(b * steps + t) * Hk + hk) * Dk + c]), tape[vh * Dv + dv], s);
      s = static_cast<float>(static_cast<StT>(s));
    }
    state_out[at] = static_cast<StT>(s);
