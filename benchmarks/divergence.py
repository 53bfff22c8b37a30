"""Do batched rows diverge from batch 1, and does acceptance fall with batch size? (issue 13, item 8)

On the embedded default pair, held-out prompts, greedy, in each dtype asked for:
  * DFlash at batch 1 (``Engine.generate``) and at batch B (``Engine.generate_batch``);
  * mlx_lm greedy at batch 1 (``stream_generate``) and batched (``batch_generate``, batch B).
It counts the rows whose tokens are identical between each pair of arms, where the first
difference falls, and tau (tokens per verify cycle) at batch 1 and at batch B over the same prompts,
verifying whole blocks (``adaptive_block=False``) so tau measures the drafts, not the width policy.

In fp32 every pair should agree (the CPU tests hold fp32 to token equality); in bf16 a verify pass
of 16 positions and B rows reduces in another order than one of 1 position and 1 row, so near-tied
logits can flip a greedy choice, and from there the rows differ. This measures how often.

    python -m benchmarks.divergence --dtypes bfloat16,float32 --prompts 32 --batch 8 --out DIR
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from dflash_batch.engine import load_engine, load_target
from dflash_batch.engine.models.default_model import ensure_default_pair

import mlx.core as mx

from benchmarks.arms import stock_ops
from benchmarks.default_pair import held_out_prompts


def first_difference(a, b):
    """Index of the first differing token (None if equal, length of the shorter if a prefix)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(name, a, b) -> dict:
    diffs = [first_difference(x, y) for x, y in zip(a, b)]
    where = [d for d in diffs if d is not None]
    return {
        "pair": name,
        "rows": len(diffs),
        "identical": sum(d is None for d in diffs),
        "first_difference_median": sorted(where)[len(where) // 2] if where else None,
        "first_differences": diffs,
    }


def tau(completions) -> float:
    tokens = sum(c.stats.generated_tokens for c in completions)
    cycles = sum(c.stats.cycles for c in completions)
    return tokens / cycles if cycles else float("nan")


def mlx_lm_arms(model, tokenizer, prompts, max_tokens, batch):
    from mlx_lm import batch_generate, stream_generate

    eos = set(tokenizer.eos_token_ids)
    with stock_ops():
        alone = []
        for p in prompts:
            ids = []
            for r in stream_generate(model, tokenizer, mx.array(p), max_tokens=max_tokens):
                if r.token in eos:
                    break
                ids.append(int(r.token))
            alone.append(ids)
        batched = []
        for i in range(0, len(prompts), batch):
            resp = batch_generate(
                model,
                tokenizer,
                prompts[i : i + batch],
                max_tokens=max_tokens,
                return_token_ids=True,
            )
            batched.extend(resp.token_ids)
    return alone, [without(ids, eos) for ids in batched]


def without(ids, eos) -> list:
    """Token ids up to (not including) the first EOS: every arm is compared in this form."""
    out = []
    for t in ids:
        if int(t) in eos:
            break
        out.append(int(t))
    return out


def one_dtype(dtype: str, prompts_wanted: int, max_tokens: int, batch: int) -> dict:
    started = time.perf_counter()
    # Whole blocks: the width policy's verify width would make tau a choice, not a measure of
    # drafts.
    engine = load_engine(None, "auto", dtype=dtype, adaptive_block=False)
    target_folder = ensure_default_pair(dtype)[0]
    model, tokenizer, _ = load_target(target_folder, None, getattr(mx, dtype))
    prompts = [p["prompt"] for p in held_out_prompts(tokenizer, prompts_wanted, None)]
    engine.generate(prompts[0], max_tokens=16)  # compile outside the comparison
    engine.warm_up(batch)
    alone = [engine.generate(p, max_tokens=max_tokens) for p in prompts]
    batched = engine.generate_batch(prompts, max_tokens=max_tokens, batch_size=batch)
    ar_alone, ar_batched = mlx_lm_arms(model, tokenizer, prompts, max_tokens, batch)
    eos = set(tokenizer.eos_token_ids)
    ids = {
        "dflash_b1": [without(c.token_ids, eos) for c in alone],
        f"dflash_b{batch}": [without(c.token_ids, eos) for c in batched],
        "mlx_lm_b1": ar_alone,
        f"mlx_lm_b{batch}": ar_batched,
    }
    names = list(ids)
    pairs = [
        compare(f"{a} vs {b}", ids[a], ids[b]) for i, a in enumerate(names) for b in names[i + 1 :]
    ]
    return {
        "dtype": dtype,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "batch": batch,
        "tau_b1": round(tau(alone), 3),
        f"tau_b{batch}": round(tau(batched), 3),
        "pairs": pairs,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    results = [
        one_dtype(d, args.prompts, args.max_tokens, args.batch) for d in args.dtypes.split(",")
    ]
    report = {
        "command": "python -m benchmarks.divergence "
        + " ".join(argv or __import__("sys").argv[1:]),
        "device": str(mx.default_device()),
        "device_info": {k: str(v) for k, v in mx.device_info().items()}
        if hasattr(mx, "device_info")
        else {},
        "platform": platform.platform(),
        "results": results,
    }
    for r in results:
        b = r["batch"]
        print(f"{r['dtype']}: tau b1 {r['tau_b1']} b{b} {r[f'tau_b{b}']}")
        for p in r["pairs"]:
            print(
                f"  {p['pair']}: {p['identical']}/{p['rows']} identical, median first difference {p['first_difference_median']}"
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"divergence-{platform.node() or 'machine'}{'-' + args.tag if args.tag else ''}.json"
    (out / name).write_text(json.dumps(report, indent=1))
    print(out / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
