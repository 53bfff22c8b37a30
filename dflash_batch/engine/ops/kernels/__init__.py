"""Custom kernels (Metal via mx.fast.metal_kernel, CUDA via mx.fast.cuda_kernel), each with a
pure-MLX reference that runs on every backend and serves as the test oracle."""
