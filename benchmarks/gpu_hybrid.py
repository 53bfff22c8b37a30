"""GatedDeltaNet tape kernels on an NVIDIA GPU: correctness against the reference, and speed.

Run on a machine with ``mlx[cuda13]`` from the project root (PYTHONPATH=.):

    python benchmarks/gpu_hybrid.py [--out results.json] [--context 2048] [--iters 20]

1. Kernels at Qwen3.5-9B shapes (Hk 16, Hv 32, Dk = Dv = 128, T 16, bf16 inputs): CUDA against
   the pure-MLX reference (y, state, tape), replay against the recurrence, T steps of one token
   against one T-token call, and against mlx-lm's own ``gated_delta_ops``; per-layer times.
2. A Qwen3.5-9B-shaped model (random weights of the real shapes, bf16) at a prefilled context:
   one decode step, a 16-token verify (tape recorded), and rollback to 1, 8 and 15 kept rows;
   the same verify and decode with mlx-lm's stock GatedDeltaNet for comparison. Every timed pass
   starts from the same cache length, so attention's key length repeats from call to call.
3. Unless --no-growing: cycles as the decode loop runs them (verify 16, keep 4, one decode step),
   so the key length grows every call, with engine/ops/attention.py's routing in "kernel" and
   "stock" modes.

Imports only mlx, mlx_lm and the engine modules it needs (not the package ``__init__``).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
_pkg = types.ModuleType("dflash_batch.engine")  # skip engine/__init__ (tokenizer/hub imports)
_pkg.__path__ = [str(ROOT / "dflash_batch" / "engine")]
sys.modules["dflash_batch.engine"] = _pkg

from dflash_batch.engine.models import hybrid  # noqa: E402
from dflash_batch.engine.models.target import Target  # noqa: E402
from dflash_batch.engine.ops.batch_cache import Lengths  # noqa: E402
from dflash_batch.engine.ops.kernels import gated_delta as gd  # noqa: E402
from dflash_batch.engine.ops.kernels import selfcheck  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models import qwen3_5  # noqa: E402
from mlx_lm.models.gated_delta import gated_delta_ops  # noqa: E402

QWEN35_9B = {
    "model_type": "qwen3_5",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 12288,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 4,
    "rms_norm_eps": 1e-6,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "rope_parameters": {"type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}
TAPS = [1, 8, 15, 22, 29]  # five tapped layers, as a DFlash drafter reads them
IMPL = "cuda"  # --impl reference (with --tiny) dry-runs this script on a CPU
TINY = dict(
    QWEN35_9B,
    hidden_size=128,
    num_hidden_layers=8,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    vocab_size=512,
)


def timed(fn, iters, warmup=3):
    """Median and min wall ms of ``fn()`` (which must evaluate its own outputs)."""
    for _ in range(warmup):
        fn()
    ms = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1e3)
    return {
        "median_ms": round(statistics.median(ms), 4),
        "min_ms": round(min(ms), 4),
        "iters": iters,
    }


def err(a, b):
    """Max |a - b| and that divided by max |b|."""
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    d = mx.abs(a - b).max().item()
    scale = mx.abs(b).max().item()
    return {"max_abs": d, "max_rel": d / scale if scale else d}


def kernel_inputs(B=1, T=16, Hk=16, Hv=32, Dk=128, Dv=128, dtype=mx.bfloat16, seed=0):
    if CONFIG is TINY:
        Hk, Hv, Dk, Dv = 2, 4, 32, 32
    mx.random.seed(seed)
    q = mx.random.normal((B, T, Hk, Dk)) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)  # unit keys, as normalize_qk leaves them
    v = mx.random.normal((B, T, Hv, Dv))
    g = mx.random.uniform(0.8, 1.0, (B, T, Hv))
    beta = mx.sigmoid(mx.random.normal((B, T, Hv)))
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    q, k, v, beta = (x.astype(dtype) for x in (q, k, v, beta))
    mx.eval(q, k, v, g, beta, state)
    return q, k, v, g, beta, state


def unchecked_kernels(report, iters):
    with selfcheck.unchecked():
        return check_kernels(report, iters)


def check_kernels(report, iters):
    out = {}
    q, k, v, g, beta, s0 = kernel_inputs()
    T = k.shape[1]
    y_r, s_r, tape_r = gd.recurrence(q, k, v, g, beta, s0, record=True, impl="reference")
    y_c, s_c, tape_c = gd.recurrence(q, k, v, g, beta, s0, record=True, impl=IMPL)
    mx.eval(y_r, s_r, tape_r, y_c, s_c, tape_c)
    out["cuda_vs_reference"] = {
        "y": err(y_c, y_r),
        "state": err(s_c, s_r),
        "tape": err(tape_c, tape_r),
    }
    y_o, s_o = gated_delta_ops(q, k, v, g, beta, s0)
    out["cuda_vs_mlx_lm_ops"] = {"y": err(y_c, y_o), "state": err(s_c, s_o)}
    _, s_nt, nt = gd.recurrence(q, k, v, g, beta, s0, record=False, impl=IMPL)
    out["no_tape_state_bitwise_equal"] = bool(mx.array_equal(s_nt, s_c).item()) and nt is None

    # One T-token call against T one-token calls (what decoding does): bitwise.
    s, ys = s0, []
    for t in range(T):
        y1, s, _ = gd.recurrence(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            g[:, t : t + 1],
            beta[:, t : t + 1],
            s,
            record=False,
            impl=IMPL,
        )
        ys.append(y1)
    out["stepwise_vs_block_bitwise_equal"] = {
        "y": bool(mx.array_equal(mx.concatenate(ys, axis=1), y_c).item()),
        "state": bool(mx.array_equal(s, s_c).item()),
    }

    # Replay of the first n taped steps against the recurrence stopped after n steps.
    replay = {}
    for n in (0, 1, 5, 8, 15, 16):
        _, s_n, _ = (
            gd.recurrence(
                q[:, :n], k[:, :n], v[:, :n], g[:, :n], beta[:, :n], s0, record=False, impl=IMPL
            )
            if n
            else (None, s0, None)
        )
        r_c = gd.replay(tape_c[:, :n], k[:, :n], g[:, :n], s0, impl=IMPL)
        r_r = gd.replay(tape_r[:, :n], k[:, :n], g[:, :n], s0, impl="reference")
        replay[n] = {
            "cuda_replay_vs_cuda_recurrence_bitwise": bool(mx.array_equal(r_c, s_n).item()),
            "cuda_replay_vs_reference_replay": err(r_c, r_r),
        }
    out["replay"] = replay

    # bf16 state storage: per-step rounding makes replay equal stepwise decoding.
    sb = s0.astype(mx.bfloat16)
    yb_r, sb_r, tb_r = gd.recurrence(q, k, v, g, beta, sb, impl="reference")
    yb_c, sb_c, tb_c = gd.recurrence(q, k, v, g, beta, sb, impl=IMPL)
    s = sb
    for t in range(8):
        _, s, _ = gd.recurrence(
            q[:, t : t + 1],
            k[:, t : t + 1],
            v[:, t : t + 1],
            g[:, t : t + 1],
            beta[:, t : t + 1],
            s,
            record=False,
            impl=IMPL,
        )
    out["bf16_state"] = {
        "cuda_vs_reference": {
            "y": err(yb_c, yb_r),
            "state": err(sb_c, sb_r),
            "tape": err(tb_c, tb_r),
        },
        "replay8_vs_stepwise8_bitwise": bool(
            mx.array_equal(gd.replay(tb_c[:, :8], k[:, :8], g[:, :8], sb, impl=IMPL), s).item()
        ),
    }

    # Per-layer times at this shape.
    def run(fn):
        return lambda: mx.eval(*[x for x in fn() if x is not None])

    times = {}
    for T_ in (1, 16):
        qq, kk, vv, gg, bb = q[:, :T_], k[:, :T_], v[:, :T_], g[:, :T_], beta[:, :T_]
        times[f"cuda_T{T_}_tape"] = timed(
            run(lambda: gd.recurrence(qq, kk, vv, gg, bb, s0, record=True, impl=IMPL)), iters
        )
        times[f"cuda_T{T_}_no_tape"] = timed(
            run(lambda: gd.recurrence(qq, kk, vv, gg, bb, s0, record=False, impl=IMPL)), iters
        )
        times[f"mlx_lm_ops_T{T_}"] = timed(
            run(lambda: gated_delta_ops(qq, kk, vv, gg, bb, s0)), iters
        )
    for n in (1, 8, 15):
        times[f"cuda_replay_{n}"] = timed(
            lambda: mx.eval(gd.replay(tape_c[:, :n], k[:, :n], g[:, :n], s0, impl=IMPL)), iters
        )
    out["per_layer_times"] = times
    report["kernels"] = out


def build_model():
    model = qwen3_5.Model(qwen3_5.ModelArgs.from_dict(CONFIG))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def set_stock(target, stock):
    """Switch every GatedDeltaNet between mlx-lm's class (stock) and the tape class."""
    cls = qwen3_5.GatedDeltaNet if stock else hybrid.TapeGatedDeltaNet
    for layer in target.layers:
        if getattr(layer, "is_linear", False):
            layer.linear_attn.__class__ = cls


def growing_cycles(target, cache, lengths, reset, one, block, iters):
    """Cycles as the DFlash loop runs them: verify 16, roll back to 4 kept rows, so the key length
    grows every call; one decode step per cycle at the same growing length for comparison. With the
    GPU attention issue's routing (engine/ops/attention.py) in each of its modes."""
    from dflash_batch.engine.ops import attention, switch

    attention.install(target.model)
    gdn = [c for c in cache if isinstance(c, hybrid.TapeCache)]
    out = {}
    for mode in ("kernel", "stock"):
        with switch.modes(attention=mode):
            before = attention.counters()
            reset()
            verify_ms, rollback_ms, decode_ms = [], [], []
            n = iters if mode == "kernel" else max(4, iters // 3)
            for i in range(n + 2):
                t0 = time.perf_counter()
                logits, h = target.verify(block, cache)
                mx.eval(logits, h)
                t1 = time.perf_counter()
                target.rollback(cache, [4])
                lengths.advance([4])
                mx.eval([c[0] for c in gdn], [c[1] for c in gdn])
                t2 = time.perf_counter()
                logits, h = target(one, cache)
                lengths.advance([1])
                mx.eval(logits, h)
                t3 = time.perf_counter()
                if i >= 2:
                    verify_ms.append((t1 - t0) * 1e3)
                    rollback_ms.append((t2 - t1) * 1e3)
                    decode_ms.append((t3 - t2) * 1e3)
            after = attention.counters()
            med = {
                k: round(statistics.median(x), 4)
                for k, x in (
                    ("verify_16", verify_ms),
                    ("rollback_keep_4", rollback_ms),
                    ("decode_step", decode_ms),
                )
            }
            out[mode] = dict(
                med,
                iters=n,
                verify16_over_decode_step=round(med["verify_16"] / med["decode_step"], 3),
                rollback_over_verify=round(med["rollback_keep_4"] / med["verify_16"], 4),
                attention_calls={k: after[k] - before[k] for k in after},
            )
    reset()
    return out


def check_model(report, context, iters, growing=True):
    out = {
        "shape": "Qwen3.5-9B-like (random weights, real shapes), bf16",
        "config": CONFIG,
        "context": context,
        "taps": TAPS,
    }
    t0 = time.perf_counter()
    model = build_model()
    out["build_s"] = round(time.perf_counter() - t0, 2)
    out["weights_gb"] = round(
        sum(p.nbytes for _, p in __import__("mlx.utils").utils.tree_flatten(model.parameters()))
        / 1e9,
        2,
    )
    target = Target(model, TAPS if CONFIG is QWEN35_9B else [1, 3, 5])
    assert target.hybrid
    lengths = Lengths([0])
    cache = target.make_cache(lengths)
    mx.random.seed(1)
    prompt = mx.random.randint(0, CONFIG["vocab_size"], (1, context))
    t0 = time.perf_counter()
    for i in range(0, context, 512):  # unarmed prefill: the CUDA kernel without a tape
        logits, h = target(prompt[:, i : i + 512], cache)
        lengths.advance([prompt[:, i : i + 512].shape[1]])
        mx.eval(logits, h)
    out["prefill_s"] = round(time.perf_counter() - t0, 3)
    saved_length = lengths.host
    saved = [(c[0], c[1]) if isinstance(c, hybrid.TapeCache) else None for c in cache]

    def reset():  # back to the prompt: attention rows past it are unseen, recurrent states restored
        lengths.set(saved_length)
        for c, arrays in zip(cache, saved):
            if arrays is not None:
                c.disarm()
                c[0], c[1] = arrays

    one = prompt[:, -1:]
    block = prompt[:, -16:]

    def decode():
        logits, h = target(one, cache)
        mx.eval(logits, h)
        reset()

    def verify():
        logits, h = target.verify(block, cache)
        mx.eval(logits, h)
        reset()

    res = {}
    res["decode_step"] = timed(decode, iters)
    res["verify_16"] = timed(verify, iters)

    # Rollback: verify (untimed), then time trim + evaluation of every rolled-back state.
    for keep in (1, 8, 15, 16):
        ms = []
        for i in range(iters + 2):
            logits, h = target.verify(block, cache)
            mx.eval(
                logits, h, [x for c in cache if isinstance(c, hybrid.TapeCache) for x in c.tape]
            )
            t1 = time.perf_counter()
            target.rollback(cache, [keep])
            mx.eval(
                [c[1] for c in cache if isinstance(c, hybrid.TapeCache)],
                [c[0] for c in cache if isinstance(c, hybrid.TapeCache)],
            )
            if i >= 2:
                ms.append((time.perf_counter() - t1) * 1e3)
            reset()
        res[f"rollback_keep_{keep}"] = {
            "median_ms": round(statistics.median(ms), 4),
            "min_ms": round(min(ms), 4),
            "iters": iters,
        }

    # mlx-lm's stock GatedDeltaNet (a Python loop over tokens on CUDA), same cache, no tape.
    set_stock(target, True)
    res["stock_decode_step"] = timed(decode, iters)

    def stock_verify():
        logits, h = target(block, cache)
        mx.eval(logits, h)
        reset()

    res["stock_verify_16"] = timed(stock_verify, max(5, iters // 2))
    set_stock(target, False)

    if growing:
        out["growing"] = growing_cycles(target, cache, lengths, reset, one, block, iters)

    v, d, sd = (
        res["verify_16"]["median_ms"],
        res["decode_step"]["median_ms"],
        res["stock_decode_step"]["median_ms"],
    )
    out["times"] = res
    out["verify16_over_decode_step"] = round(v / d, 3)
    out["verify16_over_stock_decode_step"] = round(v / sd, 3)
    out["stock_verify16_over_stock_decode_step"] = round(
        res["stock_verify_16"]["median_ms"] / sd, 3
    )
    out["rollback_over_verify"] = {
        k: round(res[f"rollback_keep_{k}"]["median_ms"] / v, 4) for k in (1, 8, 15, 16)
    }
    report["model"] = out


def _gpu_name():
    import subprocess

    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except Exception as e:
        return f"unknown ({e})"


CONFIG = QWEN35_9B


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu_hybrid.json")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--skip-kernels", action="store_true")
    p.add_argument("--no-growing", action="store_true", help="skip the growing-key-length cycles")
    p.add_argument("--impl", default="cuda", help="reference: dry run on a CPU")
    p.add_argument("--tiny", action="store_true", help="a tiny model of the same layout (dry run)")
    a = p.parse_args()
    global IMPL, CONFIG
    IMPL, CONFIG = a.impl, (TINY if a.tiny else QWEN35_9B)
    report = {
        "command": " ".join(sys.argv),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "mlx": mx.__version__,
        "python": platform.python_version(),
        "device": mx.device_info() if hasattr(mx, "device_info") else str(mx.default_device()),
        "backend": gd.backend(),
        "gpu": _gpu_name(),
    }
    # the kernels section compares the raw kernels with the reference itself: no self-check there,
    # which would put the reference in place of a kernel that fails it
    steps = [] if a.skip_kernels else [("kernels", lambda: unchecked_kernels(report, a.iters))]
    if not a.skip_model:
        steps.append(
            ("model", lambda: check_model(report, a.context, a.iters, growing=not a.no_growing))
        )
    for name, step in steps:
        try:
            step()
        except Exception as e:  # keep what was measured; say what failed
            import traceback

            report[f"{name}_error"] = traceback.format_exc()[-4000:]
            print(f"{name} failed: {e}", file=sys.stderr)
        Path(a.out).write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
