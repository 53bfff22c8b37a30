"""Registers, spills and shared memory of the CUDA kernels, as ptxas reports them (GPU machine).

    python benchmarks/cuda_resources.py

MLX prints the source it hands NVRTC when a kernel is called with ``verbose=True``; this script
captures it for each kernel at the Qwen3-4B shape (bf16, head dim 128) and for head dims 64 and
256, and compiles it with nvcc for sm_90a, the target MLX's JIT uses on an H100/H200.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import dflash_batch.engine  # noqa: F401  (preloads a fast BLAS before mlx on Linux CPU)
from dflash_batch.engine.ops.kernels import attention as ka

import mlx.core as mx


def captured_source(call) -> str:
    """Run ``call`` with fd 1 sent to a file; return the code block MLX printed."""
    with tempfile.TemporaryFile(mode="w+") as f:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            call()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read()
    return re.search(r"```\n(.*?)```", text, re.S).group(1)


def main():
    # MLX hands NVRTC its device headers from memory; for nvcc, a stub declares what the kernels use
    stub = (
        "#pragma once\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cuda/std/array>\n"
        "namespace mlx::core::cu {\nusing Shape = cuda::std::array<int32_t, 10>;\n"
        "using Strides = cuda::std::array<int64_t, 10>;\n}\n"
    )
    for D in (64, 128, 256):
        for dtype in (mx.bfloat16, mx.float32):
            q = mx.zeros((1, 32, 16, D), dtype=dtype)
            k = mx.zeros((1, 8, 2048, D), dtype=dtype)
            plan = ka._plan("cuda", q, 8, D**-0.5, True, None, None)
            splits = 4
            parts = [(1, 32, 16, splits, D), (1, 32, 16, splits), (1, 32, 16, splits)]
            n_out = 4 if plan.mma or plan.pass2 is None else 3

            def call():
                o = plan.pass1(
                    inputs=[
                        q,
                        k,
                        k,
                        plan.zeros,
                        plan.zeros,
                        plan.flags,
                        plan.qscale,
                        plan.counters,
                    ],  # kv_start, kv_len
                    output_shapes=(parts + [q.shape])[:n_out],
                    output_dtypes=([mx.float32] * 3 + [dtype])[:n_out],
                    grid=(splits * plan.threads, 8, plan.grid_yz[1]),
                    threadgroup=(plan.threads, 1, 1),
                    template=plan.template1,
                    verbose=True,
                )
                mx.eval(o)

            src = captured_source(call)
            with tempfile.TemporaryDirectory() as tmp:
                os.makedirs(os.path.join(tmp, "mlx/backend/cuda/device"))
                with open(os.path.join(tmp, "mlx/backend/cuda/device/utils.cuh"), "w") as f:
                    f.write(stub)
                path = os.path.join(tmp, "k.cu")
                with open(path, "w") as f:
                    f.write(src)
                cmd = [
                    "nvcc",
                    "-arch=sm_90a",
                    "-std=c++17",
                    "--resource-usage",
                    "-c",
                    path,
                    "-o",
                    os.path.join(tmp, "k.o"),
                    f"-I{tmp}",
                ]
                done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [
                ln
                for ln in (done.stdout + done.stderr).splitlines()
                if "registers" in ln.lower() or "spill" in ln or "error" in ln
            ]
            print(
                f"D={D} {dtype} {'mma' if plan.mma else 'cuda-core'}:",
                *lines[-6:],
                sep="\n  ",
                flush=True,
            )


if __name__ == "__main__":
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    main()
