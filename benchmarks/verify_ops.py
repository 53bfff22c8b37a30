"""What one verify pass is made of, by width: ``python -m benchmarks.verify_ops``.

At batch 1 on a GPU a small target's pass is launch-bound, so its cost follows the number of
operations in its graph more than the rows it verifies. For each verify width T (and each
attention mode available: the routed kernels, the same with the reduction fused into pass 1,
stock SDPA, the MLX-ops reference), one pass of the default pair's target (or ``--target``)
over rows holding ``--context`` tokens: the largest difference of its logits from the first
mode's, the operations in its graph (``mx.export_to_dot``: primitives by name; on the CPU the fast ops
appear decomposed, so only a GPU's counts say what launches) and its time (one compiling
run, then the fastest of five, in each of ``--rounds`` rounds over every combination in turn;
``build_ms``: of that, the host building the graph before it runs). The drafter's pass likewise
(a block of new context rows; compiled too in the compiled pass mode). ``--matmul``: each of
these with few-row products through MLX's matmul ("stock") and through the few-row kernel
("kernel", engine/ops/matmul.py).

What it measured, with the commands: ``docs/results/verify-ops.md``.
"""

from __future__ import annotations

import argparse
import collections
import io
import re
import sys
import time

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from dflash_batch.engine import load_engine, warmup
from dflash_batch.engine.ops import attention, switch
from dflash_batch.engine.ops.kernels import attention as block

import mlx.core as mx

from .default_pair import command_line, write_result


def graph_ops(outputs) -> collections.Counter:
    """Primitives in the graph that computes ``outputs``, counted by name."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return collections.Counter(re.findall(r'label ="?([A-Za-z_]+)', dot.getvalue()))


def timed(run, reps: int = 5) -> tuple:
    """(seconds, of them building the graph on the host) of the fastest of ``reps`` passes after a
    compiling one: ``run()`` builds the pass's graph, ``mx.eval`` runs it."""
    mx.eval(run())
    best, build = float("inf"), 0.0
    for _ in range(reps):
        start = time.perf_counter()
        outputs = run()
        built = time.perf_counter()
        mx.eval(outputs)
        if time.perf_counter() - start < best:
            best, build = time.perf_counter() - start, built - start
    return best, build


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target folder (default: the embedded default pair)")
    ap.add_argument(
        "--draft",
        default="auto",
        help="drafter folder (default: the target's registered drafter, if any)",
    )
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument(
        "--modes",
        default="kernel,stock,reference",
        help="attention modes to try where they run (engine/ops/attention.py)",
    )
    ap.add_argument(
        "--matmul",
        default="stock,kernel",
        help="few-row product modes to try where they run (engine/ops/matmul.py), each with every attention mode",
    )
    ap.add_argument(
        "--passes",
        default="eager,compiled",
        help="decoding pass modes to try (engine/ops/compiled.py), each with every combination above",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds over every combination, each keeping its fastest",
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    # chain drafting: the drafter's pass as one graph (a tree cycle's drafting also grows its
    # trees on the host, outside any graph)
    engine = load_engine(args.target, args.draft, drafts="chain")
    modes = [
        m for m in args.modes.split(",") if m != "kernel" or attention.default_mode() == "kernel"
    ]
    products = [m for m in args.matmul.split(",") if m != "kernel" or block.gpu_backend() == "cuda"]
    pass_modes = args.passes.split(",")
    combos = [(p, m, c) for c in pass_modes for p in products for m in modes]
    widths = [int(w) for w in args.widths.split(",")]
    rows, first, passes = {}, {}, {}  # first: T -> the first combination's logits
    # Rounds over every combination in turn, each keeping its fastest: a machine's slow spell
    # (a shared host, clocks) then favours none of them.
    for _ in range(args.rounds):
        for product, mode, passes_mode in combos:
            with switch.modes(matmul=product, passes=passes_mode, attention=mode):
                key = (product, mode, passes_mode)
                if (
                    key not in passes
                ):  # its cache allocated as a batch in this pass mode allocates it
                    passes[key] = warmup._Passes(engine, args.batch, args.context)
                for T in widths:
                    run = passes[key]._verify(T)
                    ms, build_ms = (t * 1e3 for t in timed(run))
                    row = rows.get(key + (T,))
                    if row is None:
                        outputs = run()
                        ops = graph_ops(outputs)
                        logits = first.setdefault(T, outputs[0])
                        row = rows[key + (T,)] = {
                            "mode": mode,
                            "matmul": product,
                            "passes": passes_mode,
                            "pass": "verify",
                            "T": T,
                            "ms": float("inf"),
                            "ops": sum(ops.values()),
                            "max_abs_diff": float(mx.abs(outputs[0] - logits).max()),
                            "top_ops": dict(ops.most_common(12)),
                        }
                    if ms < row["ms"]:
                        row.update(ms=round(ms, 3), build_ms=round(build_ms, 3))
                if (
                    engine.drafter is not None
                ):  # the drafter's pass, compiled in the compiled pass mode
                    run = passes[key]._draft()
                    ms, build_ms = (t * 1e3 for t in timed(run))
                    row = rows.get(key + ("draft",))
                    if row is None:
                        ops = graph_ops([run()])
                        row = rows[key + ("draft",)] = {
                            "mode": mode,
                            "matmul": product,
                            "passes": passes_mode,
                            "pass": "draft",
                            "T": engine.block_size,
                            "ms": float("inf"),
                            "ops": sum(ops.values()),
                            "top_ops": dict(ops.most_common(12)),
                        }
                    if ms < row["ms"]:
                        row.update(ms=round(ms, 3), build_ms=round(build_ms, 3))
    rows = list(rows.values())
    for row in rows:
        print({k: v for k, v in row.items() if k != "top_ops"}, file=sys.stderr)
    del passes
    write_result(
        {
            "command": command_line("verify_ops", argv),
            "device": str(mx.default_device()),
            "mlx": mx.__version__,
            "batch": args.batch,
            "context": args.context,
            "passes": rows,
        },
        args.out,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
