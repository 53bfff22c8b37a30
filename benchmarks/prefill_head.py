"""What the LM head over every position costs a prefill pass: ``python -m benchmarks.prefill_head``.

One target pass over ``--rows`` x ``--tokens`` random tokens of a benchmark shape (random weights),
two ways, alternating after a warm-up: the logits of every position (the model's own forward, as
prefill ran before) against the logits of one chosen position per row
(``Target(tokens, cache, at)``, what prefill runs now). Prints the median seconds of each, their
ratio and each way's peak memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine.models.target import Target
from dflash_batch.engine.ops.batch_cache import Lengths

import mlx.core as mx

from . import arms


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="qwen3-small")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    args = ap.parse_args(argv)

    gpu = mx.default_device() == mx.gpu
    setup = arms.build_setup(
        args.shape,
        getattr(mx, args.dtype or ("bfloat16" if gpu else "float32")),
        with_ar_draft=False,
    )
    target = Target(setup.model)
    tokens = mx.random.randint(
        0, setup.vocab_size, (args.rows, args.tokens), key=mx.random.key(0)
    ).astype(mx.int32)
    at = mx.array(
        [args.tokens - 1 - 7 * b for b in range(args.rows)], dtype=mx.int32
    )  # rows of their own lengths

    def one_pass(chosen):
        cache = target.make_cache(Lengths([0] * args.rows))
        mx.synchronize()
        mx.reset_peak_memory()
        start = time.perf_counter()
        logits, _ = target(tokens, cache, chosen)
        mx.eval(logits)
        return time.perf_counter() - start, mx.get_peak_memory() / 1e9

    ways = {"every_position": None, "chosen_positions": at}
    for chosen in ways.values():
        one_pass(chosen)  # warm-up
    runs = {name: [] for name in ways}
    for _ in range(args.reps):
        for name, chosen in ways.items():
            runs[name].append(one_pass(chosen))
    out = {"shape": args.shape, "rows": args.rows, "tokens": args.tokens, "device": str(mx.default_device()),
           "head_after_backbone": target.head_after_backbone}  # fmt: skip
    for name, r in runs.items():
        out[name] = {
            "s": round(statistics.median(s for s, _ in r), 4),
            "peak_gb": round(max(m for _, m in r), 3),
        }
    out["ratio"] = round(out["every_position"]["s"] / out["chosen_positions"]["s"], 2)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
