"""What one verify pass is made of, by width: ``python -m benchmarks.verify_ops``.

At batch 1 on a GPU a small target's pass is launch-bound, so its cost follows the number of
operations in its graph more than the rows it verifies. For each verify width T (and each
attention mode available: the routed kernels, the same with the reduction fused into pass 1,
stock SDPA, the MLX-ops reference), one pass of the default pair's target (or ``--target``)
over rows holding ``--context`` tokens: the largest difference of its logits from the first
mode's, the operations in its graph (``mx.export_to_dot``: primitives by name; on the CPU the fast ops
appear decomposed, so only a GPU's counts say what launches) and its time (one compiling
run, then the fastest of five). The drafter's pass likewise.

Measured (H200, mlx[cuda13] 0.32.4, default pair fp32, batch 1, 300 keys, 2026-11-24;
``docs/benchmarks/verify-ops-h200-2026-11-24-b1.json``), ms per pass (operations):

    T         1            2            4            8            16           drafter
    kernel    4.21 (1568)  8.96 (1478)  11.92 (1478) 11.05 (1478) 12.29 (1477) 1.74
    stock     3.65 (1568)  6.71 (1448)  13.16 (2078) 9.49 (2078)  9.24 (2077)  1.52

Passes of T >= 2 cost two to three times the one-row pass with as many operations: not more
launches but dearer ones. About 2 ms of it is cuBLAS against the one-row gemv
(``benchmarks/small_matmul``). Stock SDPA's passes (one kernel a layer against the routed
attention's two; it recompiles for every new key length when it has more than one row:
engine/attention.py) were 3 ms cheaper at T = 16 on this machine, but not on the next one
(below): where the rest goes is not settled.

On another H200 (faster host), ``--modes kernel,kernel-fused,stock`` at 300 and 1000 keys
(``docs/benchmarks/verify-ops-h200-2026-11-24-b1-c*-fused.json``): kernel 3.6-3.7 ms at T = 1 and
6.6-9.6 at T = 2-16; stock SDPA no cheaper (5.5-8.5), its logits 0.1-1.0 from the kernel's; the
fused reduction no cheaper either, and wrong (logits off by 26-56, also at batch 8:
``...-b8-c300-fused.json``), so it stays off (kernels/attention.py: FUSE_REDUCTION).
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import sys

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
import mlx.core as mx

from dflash_batch.engine import attention, load_engine, warmup
from dflash_batch.engine.kernels import attention as block

from .default_pair import command_line, write_result


def graph_ops(outputs) -> collections.Counter:
    """Primitives in the graph that computes ``outputs``, counted by name."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return collections.Counter(re.findall(r'label ="?([A-Za-z_]+)', dot.getvalue()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target folder (default: the embedded default pair)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--modes", default="kernel,stock,reference",
                    help="attention modes to try where they run; kernel-fused: the kernel with its reduction in pass 1")
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    engine = load_engine(args.target, "auto")
    fused = block.FUSE_REDUCTION
    modes = [m for m in args.modes.split(",") if not m.startswith("kernel") or attention.default_mode() == "kernel"]
    rows, first = [], {}  # first: T -> the first mode's logits
    for mode in modes:
        # kernel-fused: the CUDA-core kernel with its reduction fused into pass 1 (one launch)
        block.FUSE_REDUCTION = mode == "kernel-fused"
        attention.set_mode(mode.split("-")[0])
        passes = warmup._Passes(engine, args.batch, args.context)
        for T in (int(w) for w in args.widths.split(",")):
            run = passes._verify(T)
            outputs = run()
            ops = graph_ops(outputs)
            logits = first.setdefault(T, outputs[0])
            ms = warmup._time(run, reps=5, enough=float("inf")) * 1e3  # the fastest of five after one
            rows.append({"mode": mode, "pass": "verify", "T": T, "ms": round(ms, 3), "ops": sum(ops.values()),
                         "max_abs_diff": float(mx.abs(outputs[0] - logits).max()), "top_ops": dict(ops.most_common(12))})
            print(rows[-1], file=sys.stderr)
        if engine.drafter is not None:
            ms = passes.draft() * 1e3
            rows.append({"mode": mode, "pass": "draft", "T": engine.block_size, "ms": round(ms, 3)})
            print(rows[-1], file=sys.stderr)
        del passes
    attention.set_mode(None)
    block.FUSE_REDUCTION = fused
    write_result({
        "command": command_line("verify_ops", argv),
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "batch": args.batch,
        "context": args.context,
        "passes": rows,
    }, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
