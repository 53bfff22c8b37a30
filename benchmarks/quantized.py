"""A 4-bit target on a GPU (issue 35): Qwen3.5-27B's shape, random weights quantized by mlx-lm's
own quantizer (``mlx_lm.utils.quantize_model``, affine 4-bit in groups of 64 by default), side by
side in one process:

    python -m benchmarks.quantized --out docs/results/quantized.json           (the GPU run)
    python -m benchmarks.quantized --layers 16 --prompts 32 --out ...          (a shorter one)
    python -m benchmarks.quantized --smoke --out /tmp/q.json                   (CPU, tiny)

A job of ``--prompts`` random prompts of ``--context`` tokens, ``--max-tokens`` new tokens each, at
every batch size B of ``--batches``:

  mlx_lm.batch_generate   B rows decoded together, stock attention
  dflash plain            this engine without a drafter
  dflash tau=6.5          the drafter runs every cycle, its proposals scripted to commit 6.5 tokens
                          a cycle on average (benchmarks/scripted.py; the target's final norm zeroed:
                          it always chooses token 0, the same compute)
  dflash random           the random drafter itself (about one token a cycle)

Each engine arm reports the verify widths its width policy chose (``Engine.decode_counts``: cycles
and mean milliseconds per width), which on a quantized target should stay below the width where
the quantized matmul leaves its vector path (docs/models.md, "Quantized targets").

Then the divergence count, as ``benchmarks/divergence.py`` does for bf16: on the quantized target's
own greedy output (norm not zeroed), ``--divergence-prompts`` rows of mlx-lm's plain decoding at
batch 1 (``stream_generate``) against mlx_lm.batch_generate, DFlash at batch 1 and DFlash batched
(whole blocks verified, the random drafter): rows identical, of N, and where the first
difference falls.

Results go to ``--out`` (JSON, rewritten after every measurement; ``--resume`` keeps what an
earlier run of the same command measured) and a markdown table beside it (``.md``).
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
from .batched import engine_arm, job_prompts, run_engine, run_mlx_lm
from .divergence import compare
from .shapes import (
    Shape,
    build_drafter,
    build_tokenizer,
    dflash_drafter,
    qwen3_5,
    tiny_hybrid_drafter,
    tiny_qwen3_5,
    weight_bytes,
)


def qwen35_27b(layers: int = 64) -> Shape:
    """Qwen3.5-27B's text model (hidden 5120, 64 layers, MLP 17408, 24 query / 4 KV heads of 256,
    linear attention 16 key / 48 value heads of 128, vocab 248,320, untied; quoted alike by several
    third-party configs, not fetched) and a drafter laid out like z-lab's Qwen3.5 drafters with
    5 layers and 5 taps, the layout whose bf16 size is the 3.46 GB quoted for
    z-lab/Qwen3.5-27B-DFlash (layers, taps, heads and window assumed)."""
    config = qwen3_5(5120, 17408, tied=False, layers=layers)
    config["text_config"].update(
        num_attention_heads=24, num_key_value_heads=4, linear_num_value_heads=48
    )
    taps = _taps(layers, 5)
    drafter = dflash_drafter(5120, 17408, 5, taps, layers, 248077, 248320, 1e7, window=4096)
    return Shape(
        f"qwen3.5-27b-{layers}l",
        config,
        drafter,
        source="Qwen3.5-27B text shape (third-party configs)",
        unverified=["target config quoted by third parties, not fetched", "drafter layout assumed"],
    )


def tiny_hybrid() -> Shape:
    """A tiny hybrid of the same layout (every width a multiple of 64, so every layer quantizes)."""
    config = tiny_qwen3_5(tied=False)
    return Shape(
        "qwen3.5-tiny-hybrid", config, tiny_hybrid_drafter(), source="tiny hybrid for the smoke run"
    )


def _taps(layers: int, count: int) -> List[int]:
    from dflash_batch.engine.models.drafter import build_target_layer_ids

    return sorted(set(build_target_layer_ids(layers, min(count, max(layers - 3, 1)))))


def build_quantized(config: dict, dtype: mx.Dtype, quant: dict, seed: int = 0):
    """An mlx-lm model of ``config``, seeded random weights quantized by mlx-lm's own quantizer
    (its model's predicate included). Built lazily and evaluated layer by layer, so the
    unquantized weights of one layer at most are ever in memory."""
    from mlx_lm.utils import _get_classes, quantize_model

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    model, _ = quantize_model(model, config, quant["group_size"], quant["bits"], mode=quant["mode"])
    for layer in model.layers:
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    model.eval()
    return model


def build_setup(shape: Shape, dtype: mx.Dtype, quant: dict) -> arms.Setup:
    model = build_quantized(shape.target, dtype, quant)
    hidden = arms.text_config(shape.target)["hidden_size"]
    drafter = build_drafter(shape.drafter, hidden, dtype, seed=1)
    tokenizer = build_tokenizer(arms.text_config(shape.target)["vocab_size"])
    return arms.Setup(
        shape, model, tokenizer, drafter, None, dtype, weight_bytes(model), weight_bytes(drafter)
    )


def engine_copy(setup: arms.Setup, quant: dict) -> arms.Setup:
    """The same weights again (same seed) for the engine, which wraps its model's layers."""
    return arms.engine_setup(setup, build_quantized(setup.shape.target, setup.dtype, quant))


# -- divergence -----------------------------------------------------------------------------------


def divergence(
    setup: arms.Setup,
    engine_setup: arms.Setup,
    prompts: List[List[int]],
    max_tokens: int,
    batch: int,
) -> Dict[str, Any]:
    """Rows identical to mlx-lm's plain decoding at batch 1, of N, for each other arm."""
    from dflash_batch.engine import Engine

    from mlx_lm import batch_generate, stream_generate

    with arms.stock_ops():
        plain = [
            [
                int(r.token)
                for r in stream_generate(
                    setup.model, setup.tokenizer, mx.array(p), max_tokens=max_tokens
                )
            ]
            for p in prompts
        ]
        resp = batch_generate(
            setup.model,
            setup.tokenizer,
            prompts,
            max_tokens=max_tokens,
            completion_batch_size=batch,
            return_token_ids=True,
        )
    config = arms.text_config(setup.shape.target)
    engine = Engine(
        engine_setup.model,
        setup.tokenizer,
        engine_setup.drafter,
        config=config,
        adaptive_block=False,
        prefix_cache_mb=0,
    )
    alone = [engine.generate(p, max_tokens=max_tokens).token_ids for p in prompts]
    batched = [
        c.token_ids for c in engine.generate_batch(prompts, max_tokens=max_tokens, batch_size=batch)
    ]
    rows = {
        "mlx_lm.batch_generate": [list(map(int, r)) for r in resp.token_ids],
        "dflash b1": alone,
        f"dflash b{batch}": batched,
    }
    return {
        "rows": len(prompts),
        "batch": batch,
        "max_tokens": max_tokens,
        "pairs": [compare(f"{name} vs mlx_lm b1", ids, plain) for name, ids in rows.items()],
    }


# -- the run --------------------------------------------------------------------------------------


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=64,
        help="target layers (a multiple of 4; the shape's 64 by default)",
    )
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--mode", default="affine", help="affine, mxfp4, mxfp8 or nvfp4")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--acceptance", default="tau=6.5,random", help="engine arms besides plain")
    ap.add_argument(
        "--divergence-prompts", type=int, default=16, help="rows of the divergence count (0: none)"
    )
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument(
        "--dtype", default=None, help="activations; default bfloat16 on a GPU, float32 on the CPU"
    )
    ap.add_argument("--skip-baseline", action="store_true", help="no mlx_lm.batch_generate arm")
    ap.add_argument(
        "--budget-s", type=float, default=0, help="start no new measurement after this long"
    )
    ap.add_argument(
        "--resume", action="store_true", help="keep the measurements already in --out, run the rest"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="a tiny hybrid, 4 prompts of 40 tokens, batches 1,2 (CPU)",
    )
    ap.add_argument(
        "--out", required=True, help="the JSON file; the markdown table goes beside it (.md)"
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.prompts, args.context, args.max_tokens, args.batches, args.divergence_prompts = (
            4,
            40,
            8,
            "1,2",
            3,
        )
    if args.layers % 4:
        ap.error("--layers must be a multiple of 4 (three linear-attention layers, then one full)")
    return args


def main(argv=None) -> Path:
    args = parse(argv)
    gpu = mx.default_device() == mx.gpu
    dtype = getattr(mx, args.dtype or ("bfloat16" if gpu else "float32"))
    quant = {"mode": args.mode, "group_size": args.group_size, "bits": args.bits}
    shape = tiny_hybrid() if args.smoke else qwen35_27b(args.layers)
    setup = build_setup(shape, dtype, quant)
    engine_setup = engine_copy(setup, quant)
    prompts = job_prompts(args.prompts, args.context, setup.vocab_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": "python -m benchmarks.quantized "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {
            "device": str(mx.default_device()),
            "platform": platform.platform(),
            "mlx": mx.__version__,
            "device_info": {k: str(v) for k, v in (mx.device_info() if gpu else {}).items()},
        },
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "shape": shape.name,
        "unverified": shape.unverified,
        "quantization": quant,
        "dtype": str(dtype),
        "target_gb": round(setup.target_bytes / 1e9, 2),
        "prompts": args.prompts,
        "context": args.context,
        "max_tokens": args.max_tokens,
        "results": [],
        "divergence": None,
    }
    if args.resume and out.exists():
        old = json.loads(out.read_text())
        doc["results"], doc["divergence"] = (
            [r for r in old["results"] if r["status"] == "ok"],
            old.get("divergence"),
        )
    done = {(r["arm"], r["batch"]) for r in doc["results"]}
    started = time.perf_counter()

    def over_budget() -> bool:
        return bool(args.budget_s) and time.perf_counter() - started > args.budget_s

    def record(arm: str, B: int, run: Callable[[list, int], Dict[str, Any]]) -> None:
        if (arm, B) in done or over_budget():
            return
        arms.record(doc, lambda d: write(d, out), arm, B, run, prompts, args.reps, args.max_tokens)

    for B in [int(b) for b in args.batches.split(",")]:
        if not args.skip_baseline:
            with arms.zeroed_final_norm(setup.model):  # the same compute; token 0 every step
                record("mlx_lm.batch_generate", B, lambda job, n: run_mlx_lm(setup, job, n, B))
        for acceptance in ["plain"] + args.acceptance.split(","):
            engine, zeroed = engine_arm(setup, engine_setup, acceptance)
            with zeroed:
                record(
                    f"dflash {acceptance}",
                    B,
                    lambda job, n, engine=engine: run_engine(engine, job, n, B),
                )
            del engine
    if args.divergence_prompts and doc["divergence"] is None and not over_budget():
        arms.release()
        batch = max(int(b) for b in args.batches.split(","))
        doc["divergence"] = divergence(
            setup, engine_setup, prompts[: args.divergence_prompts], args.max_tokens, batch
        )
    doc["wall_s"] = round(time.perf_counter() - started, 1)
    write(doc, out)
    print(out)
    return out


def write(doc: dict, out: Path) -> None:
    out.write_text(json.dumps(doc, indent=1))
    out.with_suffix(".md").write_text(table(doc))


def table(doc: dict) -> str:
    """Markdown: whole-job tok/s per arm and batch size (and the ratio to batch_generate at that
    B), the verify widths each drafting arm chose, and the divergence count."""
    rows: Dict[str, Dict[int, dict]] = {}
    for r in doc["results"]:
        if r["status"] == "ok":
            rows.setdefault(r["arm"], {})[r["batch"]] = r["figures"]
    batches = sorted({r["batch"] for r in doc["results"]})
    base = rows.get("mlx_lm.batch_generate", {})
    lines = [
        f"`{doc['command']}` ({doc['machine']['device']}, {doc['shape']}, {doc['quantization']})",
        "",
        "| arm | " + " | ".join(f"B={b}" for b in batches) + " |",
        "|---" * (len(batches) + 1) + "|",
    ]
    for arm, by_b in rows.items():
        cells = []
        for b in batches:
            f = by_b.get(b)
            cell = "" if f is None else f"{f['tok_s']:.1f}"
            if f is not None and arm != "mlx_lm.batch_generate" and b in base:
                cell += f" ({f['tok_s'] / base[b]['tok_s']:.2f}x)"
            cells.append(cell)
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Verify widths chosen (width: cycles, mean ms a cycle):", ""]
    for arm, by_b in rows.items():
        for b, f in sorted(by_b.items()):
            if "cycles" in f:
                widths = ", ".join(
                    f"T={T}: {c['cycles']} x {c['ms']} ms" for T, c in f["cycles"].items()
                )
                lines.append(f"- {arm}, B={b}: {widths}")
    d = doc.get("divergence")
    if d:
        lines += [
            "",
            f"Rows identical to mlx-lm's plain decoding at batch 1 ({d['max_tokens']} tokens, "
            f"the target's own greedy output):",
            "",
        ]
        lines += [
            f"- {p['pair']}: {p['identical']} of {p['rows']} (median first difference "
            f"{p['first_difference_median']})"
            for p in d["pairs"]
        ]
    errors = [
        f"- {r['arm']}, B={r['batch']}: {r['figures']['error']}"
        for r in doc["results"]
        if r["status"] != "ok"
    ]
    if errors:
        lines += ["", "Errors:", ""] + errors
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
