"""The CPU ops (engine/ops/kernels/cpu.py) against MLX's own, in one process: ``python -m benchmarks.cpu_ops``.

Three measures, each the median of ``--reps`` runs after a warm-up, the two arms alternating
(the verify passes fill the same cache columns each time: what they hold does not change the cost):

  ops       each op alone at the shapes a verify pass of the default pair gives it: softmax and
            logsumexp over 30 layers x 144 rows x ``--context`` keys, SwiGLU over 30 layers x
            16 rows x 1,536
  verify    one verify pass of the default pair's target at batch 1, rows holding ``--context``
            tokens, per width T, with the ops and with ``DFLASH_BATCH_CPU_OPS=mlx``'s
  prefill   the engine's prefill of a ``--prefill``-token prompt with and without the ops (in
            its own chunks, or ``--prefill-chunk``), and ``mlx_lm.stream_generate``'s (its
            prompt_tps) on the same tokens

and whether each pair of outputs is identical (the ops are MLX's, bit for bit).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import dflash_batch.engine  # noqa: F401  (BLAS preload before mlx on Linux CPU)
from dflash_batch.engine import decode, load_engine, load_target, pick_dtype
from dflash_batch.engine.ops import switch
from dflash_batch.engine.ops.batch_cache import Lengths
from dflash_batch.engine.ops.kernels import cpu

import mlx.core as mx
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from .default_pair import command_line, write_result


def arms(native, mlx, reps: int) -> dict:
    """Two ways to one array, timed after a warm-up of each, alternating: the median ms of each,
    and whether their outputs are identical."""
    fns, outs, times = {"native": native, "mlx": mlx}, {}, {"native": [], "mlx": []}
    for rep in range(reps + 1):
        for arm, fn in fns.items():
            started = time.perf_counter()
            outs[arm] = fn()
            mx.eval(outs[arm])
            if rep:  # the first round warms up
                times[arm].append(time.perf_counter() - started)
    return {
        "native_ms": round(1e3 * statistics.median(times["native"]), 2),
        "mlx_ms": round(1e3 * statistics.median(times["mlx"]), 2),
        "identical": mx.array_equal(outs["native"], outs["mlx"]).item(),
    }


def in_mode(mode: str, fn):
    """``fn`` run with the CPU ops in ``mode``."""

    def run():
        with switch.modes(cpu_ops=mode):
            return fn()

    return run


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="target folder (default: the embedded default pair's)")
    ap.add_argument("--context", type=int, default=300, help="tokens the rows hold")
    ap.add_argument("--widths", default="1,4,8,16")
    ap.add_argument(
        "--prefill", type=int, default=2048, help="prompt tokens of the prefill measure (0: skip)"
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        help="the engine's prefill chunk (default: its own, 512 on a CPU)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)
    if cpu.load() is None:
        raise SystemExit(f"the CPU ops are not available here: {cpu.failure()}")
    key = mx.random.key(0)
    scores = mx.random.normal((30 * 144, args.context), key=key) * 4
    gate, up = (mx.random.normal((30 * 16, 1536), key=k) for k in mx.random.split(key))
    result = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "ops": {
            "softmax": arms(
                lambda: cpu.softmax(scores),
                lambda: mx.softmax(scores, axis=-1, precise=True),
                args.reps,
            ),
            "logsumexp": arms(
                lambda: cpu.logsumexp(scores),
                lambda: mx.logsumexp(scores, axis=-1, keepdims=True),
                args.reps,
            ),
            "swiglu": arms(
                lambda: cpu.swiglu(gate, up), lambda: mlx_lm_swiglu(gate, up), args.reps
            ),
        },
    }
    if args.target:
        folder = args.target
    else:
        from dflash_batch.engine.models.default_model import ensure_default_pair

        folder = ensure_default_pair()[0]
    engine = load_engine(folder, draft=None, prefill_chunk=args.prefill_chunk)
    target = engine.target
    lengths = Lengths([0])
    cache = target.make_cache(lengths, args.context + 64)
    decode.prefill(target, [i % 5000 + 100 for i in range(args.context)], cache, lengths, 256)
    result["verify"] = {
        f"T={T}": arms(
            *(
                in_mode(m, lambda T=T: target.verify(mx.array([[5] * T]), cache)[0])
                for m in ("native", "mlx")
            ),
            args.reps,
        )
        for T in (int(w) for w in args.widths.split(","))
    }
    if args.prefill:
        from mlx_lm import stream_generate

        prompt = [i % 5000 + 100 for i in range(args.prefill)]
        seconds = {"native": [], "mlx": []}
        for _ in range(2):
            for mode in seconds:
                engine.settings = dataclasses.replace(
                    engine.settings, cpu_ops=mode
                )  # read at each run
                seconds[mode].append(engine.generate(prompt, max_tokens=1).stats.prefill_s)
        model, tokenizer, _ = load_target(folder, None, pick_dtype("auto"))
        with switch.stock_ops():
            lm = [
                args.prefill / r.prompt_tps
                for _ in range(2)
                for r in stream_generate(model, tokenizer, prompt, max_tokens=1)
            ]
        result["prefill"] = {
            "tokens": args.prefill,
            "chunk": engine.prefill_chunk,
            "native_s": round(min(seconds["native"]), 3),
            "mlx_s": round(min(seconds["mlx"]), 3),
            "mlx_lm_s": round(min(lm), 3),
        }
    result["command"] = command_line("cpu_ops", argv)
    write_result(result, args.out)
    return result


if __name__ == "__main__":
    main()
