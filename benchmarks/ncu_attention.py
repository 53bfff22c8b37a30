"""Kernels for Nsight Compute: the attention op at the Qwen3-4B shape, 2048 keys, two calls each.

    MLX_USE_CUDA_GRAPHS=0 ncu --target-processes all -k regex:dflash --section SpeedOfLight \
        --section Occupancy --section LaunchStats --csv --page details \
        python3 benchmarks/ncu_attention.py > ncu.csv
    python3 benchmarks/ncu_summary.py ncu.csv

(docs/results/ncu-h200-run*.txt hold the summaries of the H200 runs.)
"""

import argparse

import dflash_batch.engine  # noqa: F401  (preloads a fast BLAS before mlx on Linux CPU)
from dflash_batch.engine.ops.kernels import attention as ka

import mlx.core as mx

H, Hk, D, Lq, L = 32, 8, 128, 16, 2048


def main(argv=None) -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args(argv)
    mx.random.seed(0)
    q = mx.random.normal((1, H, Lq, D)).astype(mx.bfloat16)
    kb = mx.random.normal((1, Hk, L + 64, D)).astype(mx.bfloat16)
    vb = mx.random.normal((1, Hk, L + 64, D)).astype(mx.bfloat16)
    mx.eval(q, kb, vb)
    runs = [
        ("cuda_cores", dict(config=ka.kernel_config("cuda", D))),
        ("mma_default_auto_splits", {}),
        ("mma_nw8_kt16_st2_fused_s4", dict(config=ka.mma_config(D, 8, True, 16, 2), splits=4)),
        ("mma_nw4_kt16_st3_fused_s2", dict(config=ka.mma_config(D, 4, True, 16, 3), splits=2)),
    ]
    for name, kw in runs:
        for i in range(2):
            keys, values = kb[:, :, : L + i], vb[:, :, : L + i]
            out = ka.block_attention_kernel(q, keys, values, scale=D**-0.5, causal=True, **kw)
            mx.eval(out)
            mx.synchronize()
        print("ran", name, flush=True)


if __name__ == "__main__":
    main()
