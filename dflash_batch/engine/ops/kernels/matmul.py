"""Products of a few rows with a weight matrix: ``y = x @ W.T`` for x [M, K], W [N, K], M of 2..32.

At batch 1 a verify pass runs every linear layer on T = 2..16 rows (the block), and the drafter
on its 16. On MLX's CUDA backend one row goes to a gemv kernel and two or more to cuBLAS (TF32 for
fp32), which at these shapes costs several times a gemv per product: over a verify pass's couple
of hundred products, a cost one-row gemvs would not pay (``benchmarks/small_matmul.py`` measures
it). The product is tiny and bound by reading W once, so one kernel does it as a gemv does, for
every row at once:

    warp w of block b owns columns n = (b * WARPS + w) * COLS + c, c < COLS
    lane l reads W[n, k:k+V] and x[m, k:k+V] for k = l*V, l*V + 32V, ...   (V: 16 bytes of dtype)
        acc[m][c] += sum_e x[m, k+e] * W[n, k+e]          (fp32, every row m < M)
    y[m, n] = sum over the 32 lanes of acc[m][c]          (a butterfly of shuffles; lane m*COLS+c writes)

ROWS (a template: 4, 8, 16 or 32) sizes the accumulators; rows m >= M are not read, and each
row's sums run the same at every ROWS, so every bucket that holds M gives the same bits. Each
template is compiled (NVRTC) once per process and not kept on disk, at seconds on a GPU, which a
job's tail paid mid-job as its rows thinned out; so a product runs the smallest bucket this process
has built that holds it (``launch_rows``), and builds the smallest that holds it only where none
does. A larger bucket costs a product of few rows more where K is large (the figures:
docs/results/tail-compiles-h200-2026-11-28.md).

x's leading axes are its rows (no reshape: each op costs the host a few us per call, and a verify
pass at batch 1 is as much host as device). fp32 stays fp32 throughout (no TF32), bf16 / fp16 are
read as stored and summed in fp32, rounded once. Any K and alignment: 16-byte loads where x, W
and K allow, scalar ones otherwise.

``matmul_reference`` is ``x @ W.T`` in MLX ops (the oracle; the CPU path). ``matmul_kernel`` runs
the CUDA kernel as it is (tests and benchmarks). ``kernel_verified`` checks it once per machine
and dtype against the reference on the CPU (``selfcheck``); ``engine/ops/matmul.py`` routes products
to it. There is no Metal kernel: MLX's Metal matmul has its own few-row path, and nothing here
can run Metal to measure whether one would help. The body is written against a few macros that
the CUDA header (and the tests' CPU emulator, which runs this exact text) define.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx

from . import selfcheck, sources

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
ROW_BUCKETS = (4, 8, 16, 32)  # ROWS template values: a product of M rows runs the smallest >= M
MAX_ROWS = ROW_BUCKETS[-1]
WARPS = 4  # warps per block
COLS = 2  # output columns per warp

# The kernel: matmul_body.inc (one warp's share of y = x @ W.T; the tests' emulator builds the
# same text) under matmul_header.cuh, files beside this one.
BODY = sources.read(Path(__file__).parent, "matmul_body.inc")
CUDA_HEADER = sources.read(Path(__file__).parent, "matmul_header.cuh")
CUDA_BODY, CUDA_HEADER_COMPACT = sources.compact(BODY), sources.compact(CUDA_HEADER)


def matmul_reference(x: mx.array, w: mx.array) -> mx.array:
    """``x @ w.T``: x [..., K], w [N, K] -> [..., N] (MLX ops, any backend)."""
    return x @ w.T


def row_bucket(rows: int) -> int:
    """The ROWS template for a product of ``rows`` rows: the smallest bucket that holds them."""
    for bucket in ROW_BUCKETS:
        if rows <= bucket:
            return bucket
    raise ValueError(f"{rows} rows: the kernel takes at most {MAX_ROWS}")


def unsupported(x: mx.array, w: mx.array) -> Optional[str]:
    """Why the kernel cannot run this product, or None."""
    if w.ndim != 2 or x.ndim < 1 or x.shape[-1] != w.shape[1]:
        return f"x {tuple(x.shape)} and w {tuple(w.shape)}: need x [..., K] and w [N, K]"
    rows = x.size // max(x.shape[-1], 1)
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows: the kernel takes 1 to {MAX_ROWS}"
    if x.dtype not in DTYPES or w.dtype != x.dtype:
        return f"dtypes {x.dtype} and {w.dtype}: need one of {DTYPES}, both the same"
    return None


_kernel_object = None


def launch_rows(dtype, rows: int) -> int:
    """The ROWS template a product of ``rows`` rows runs: the smallest bucket holding them that this
    process has built for ``dtype``, else ``row_bucket(rows)`` (module doc)."""
    built = (
        dict(template)["ROWS"] for (kind, _, _), (_, template) in _launches.items() if kind == dtype
    )
    return min((b for b in built if b >= rows), default=row_bucket(rows))


def _kernel():
    global _kernel_object
    if _kernel_object is None:
        _kernel_object = mx.fast.cuda_kernel(
            name="dflash_few_row_matmul",
            input_names=["x", "w"],
            output_names=["y"],
            source=CUDA_BODY,
            header=CUDA_HEADER_COMPACT,
            ensure_row_contiguous=True,
        )
    return _kernel_object


_launches: Dict[
    tuple, tuple
] = {}  # (dtype, rows, N) -> (grid, template): the host's per-call work, once; the templates built


def matmul_kernel(x: mx.array, w: mx.array) -> mx.array:
    """The CUDA kernel as it is: ``x @ w.T`` for x [..., K] of at most MAX_ROWS rows, w [N, K]."""
    N = w.shape[0]
    key = (x.dtype, x.size // x.shape[-1], N)
    launch = _launches.get(key)
    if launch is None:
        blocks, rows = -(-N // (WARPS * COLS)), launch_rows(x.dtype, key[1])
        launch = _launches[key] = (
            (blocks * WARPS * 32, 1, 1),
            [("T", x.dtype), ("ROWS", rows), ("WARPS", WARPS), ("COLS", COLS)],
        )
    return _kernel()(
        inputs=[x, w],
        output_shapes=[x.shape[:-1] + (N,)],
        output_dtypes=[x.dtype],
        grid=launch[0],
        threadgroup=(WARPS * 32, 1, 1),
        template=launch[1],
    )[0]


# The self-check case: 5 rows (bucket 8) over K = 202 (the scalar path: 202 is no multiple of 4)
# and K = 256 (16-byte loads), N = 37 (the last warp's second column past the end).
CHECK_ROWS, CHECK_N = 5, 37
CHECK_KS = (202, 256)


def kernel_verified(dtype, backend: str = "cuda") -> bool:
    """Whether the kernel may serve products of this dtype: it passed its self-check (once per
    process) or checks are off. False: use ``matmul_reference``; a warning has been given."""
    key = (("dtype", dtype),)
    ok = selfcheck.known("few-row matmul", backend, key)
    if ok is not None:
        return ok
    keys = mx.random.split(mx.random.key(selfcheck.SEED), 2 * len(CHECK_KS))
    cases = [
        (
            mx.random.normal((CHECK_ROWS, K), key=keys[2 * i]).astype(dtype),
            mx.random.normal((CHECK_N, K), key=keys[2 * i + 1]).astype(dtype),
        )
        for i, K in enumerate(CHECK_KS)
    ]

    def kernel():
        return {f"K{x.shape[1]}": matmul_kernel(x, w) for x, w in cases}

    def reference():
        with mx.stream(mx.cpu):  # an fp32 oracle: MLX's fp32 matmuls on CUDA round through TF32
            return {f"K{x.shape[1]}": matmul_reference(x, w) for x, w in cases}

    return selfcheck.verified(
        "few-row matmul", backend, key, kernel, reference, selfcheck.tolerance(dtype)
    )


__all__ = [
    "BODY",
    "CUDA_HEADER",
    "COLS",
    "DTYPES",
    "MAX_ROWS",
    "ROW_BUCKETS",
    "WARPS",
    "kernel_verified",
    "launch_rows",
    "matmul_kernel",
    "matmul_reference",
    "row_bucket",
    "unsupported",
]
