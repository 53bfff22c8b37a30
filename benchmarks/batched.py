"""Whole-job throughput of the batched engine against ``mlx_lm.batch_generate``, side by side in
one process: ``python -m benchmarks.batched --shape qwen3-4b --out DIR``.

One job of ``--prompts`` distinct random prompts of ``--context`` tokens, ``--max-tokens`` new
tokens each, at every batch size B of ``--batches``:

  mlx_lm.batch_generate   B rows decoded together (``completion_batch_size=B``), stock attention
  dflash.plain            this engine without a drafter: batched plain decoding, same kernels
  dflash tau=T            this engine with the shape's DFlash drafter, the real drafter running
                          every cycle and its proposed ids scripted per row so that a cycle
                          commits T tokens on average (target's final norm zeroed: it always
                          chooses token 0, whatever the numerics; benchmarks/scripted.py)
  dflash full / random    every block accepted / the random drafter itself (about 1 token a cycle)

Each arm first runs a short job (2 B prompts) to warm up (compilation, the engine's cost model at
that B), then ``--reps`` timed runs of the whole job; the median is reported. Figures: total generated tokens / wall time of the
whole job (prefill included) and the decoding-only rate: mlx-lm's own generation rate, and for
the engine tokens / (wall - the time its prefill passes took). ``--prefill packed,one`` runs
each engine arm twice: joining prompts prefilled together (the default) and one prompt per pass. Results are written
to ``DIR/batched-<machine>-<date>-<shape>.json`` after every measurement; ``--plot`` draws
tok/s against B from such a file.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)

import mlx.core as mx

from . import arms
from .scripted import AcceptanceScript, ScriptedDrafter, head_rows_of


def job_prompts(n: int, length: int, vocab: int) -> List[List[int]]:
    return [arms.prompt_ids(length, vocab, seed=1000 + i) for i in range(n)]


def run_mlx_lm(setup, prompts, max_tokens: int, B: int) -> Dict[str, Any]:
    from mlx_lm import batch_generate

    with arms.stock_ops():
        mx.synchronize()
        start = time.perf_counter()
        resp = batch_generate(
            setup.model,
            setup.tokenizer,
            prompts,
            max_tokens=max_tokens,
            completion_batch_size=B,
            prefill_batch_size=min(B, 8),
        )
        wall = time.perf_counter() - start
    s = resp.stats
    return {
        "tokens": s.generation_tokens,
        "wall_s": wall,
        "tok_s": s.generation_tokens / wall,
        "generation_tok_s": s.generation_tps,
        "prefill_tok_s": s.prompt_tps,
    }


def run_engine(engine, prompts, max_tokens: int, B: int) -> Dict[str, Any]:
    mx.synchronize()
    start = time.perf_counter()
    done = engine.generate_batch(prompts, max_tokens=max_tokens, batch_size=B)
    wall = time.perf_counter() - start
    tokens = sum(c.stats.generated_tokens for c in done)
    cycles = sum(c.stats.cycles for c in done)
    committed = sum(k * n for c in done for k, n in enumerate(c.stats.acceptance_histogram))
    prefill = engine.prefill_counts["seconds"]  # the prefill passes (packed, or one prompt each)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "prefill_s": prefill,
        "cycles": cycle_summary(engine.decode_counts),
        "prefill_passes": engine.prefill_counts["passes"],
        "prefill_padding": engine.prefill_counts["padding"],
        "decode_tok_s": tokens / (wall - prefill) if wall > prefill else None,
        "tokens_per_cycle": committed / cycles if cycles else None,
        "all_token_0": all(t == 0 for c in done for t in c.token_ids),
    }


def cycle_summary(counts: Dict[int, list]) -> Dict[str, Any]:
    """Per verify width T: cycles, mean ms per cycle and mean rows in flight (Engine.decode_counts)."""
    return {
        str(T): {"cycles": n, "ms": round(1e3 * s / n, 2), "rows": round(rows / n, 1)}
        for T, (n, s, rows) in sorted(counts.items())
    }


def engine_arm(setup, engine_setup, acceptance: str, prefill: str = "packed"):
    """(engine, context manager) for one acceptance setting; ``prefill``: "packed" (joining
    prompts prefilled together) or "one" (one prompt per prefill pass, as before packing)."""
    from functools import partial

    from dflash_batch.engine import Engine as engine_class

    # distinct random prompts share no prefix: no prefix cache, so runs never reuse an earlier run's state
    Engine = partial(engine_class, prefill_rows=1 if prefill == "one" else None, prefix_cache_mb=0)
    config = arms.text_config(setup.shape.target)
    if acceptance == "plain":
        return Engine(
            engine_setup.model, setup.tokenizer, None, config=config
        ), arms.zeroed_final_norm()
    drafter = engine_setup.drafter
    if acceptance.startswith("tau="):
        script = AcceptanceScript.of_tokens_per_cycle(
            float(acceptance[4:]), drafter.args.block_size, seed=7
        )
        drafter = ScriptedDrafter(
            drafter, head_rows_of(engine_setup.model), script, setup.vocab_size
        )
        return Engine(
            engine_setup.model, setup.tokenizer, drafter, config=config
        ), arms.zeroed_final_norm(engine_setup.model)
    engine = Engine(engine_setup.model, setup.tokenizer, drafter, config=config)
    if acceptance == "full":
        return engine, arms.zeroed_final_norm(engine_setup.model, drafter)
    return engine, arms.zeroed_final_norm()  # random: nothing zeroed


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="qwen3-4b")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--acceptance", default="tau=6.5,random,full", help="engine arms besides plain")
    ap.add_argument(
        "--prefill",
        default="packed",
        help="packed, one (one prompt per prefill pass) or both: packed,one",
    )
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument(
        "--budget-s", type=float, default=0, help="start no new measurement after this long"
    )
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--tag", default="")
    ap.add_argument(
        "--skip-baseline",
        action="store_true",
        help="no mlx_lm.batch_generate arm (e.g. where it runs out of memory)",
    )
    ap.add_argument(
        "--resume",
        action="store_true",
        help="keep the measurements of an earlier run of this command (same shape and tag, in --out) "
        "and run only the rest: one table from one command over several sessions",
    )
    ap.add_argument("--plot", help="draw a results JSON file as PNG (no run)")
    ap.add_argument(
        "--profile", help="time the passes of one cycle at these batch sizes, e.g. 16,64 (no job)"
    )
    args = ap.parse_args(argv)
    if args.plot:
        return plot(Path(args.plot))
    if args.profile:
        doc = profile(args.shape, [int(b) for b in args.profile.split(",")], args.context)
        print(json.dumps(doc), flush=True)
        if args.tag:
            path = Path(args.out) / f"batched-profile-{args.shape}-{args.tag}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(doc, indent=1))
        return Path(args.out)

    gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    setup = arms.build_setup(args.shape, dtype, with_ar_draft=False)
    engine_setup = arms.engine_setup(setup)  # the engine wraps its model's layers: its own copy
    prompts = job_prompts(args.prompts, args.context, setup.vocab_size)
    batches = [int(b) for b in args.batches.split(",")]
    started = time.perf_counter()
    doc = {
        "command": "python -m benchmarks.batched "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "device": str(mx.default_device()),
            "platform": platform.platform(),
            "device_info": {k: str(v) for k, v in (mx.device_info() if gpu else {}).items()},
            "mlx": mx.__version__,
        },
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "shape": args.shape,
        "dtype": str(dtype),
        "prompts": args.prompts,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "reps": args.reps,
        "results": [],
    }
    suffix = f"-{args.shape}{'-' + args.tag if args.tag else ''}.json"
    path = Path(args.out) / f"batched-{'cuda' if gpu else 'cpu'}-{doc['started'][:10]}{suffix}"
    path.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if args.resume:
        earlier = sorted(Path(args.out).glob(f"batched-{'cuda' if gpu else 'cpu'}-*{suffix}"))
        if earlier:
            path = earlier[-1]
            old = json.loads(path.read_text())
            doc["results"] = [r for r in old["results"] if r["status"] == "ok"]
            doc["started"], doc["resumed"] = (
                old["started"],
                old.get("resumed", [])
                + [dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")],
            )
            done = {(r["arm"], r["batch"]) for r in doc["results"]}

    def record(arm: str, B: int, run: Callable[[list, int], Dict[str, Any]]) -> None:
        if (arm, B) in done or (args.budget_s and time.perf_counter() - started > args.budget_s):
            return
        arms.record(doc, lambda d: path.write_text(json.dumps(d, indent=1)), arm, B, run, prompts, args.reps,
                    args.max_tokens)  # fmt: skip

    for B in batches:
        if not args.skip_baseline:
            with arms.zeroed_final_norm(setup.model):  # same compute; token 0 every step
                record("mlx_lm.batch_generate", B, lambda job, n: run_mlx_lm(setup, job, n, B))
        for acceptance in ["plain"] + args.acceptance.split(","):
            for mode in args.prefill.split(","):
                # One engine at a time: an engine taps (wraps) its model's layers for its own drafter.
                engine, zeroed = engine_arm(setup, engine_setup, acceptance, mode)
                arm = f"dflash {acceptance}" + (
                    "" if mode == "packed" else f" ({mode}-per-pass prefill)"
                )
                with zeroed:
                    record(arm, B, lambda job, n: run_engine(engine, job, n, B))
                del engine  # its caches go before the next arm's (release)
    doc["wall_s"] = time.perf_counter() - started
    path.write_text(json.dumps(doc, indent=1))
    print(path)
    return path


def table(doc: dict) -> str:
    """Markdown: tok/s per arm and batch size, and the ratio to batch_generate at the same B."""
    rows = {}
    for r in doc["results"]:
        if r["status"] == "ok":
            rows.setdefault(r["arm"], {})[r["batch"]] = r["figures"]
    batches = sorted({r["batch"] for r in doc["results"]})
    base = rows.get("mlx_lm.batch_generate", {})
    lines = [
        "| arm | " + " | ".join(f"B={b}" for b in batches) + " |",
        "|---" * (len(batches) + 1) + "|",
    ]
    for arm, by_b in rows.items():
        cells = []
        for b in batches:
            f = by_b.get(b)
            if f is None:
                cells.append("")
                continue
            cell = f"{f['tok_s']:.0f}"
            if arm != "mlx_lm.batch_generate" and b in base:
                cell += f" ({f['tok_s'] / base[b]['tok_s']:.2f}x)"
            elif "generation_tok_s" in f:
                cell += f" (gen {f['generation_tok_s']:.0f})"
            cells.append(cell)
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    arms_seen: Dict[str, List] = {}
    for r in doc["results"]:
        if r["status"] == "ok":
            arms_seen.setdefault(r["arm"], []).append((r["batch"], r["figures"]["tok_s"]))
    for arm, points in arms_seen.items():
        points.sort()
        ax.plot([b for b, _ in points], [t for _, t in points], marker="o", label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size (rows in flight)")
    ax.set_ylabel("whole-job tok/s (prefill included)")
    ax.set_title(
        f"{doc['shape']}, {doc['prompts']} prompts x {doc['context']} + {doc['max_tokens']} tokens"
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    out = path.with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    path.with_suffix(".md").write_text(
        f"`{doc['command']}` ({doc['machine']['device']})\n\n{table(doc)}\n"
    )
    return out


def profile(shape: str, batches: List[int], context: int, widths=(1, 4, 8, 16)) -> Dict[str, Any]:
    """Milliseconds of the passes of one cycle (engine/warmup.py's timing: a batch whose rows hold
    about ``context`` tokens, fastest of three after a compiling call): target verify passes of
    each width and the drafter pass, at each batch size, through each ragged attention route
    (engine/ops/attention.py); then what the engine's own warm-up chose and fitted at each B."""
    from dflash_batch.engine import Engine, warmup
    from dflash_batch.engine.ops import attention, switch

    gpu = mx.default_device() == mx.gpu
    setup = arms.build_setup(shape, mx.bfloat16 if gpu else mx.float32, with_ar_draft=False)
    engine = Engine(
        setup.model, setup.tokenizer, setup.drafter, config=arms.text_config(setup.shape.target)
    )
    out: Dict[str, Any] = {"context": context, "attention_mode": engine.settings.attention}
    for route in attention.RAGGED_ROUTES:
        # the engine's routes, this ragged route
        with switch.use(engine.settings.routes().replace(ragged=route)):
            for B in batches:
                passes = warmup._Passes(engine, B, context)
                for T in widths:
                    out[f"{route}_target_B{B}_T{T}"] = round(passes.target(T) * 1e3, 3)
                out[f"{route}_draft_B{B}"] = round(passes.draft() * 1e3, 3)
                del passes
                arms.release()
    for B in batches:
        cost = engine.warm_up(B, context)
        out[f"warmup_B{B}"] = {
            "route": cost.route,
            "matmul": cost.matmul,
            "t0_ms": cost.t0 * 1e3,
            "t1_us": cost.t1 * 1e6,
            "t2_us": cost.t2 * 1e6,
            "d0_ms": cost.d0 * 1e3,
            "d1_us": cost.d1 * 1e6,
            "predicted_ms": {T: round(cost.passes(B, T) * 1e3, 2) for T in widths},
        }
        arms.release()
    return out


if __name__ == "__main__":
    main()
