"""Matmuls of a few rows, as a verify pass at batch 1 runs them: ``python -m benchmarks.small_matmul``.

``x [M, K] @ W[N, K].T`` (what ``nn.Linear`` computes) for M = 1..16 rows at the default pair's
shapes (K = 576; N = 192, 576, 1536 and the LM head's 49152), fp32, each timed as a chain of
``--chain`` independent products evaluated together (per product: the chain's time / chain, the
fastest of ``--reps``), so that one sync does not dominate; ``*_build_us``: of that, the host's
time to build the product's graph (Python and MLX's op construction). The ways:

    matmul   ``x @ W.T``: MLX's own path (on CUDA: its gemv kernel for one row, cuBLAS above)
    gemv     the M rows as M products of one row each in one batched call: ``x`` viewed as
             [M, 1, K] with a batch stride MLX does not fold back into the rows, so that each
             batch stays a one-row product (MLX's CUDA gemv takes a batch)
    kernel   the few-row kernel (``dflash_batch.engine.ops.kernels.matmul``; CUDA only)

``max_abs_diff``: from the product computed on the CPU in fp32 (MLX's CUDA matmul of two or more
rows rounds fp32 through TF32).

The verify pass of the default pair has 211 of these per pass; at batch 1 its T >= 2 passes cost
two to three times its T = 1 pass with the same number of operations (``benchmarks/verify_ops``).

What it measured, with the commands: ``docs/results/small-matmul.md``.
"""

from __future__ import annotations

import argparse
import sys

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from dflash_batch.engine.ops.kernels import attention as block
from dflash_batch.engine.ops.kernels import matmul as few_row

import mlx.core as mx

from . import verify_ops
from .default_pair import command_line, write_result


def one_row_batches(x: mx.array) -> mx.array:
    """``x [M, K]`` as ``[M, 1, K]`` with batch stride 2K (a view of every other row of a [M, 2, K]
    buffer): a matmul over it stays M one-row products."""
    M, K = x.shape
    return mx.concatenate([x[:, None, :], mx.zeros((M, 1, K), x.dtype)], axis=1)[:, :1, :]


def ways(w: mx.array):
    wt = w.T
    found = {
        "matmul": lambda x: x @ wt,
        "gemv": lambda x: (one_row_batches(x) @ wt).reshape(x.shape[0], -1),
    }
    if block.gpu_backend() == "cuda":
        found["kernel"] = lambda x: few_row.matmul_kernel(x, w)
    return found


def timed(fn, xs, reps: int) -> tuple:
    """(seconds per product, of them building the graph on the host): the fastest of ``reps``
    evaluations of the whole chain (``verify_ops.timed``)."""
    total, build = verify_ops.timed(lambda: [fn(x) for x in xs], reps)
    return total / len(xs), build / len(xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--outputs", default="192,576,1536,49152")
    ap.add_argument("--inputs", type=int, default=576)
    ap.add_argument("--chain", type=int, default=30)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    mx.random.seed(0)
    rows = []
    for N in (int(n) for n in args.outputs.split(",")):
        w = mx.random.normal((N, args.inputs)) / args.inputs**0.5
        for M in (int(m) for m in args.rows.split(",")):
            xs = [mx.random.normal((M, args.inputs)) for _ in range(args.chain)]
            row = {"N": N, "K": args.inputs, "M": M}
            with mx.stream(mx.cpu):
                ref = xs[0] @ w.T
            for name, fn in ways(w).items():
                total, build = timed(fn, xs, args.reps)
                row[name + "_us"], row[name + "_build_us"] = (
                    round(total * 1e6, 2),
                    round(build * 1e6, 2),
                )
                row[name + "_max_abs_diff"] = float(mx.abs(fn(xs[0]) - ref).max())
            rows.append(row)
            print(row, file=sys.stderr)
    write_result(
        {
            "command": command_line("small_matmul", argv),
            "device": str(mx.default_device()),
            "mlx": mx.__version__,
            "products": rows,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
