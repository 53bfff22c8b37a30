"""Benchmark the embedded default pair (SmolLM2-135M-Instruct + its DFlash drafter).

Measures, on held-out prompts that drafter training never saw:
  * mean acceptance length (tokens committed per verify cycle), greedy, block 16, with the whole
    block verified every cycle: the drafter's own acceptance. The adaptive verify width (the
    engine's default, used for speed) may choose plain one-token cycles when drafting does not
    pay on the machine; its tokens per cycle count those and are reported apart
    (``adaptive_tokens_per_cycle``), never as the drafter's acceptance;
  * exactness: DFlash tokens == ``mlx_lm.stream_generate`` greedy tokens of the same target;
  * decode speed against ``mlx_lm.stream_generate`` of the same converted target, same prompt
    tokens, after a warm-up, median of several runs.

    python benchmarks/default_pair.py --machine cpu-2core          # writes docs/results/...

Decode speed = (tokens - 1) / (time of the last token - time of the first token), for both
sides: the prefill and the first token are excluded alike.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from dflash_batch.engine import Engine, load_engine, load_target, pick_dtype

import mlx.core as mx

ROOT = Path(__file__).resolve().parent.parent


def held_out_prompts(tokenizer, count: int, samples: str | None) -> list:
    """Encoded held-out prompts: from a training run's eval.jsonl, else rebuilt (same split)."""
    if samples:
        rows = [json.loads(line) for line in Path(samples).read_text().splitlines() if line.strip()]
        return [{"id": r["id"], "kind": r["kind"], "prompt": r["prompt"]} for r in rows][:count]
    from dflash_batch.training import data, prompts

    _, held = prompts.split_prompts(prompts.build_prompts(4000, 0), 3)
    # Interleave the kinds so a small count still covers all of them.
    by_kind: dict = {}
    for p in held:
        by_kind.setdefault(p["kind"], []).append(p)
    mixed = [p for group in zip(*by_kind.values()) for p in group] + held
    seen, chosen = set(), []
    for p in mixed:
        if p["id"] not in seen:
            seen.add(p["id"])
            chosen.append(p)
    return data.encode_prompts(tokenizer, chosen[:count])


def held_out_options(ap: argparse.ArgumentParser, prompts: int, max_tokens: int) -> None:
    """The options of the benchmarks that decode held-out prompts (``held_out_acceptance``,
    ``anchor_bias``, ``draft_vocab``): the pair, the prompts, their budget and ``--out``."""
    ap.add_argument("--target", help="target folder (default: the embedded default pair)")
    ap.add_argument("--draft", help="drafter folder (default: the target's registered drafter)")
    ap.add_argument("--samples", help="held-out prompts as ids (a training run's eval.jsonl)")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-tokens", type=int, default=max_tokens)
    ap.add_argument("--out", help="write the result here (JSON)")


def command_line(module: str, argv=None) -> str:
    """How a benchmark was run, for its result file: ``python -m benchmarks.<module> <args>``."""
    return f"python -m benchmarks.{module} " + " ".join(sys.argv[1:] if argv is None else argv)


def write_result(result: dict, out: str | None) -> None:
    """Print ``result`` as JSON, and write it to ``out`` too when given."""
    text = json.dumps(result, indent=2) + "\n"
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text)
    print(text)


def timed(pieces) -> tuple:
    """(token ids, decode tokens/s, total seconds) of a stream of (time, new token ids)."""
    t0 = time.perf_counter()
    ids, first, last = [], None, None
    for new in pieces:
        now = time.perf_counter()
        if new:
            ids.extend(new)
            first = now if first is None else first
            last = now
    decode = (len(ids) - 1) / (last - first) if ids and last > first else float("nan")
    return ids, decode, time.perf_counter() - t0


def run_mlx_lm(model, tokenizer, prompt, max_tokens):
    from dflash_batch.engine import stock_ops

    from mlx_lm import stream_generate

    eos = set(tokenizer.eos_token_ids)

    def pieces():
        for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens):
            yield [] if r.token in eos else [int(r.token)]

    with stock_ops():  # mlx-lm's own ops, also for a model the engine routes
        return timed(pieces())


def run_engine(engine: Engine, prompt, max_tokens):
    stats = {}

    def pieces():
        for piece in engine.stream(prompt, max_tokens=max_tokens):
            if piece.stats is not None:
                stats["s"] = piece.stats
            yield piece.token_ids

    ids, decode, total = timed(pieces())
    return ids, decode, total, stats["s"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--machine", default=platform.node() or "unknown", help="name used in the output files"
    )
    ap.add_argument("--target", help="target folder (default: the embedded default pair)")
    ap.add_argument("--draft", help="drafter folder (default: the target's registered drafter)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--samples", help="eval.jsonl of a training run (pre-encoded held-out prompts)")
    ap.add_argument(
        "--prompts", type=int, default=16, help="held-out prompts for acceptance and exactness"
    )
    ap.add_argument(
        "--speed-prompts", type=int, default=4, help="of those, prompts timed for speed"
    )
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3, help="timed runs per prompt (median)")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "benchmarks"))
    args = ap.parse_args(argv)

    t_load = time.perf_counter()
    engine = load_engine(args.target, args.draft or "auto", dtype=args.dtype)
    target_folder = engine.description["target"]
    if args.target is None:
        from dflash_batch.engine.models.default_model import ensure_default_pair

        target_folder = ensure_default_pair()[0]
    ref_model, tokenizer, _ = load_target(target_folder, None, pick_dtype(args.dtype))
    load_s = time.perf_counter() - t_load
    if engine.drafter is None:
        print("no drafter: nothing to compare", file=sys.stderr)
        return 2
    # The drafter's acceptance: every cycle verifies the whole block. A model of its own: an
    # engine's target capture wraps the model's layers, so two engines cannot share one.
    fixed = load_engine(args.target, args.draft or "auto", dtype=args.dtype, adaptive_block=False)
    prompts = held_out_prompts(tokenizer, args.prompts, args.samples)
    print(
        f"{len(prompts)} held-out prompts, device {mx.default_device()}, loaded in {load_s:.1f}s",
        file=sys.stderr,
    )

    # -- acceptance and exactness (one run each) --------------------------------------------------
    hist = [0] * (engine.block_size + 1)
    adaptive_hist = [0] * (engine.block_size + 1)
    rows = []
    run_mlx_lm(ref_model, tokenizer, prompts[0]["prompt"], 32)  # warm-up of all three
    run_engine(engine, prompts[0]["prompt"], 32)
    run_engine(fixed, prompts[0]["prompt"], 32)
    for p in prompts:
        ref_ids, ref_tps, _ = run_mlx_lm(ref_model, tokenizer, p["prompt"], args.max_tokens)
        ids, tps, _, adaptive = run_engine(engine, p["prompt"], args.max_tokens)
        fixed_ids, _, _, stats = run_engine(fixed, p["prompt"], args.max_tokens)
        for k, n in enumerate(stats.acceptance_histogram):
            hist[k] += n
        for k, n in enumerate(adaptive.acceptance_histogram):
            adaptive_hist[k] += n
        rows.append(
            {
                "id": p["id"],
                "kind": p["kind"],
                "prompt_tokens": len(p["prompt"]),
                "tokens": len(ids),
                "cycles": stats.cycles,
                "tokens_per_cycle": None if stats.cycles == 0 else round(stats.tokens_per_cycle, 3),
                "adaptive_tokens_per_cycle": None
                if adaptive.cycles == 0
                else round(adaptive.tokens_per_cycle, 3),
                "exact": ids == ref_ids == fixed_ids,
                "mlx_lm_decode_tps": round(ref_tps, 2),
                "dflash_decode_tps": round(tps, 2),
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr)
    cycles = sum(hist)
    mean_accept = sum(k * n for k, n in enumerate(hist)) / max(cycles, 1)
    # The default engine's cycles include the plain ones its adaptive width chose: not the drafter's figure.
    adaptive_tpc = sum(k * n for k, n in enumerate(adaptive_hist)) / max(sum(adaptive_hist), 1)
    # Every prompt, one run each: decode tokens over decode seconds, summed over the prompts.
    timed_rows = [r for r in rows if r["tokens"] > 1]
    ar_rate = sum(r["tokens"] - 1 for r in timed_rows) / sum(
        (r["tokens"] - 1) / r["mlx_lm_decode_tps"] for r in timed_rows
    )
    df_rate = sum(r["tokens"] - 1 for r in timed_rows) / sum(
        (r["tokens"] - 1) / r["dflash_decode_tps"] for r in timed_rows
    )

    # -- speed -------------------------------------------------------------------------------------
    speed = []
    for p in prompts[: args.speed_prompts]:
        run_mlx_lm(ref_model, tokenizer, p["prompt"], args.max_tokens)  # warm-up
        run_engine(engine, p["prompt"], args.max_tokens)
        base, fast = [], []
        for _ in range(args.runs):
            ids_a, tps_a, _ = run_mlx_lm(ref_model, tokenizer, p["prompt"], args.max_tokens)
            ids_b, tps_b, _, _ = run_engine(engine, p["prompt"], args.max_tokens)
            base.append(tps_a)
            fast.append(tps_b)
        entry = {
            "id": p["id"],
            "tokens": len(ids_b),
            "mlx_lm_decode_tps": round(statistics.median(base), 2),
            "dflash_decode_tps": round(statistics.median(fast), 2),
        }
        entry["speedup"] = round(entry["dflash_decode_tps"] / entry["mlx_lm_decode_tps"], 3)
        speed.append(entry)
        print(json.dumps(entry), file=sys.stderr)

    result = {
        "machine": args.machine,
        "device": str(mx.default_device()),
        "device_info": {k: str(v) for k, v in mx.device_info().items()}
        if hasattr(mx, "device_info")
        else {},
        "mlx": mx.__version__,
        "engine": engine.description,
        "max_tokens": args.max_tokens,
        "block_size": engine.block_size,
        "held_out_prompts": len(rows),
        "mean_acceptance_length": round(mean_accept, 3),
        "acceptance_histogram": hist,
        "acceptance_verify_width": "whole block every cycle (adaptive_block=False)",
        "adaptive_tokens_per_cycle": round(adaptive_tpc, 3),
        "adaptive_histogram": adaptive_hist,
        "exact_prompts": sum(r["exact"] for r in rows),
        "mean_tokens_per_cycle_per_prompt": round(
            statistics.mean(r["tokens_per_cycle"] for r in rows if r["cycles"]), 3
        ),
        "all_prompts_mlx_lm_decode_tps": round(ar_rate, 2),
        "all_prompts_dflash_decode_tps": round(df_rate, 2),
        "all_prompts_speedup": round(df_rate / ar_rate, 3),
        "speed_runs": args.runs,
        "speedup_median": round(statistics.median(s["speedup"] for s in speed), 3)
        if speed
        else None,
        "mlx_lm_decode_tps_median": round(
            statistics.median(s["mlx_lm_decode_tps"] for s in speed), 2
        )
        if speed
        else None,
        "dflash_decode_tps_median": round(
            statistics.median(s["dflash_decode_tps"] for s in speed), 2
        )
        if speed
        else None,
        "prompts": rows,
        "speed": speed,
        "command": "python benchmarks/default_pair.py "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"default-pair-{args.machine}.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / f"default-pair-{args.machine}.md").write_text(markdown(result))
    print(json.dumps({k: v for k, v in result.items() if k not in ("prompts", "speed")}, indent=2))
    return 0


def markdown(r: dict) -> str:
    lines = [
        f"# Default pair benchmark: {r['machine']}",
        "",
        f"`{r['command']}`",
        "",
        f"Device {r['device']} {r['device_info']}, mlx {r['mlx']}, dtype {r['engine'].get('dtype')}, "
        f"block {r['block_size']}, greedy, max {r['max_tokens']} tokens.",
        "",
        f"- Mean acceptance length on {r['held_out_prompts']} held-out prompts: **{r['mean_acceptance_length']}** tokens per verify cycle",
        f"  (the whole block verified every cycle; total committed tokens / total cycles; the mean of the per-prompt values is {r['mean_tokens_per_cycle_per_prompt']})",
        f"- Tokens per cycle of the default engine (adaptive verify width, plain one-token cycles included): {r.get('adaptive_tokens_per_cycle')}",
        f"- Exact (DFlash tokens == mlx_lm.stream_generate tokens): {r['exact_prompts']} / {r['held_out_prompts']}",
        f"- Decode speed over all {r['held_out_prompts']} held-out prompts (one run each, decode tokens / decode seconds): "
        f"mlx_lm {r['all_prompts_mlx_lm_decode_tps']} tok/s, DFlash {r['all_prompts_dflash_decode_tps']} tok/s, "
        f"speed-up **{r['all_prompts_speedup']}x**",
        f"- Decode speed on the first {len(r['speed'])} prompts, median over prompts of the median of {r['speed_runs']} runs: "
        f"mlx_lm {r['mlx_lm_decode_tps_median']} tok/s, DFlash {r['dflash_decode_tps_median']} tok/s, "
        f"speed-up **{r['speedup_median']}x**",
        "",
        "| prompt | kind | tokens | tokens/cycle | adaptive tokens/cycle | exact | mlx_lm tok/s | DFlash tok/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {p['id']} | {p['kind']} | {p['tokens']} | {p['tokens_per_cycle']} | {p.get('adaptive_tokens_per_cycle')} | {p['exact']} | "
        f"{p['mlx_lm_decode_tps']} | {p['dflash_decode_tps']} |"
        for p in r["prompts"]
    ]
    lines += [
        "",
        "| prompt | tokens | mlx_lm tok/s | DFlash tok/s | speed-up |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {s['id']} | {s['tokens']} | {s['mlx_lm_decode_tps']} | {s['dflash_decode_tps']} | {s['speedup']} |"
        for s in r["speed"]
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
