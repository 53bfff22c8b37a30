"""Prefill work saved by packing and sharing, as ratios: ``python -m benchmarks.prefill_sharing``.

Three jobs on one engine shape (random weights, plain decoding: the prefill is the target's), each
run both ways, timing the prefill passes (``Engine.prefill_counts``) and the whole job:

  samples     ``--samples`` samples of one ``--context``-token prompt: prefilled once and shared
              (the prefix cache) against prefilled once per sample
  instruction ``--items`` items behind one shared ``--instruction``-token instruction: shared
              prefix against every item prefilled alone
  packed      ``--items`` distinct prompts of 64..``--context`` tokens: joining prompts prefilled
              together against one prompt per pass

``--shape`` is a name in benchmarks/shapes.py, or "small" (a 8-layer qwen3, hidden 512, that a
CPU runs in seconds). Prints one JSON object per job and writes them all to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)

import mlx.core as mx

from . import shapes

SMALL = shapes.qwen3(
    hidden=512, layers=8, inter=1536, heads=8, kv_heads=4, tied=True, vocab=8192, head_dim=64
)


def _engine(model, tokenizer, config, **options):
    from dflash_batch.engine import Engine

    return Engine(model, tokenizer, None, config=config, **options)


def _job(
    engine, prompts: List[List[int]], batch: int, max_tokens: int, n: int = 1
) -> Dict[str, Any]:
    mx.synchronize()
    start = time.perf_counter()
    engine.generate_batch(
        prompts, max_tokens=max_tokens, batch_size=batch, n=n, temperature=1.0, seed=0
    )
    wall = time.perf_counter() - start
    counts = dict(engine.prefill_counts)
    return {
        "wall_s": round(wall, 3),
        "prefill_s": round(counts["seconds"], 3),
        "prefill_tokens": counts["tokens"],
        "padding_tokens": counts["padding"],
        "prefill_passes": counts["passes"],
    }


def _median(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    out = dict(runs[0])
    for key in ("wall_s", "prefill_s"):
        out[key] = statistics.median(r[key] for r in runs)
        out[key + "_runs"] = [r[key] for r in runs]
    return out


def _pair(run_a, run_b, reps: int):
    """Both ways, alternating (a shared machine's load drifts), ``reps`` times each: the medians."""
    a, b = [], []
    for _ in range(reps):
        a.append(run_a())
        b.append(run_b())
    return _median(a), _median(b)


def _compare(name: str, a: Dict[str, Any], b: Dict[str, Any], labels) -> Dict[str, Any]:
    return {
        "job": name,
        labels[0]: a,
        labels[1]: b,
        "prefill_s_ratio": round(b["prefill_s"] / a["prefill_s"], 2) if a["prefill_s"] else None,
        "wall_s_ratio": round(b["wall_s"] / a["wall_s"], 2) if a["wall_s"] else None,
    }


def main(argv=None) -> List[Dict[str, Any]]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="small")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--instruction", type=int, default=1000)
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument(
        "--reps", type=int, default=1, help="runs of each job each way, alternating; medians"
    )
    ap.add_argument("--jobs", default="samples,instruction,packed")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args(argv)
    gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    config = (
        SMALL if args.shape == "small" else shapes.text_config(shapes.SHAPES[args.shape].target)
    )
    model = shapes.build_target(
        SMALL if args.shape == "small" else shapes.SHAPES[args.shape].target, dtype, seed=0
    )
    tokenizer = shapes.build_tokenizer(config["vocab_size"])
    rng = random.Random(0)

    def ids(n: int) -> List[int]:
        return [rng.randrange(256, config["vocab_size"]) for _ in range(n)]

    def engine(**options):
        return _engine(model, tokenizer, config, prefill_chunk=args.prefill_chunk, **options)

    warm = engine(prefix_cache_mb=0)
    _job(warm, [ids(300), ids(40)], 2, 2)  # first passes of the process
    results = []
    jobs = args.jobs.split(",")
    if "samples" in jobs:
        prompt = ids(args.context)
        shared, alone = _pair(lambda: _job(engine(), [prompt], args.batch, args.max_tokens, n=args.samples),
                              lambda: _job(engine(prefix_cache_mb=0), [prompt], args.batch, args.max_tokens, n=args.samples),
                              args.reps)  # fmt: skip
        results.append(
            _compare(
                f"{args.samples} samples of a {args.context}-token prompt",
                shared,
                alone,
                ("shared", "per_sample"),
            )
        )
    if "instruction" in jobs:
        instruction = ids(args.instruction)
        items = [instruction + ids(rng.randrange(20, 200)) for _ in range(args.items)]
        shared, alone = _pair(lambda: _job(engine(), items, args.batch, args.max_tokens),
                              lambda: _job(engine(prefix_cache_mb=0), items, args.batch, args.max_tokens), args.reps)  # fmt: skip
        results.append(
            _compare(
                f"{args.items} items behind a {args.instruction}-token instruction",
                shared,
                alone,
                ("shared", "alone"),
            )
        )
    if "packed" in jobs:
        distinct = [ids(rng.randrange(64, args.context)) for _ in range(args.items)]
        packed, one = _pair(lambda: _job(engine(prefix_cache_mb=0), distinct, args.batch, args.max_tokens),
                            lambda: _job(engine(prefix_cache_mb=0, prefill_rows=1), distinct, args.batch, args.max_tokens),
                            args.reps)  # fmt: skip
        results.append(
            _compare(
                f"{args.items} distinct prompts of 64..{args.context} tokens",
                packed,
                one,
                ("packed", "one_per_pass"),
            )
        )
    machine = {
        "device": str(mx.default_device()),
        "platform": platform.platform(),
        "mlx": mx.__version__,
    }
    for r in results:
        print(json.dumps(r), flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"machine": machine, "args": vars(args), "results": results}, indent=1)
        )
    return results


if __name__ == "__main__":
    main()
