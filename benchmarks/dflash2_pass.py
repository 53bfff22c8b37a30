"""What a DFlash 2 drafter pass costs against a DFlash v1 pass of the same body:
``python -m benchmarks.dflash2_pass``.

Both drafters are built in memory with random weights at one shape (default: a 5-layer,
sliding-window drafter at a 27B-class target's width, bf16): the v1 body, and the same body with
DFlash 2's convolutions around every sublayer and its candidate selector. Each pass is a cycle's
drafter pass as the engine runs it (``decode.draft_block``: the block, the target's head over the
draft rows, then the argmax for v1 or the selector's walk for v2), after ``--context`` rows of
context (compiled where the engine compiles them: engine/ops/compiled.py). Reported per batch size: the median milliseconds of ``--reps`` alternating passes of
each drafter (``v1_ms``, ``v2_ms``), and their ratio. ``--smoke``: tiny shapes, for the CPU and
the tests.

GPU (one H100 or H200):

    python -m benchmarks.dflash2_pass --out docs/benchmarks/dflash2-pass-<gpu>-<date>.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import dflash_batch.engine  # noqa: F401  (preloads a fast CPU BLAS before mlx.core)
from dflash_batch.engine import decode
from dflash_batch.engine.models import dflash2
from dflash_batch.engine.models import drafter as v1
from dflash_batch.engine.ops import compiled
from dflash_batch.engine.ops.batch_cache import Lengths

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .default_pair import command_line, write_result

FULL = dict(hidden=5120, intermediate=17408, heads=32, kv_heads=8, head_dim=128, layers=5, taps=5,
            vocab=248320, window=2048, block=8, rank=256, top_k=16)  # fmt: skip
SMOKE = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, layers=2, taps=2,
             vocab=512, window=16, block=8, rank=16, top_k=8)  # fmt: skip


class HeadOnly:
    """The two pieces of a target a draft pass uses: its embedding and its head."""

    def __init__(self, vocab: int, hidden: int):
        self.embed = nn.Embedding(vocab, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)


def config(s: dict) -> dict:
    return {
        "architectures": [dflash2.ARCHITECTURE], "model_type": "qwen3", "hidden_size": s["hidden"],
        "intermediate_size": s["intermediate"], "num_hidden_layers": s["layers"],
        "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"], "head_dim": s["head_dim"],
        "rms_norm_eps": 1e-6, "vocab_size": s["vocab"], "max_position_embeddings": 262144,
        "rope_parameters": {"rope_theta": 1e7, "rope_type": "default"},
        "layer_types": ["sliding_attention"] * s["layers"], "sliding_window": s["window"],
        "dflash_config": {"block_size": s["block"], "mask_token_id": 1, "target_layer_ids": list(range(s["taps"])),
                          "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": s["rank"],
                          "selector_top_k": s["top_k"]},
    }  # fmt: skip


def build(s: dict, dtype):
    """(v1 drafter, DFlash 2 drafter sharing its body's weights, the target's head)."""
    cfg = config(s)
    second = dflash2.Model(dflash2.ModelArgs.from_config(cfg))
    first = v1.Model(v1.ModelArgs.from_config(cfg))
    for model in (second, first):
        model.set_dtype(dtype)
    mx.random.seed(0)
    weights = [
        (k, (mx.random.normal(v.shape) * 0.02).astype(dtype))
        for k, v in tree_flatten(second.parameters())
    ]
    second.load_weights(weights)
    first.load_weights(
        [(k, v) for k, v in weights if not ("conv" in k or "candidate_selector" in k)]
    )
    target = HeadOnly(s["vocab"], s["hidden"])
    target.embed.set_dtype(dtype)
    target.lm_head.set_dtype(dtype)
    mx.eval(
        first.parameters(),
        second.parameters(),
        target.embed.parameters(),
        target.lm_head.parameters(),
    )
    return first, second, target


def pass_ms(drafter, target, batch: int, context: int, reps: int, s: dict) -> list:
    """Milliseconds of ``reps`` draft passes over a cache of ``context`` rows (each pass from the
    same context: the cache's length is not advanced)."""
    lengths = Lengths([0] * batch)
    cache = drafter.make_cache(
        lengths, compiled.capacity(batch, context + 2 * s["block"])
    )  # as a job allocates it
    width = s["taps"] * s["hidden"]
    dtype = drafter.fc.weight.dtype
    drafter.add_context(mx.random.normal((batch, context, width)).astype(dtype), cache)
    lengths.advance([context] * batch)
    new = mx.random.normal((batch, 3, width)).astype(dtype)
    last = mx.zeros((batch, 1), dtype=mx.int32)
    out = []
    for _ in range(reps + 1):  # the first builds and warms
        t0 = time.perf_counter()
        mx.eval(decode.draft_block(drafter, target, last, new, None, cache, s["block"] - 1))
        out.append((time.perf_counter() - t0) * 1e3)
    return out[1:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, tests)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    shapes = SMOKE if args.smoke else FULL
    dtype = mx.float32 if args.smoke else mx.bfloat16
    context = min(args.context, 32) if args.smoke else args.context
    first, second, target = build(shapes, dtype)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        times = {"v1": [], "v2": []}
        for _ in range(2):  # alternating halves: drift in the device's clock falls on both
            times["v1"] += pass_ms(first, target, batch, context, args.reps // 2 or 1, shapes)
            times["v2"] += pass_ms(second, target, batch, context, args.reps // 2 or 1, shapes)
        row = {"batch": batch, "context": context, "v1_ms": round(statistics.median(times["v1"]), 3),
               "v2_ms": round(statistics.median(times["v2"]), 3)}  # fmt: skip
        row["ratio"] = round(row["v2_ms"] / row["v1_ms"], 3)
        rows.append(row)
        print(row, file=sys.stderr)
    write_result({"command": command_line("dflash2_pass", argv), "device": str(mx.default_device()),
                  "mlx": mx.__version__, "passes": compiled.mode(), "shapes": shapes, "dtype": str(dtype), "rows": rows}, args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
