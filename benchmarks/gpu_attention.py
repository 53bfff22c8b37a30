"""GPU check and benchmark of the two-pass block attention (issue 3), on CUDA (or Metal).

    python -m benchmarks.gpu_attention --out gpu_attention.json [--sections check,micro,verify,cycle]

Sections (the JSON is rewritten after each, so a cut-off run keeps what it finished):
  check   kernels vs the MLX reference on random data: head dims 64/128/256, GQA 1-8, causal,
          bidirectional, sliding window, left padding, bf16/fp16/fp32, strided cache views; the
          default kernel and its other forms (CUDA-core, tensor-core with pass 2, one chunk, ...)
  micro   ms per call with the key length growing every call (the DFlash pattern): stock SDPA
          vs the kernel at the Qwen3-4B attention shape (32 / 8 heads, dim 128, 16 rows)
  verify  Qwen3-4B-shaped bf16 target, random weights, context 2048: AR decode steps and
          16-token verify passes with a growing cache, in alternation (one AR step, then one
          pass per kernel variant, 60 times); medians of the per-pair ratios
  cycle   full DFlash cycles with every block accepted (zeroed tied embedding: target and
          drafter both always pick token 0) per kernel variant vs mlx_lm AR tok/s on the same
          model, 5 rotated rounds; phase times
  tune    tensor-core kernel configurations and chunk counts, the op chained 36 times per graph
  profile where a verify pass's time goes: the pass with the routed op replaced by nothing
          (attention output = q), and the op alone called 36 times in one graph (host and GPU
          cost per call together); kernel times from the CUDA profiler when PyTorch is present

Imports only mlx, mlx_lm, numpy and the engine (the GPU machine has nothing else).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from datetime import datetime, timezone

import dflash_batch.engine  # noqa: F401  (preloads a fast BLAS before mlx on Linux CPU)
from dflash_batch.engine.ops import attention as routing
from dflash_batch.engine.ops import switch
from dflash_batch.engine.ops.kernels import attention as ka

import mlx.core as mx

from benchmarks.shapes import SHAPES, build_drafter, build_target

TOL = {"bfloat16": 1.6e-2, "float16": 2e-3, "float32": 2e-5}  # as in tests/test_attention.py
DT = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

# (B, H, Hk, Lq, Lk, D, dtype, causal, window, kv_start)
CHECK_CASES = [
    (1, 32, 8, 16, 2048, 128, "bfloat16", True, None, None),
    (1, 32, 8, 16, 2051, 128, "float16", True, None, None),
    (1, 32, 8, 16, 2049, 128, "float32", True, None, None),
    (1, 32, 8, 16, 2049, 128, "bfloat16", False, None, None),
    (1, 16, 8, 16, 777, 64, "bfloat16", False, None, None),
    (1, 16, 8, 3, 777, 64, "bfloat16", True, None, None),
    (2, 8, 2, 16, 300, 256, "bfloat16", True, 64, None),
    (1, 16, 2, 16, 1500, 256, "bfloat16", False, None, None),
    (3, 32, 8, 16, 500, 128, "bfloat16", True, None, [0, 100, 480]),
    (1, 8, 8, 16, 16, 128, "bfloat16", True, None, None),
    (4, 32, 8, 16, 4096, 128, "bfloat16", True, None, None),
    (1, 64, 8, 16, 8192, 128, "bfloat16", True, None, None),
]


def now_ms() -> float:
    return time.perf_counter() * 1e3


def timed(fn) -> float:
    mx.synchronize()
    t0 = now_ms()
    mx.eval(fn())
    mx.synchronize()
    return now_ms() - t0


def summary(ts, skip=3):
    rest = ts[skip:] if len(ts) > skip else ts
    return {
        "median_ms": round(statistics.median(rest), 3),
        "max_ms": round(max(rest), 3),
        "first_ms": round(ts[0], 1),
    }


def qkv(B, H, Hk, Lq, Lk, D, dtype, cap, seed=0):
    mx.random.seed(seed)
    q = mx.random.normal((B, H, Lq, D)).astype(dtype)
    kb = mx.random.normal((B, Hk, cap, D)).astype(dtype)
    vb = mx.random.normal((B, Hk, cap, D)).astype(dtype)
    mx.eval(q, kb, vb)
    return q, kb, vb


def section_check():
    rows = []
    for B, H, Hk, Lq, Lk, D, dt, causal, window, starts in CHECK_CASES:
        dtype = DT[dt]
        q, kb, vb = qkv(B, H, Hk, Lq, Lk, D, dtype, cap=Lk + 100, seed=Lk)
        k, v = kb[:, :, :Lk], vb[:, :, :Lk]
        kv_start = None if starts is None else mx.array(starts, dtype=mx.int32)
        kw = dict(scale=D**-0.5, causal=causal, window=window, kv_start=kv_start)
        t0 = now_ms()
        got = ka.block_attention_kernel(q, k, v, **kw)
        mx.eval(got)
        first = now_ms() - t0
        others = {
            "cuda_cores": ka.block_attention_kernel(
                q, k, v, config=ka.kernel_config("cuda", D), **kw
            )
        }
        if dtype != mx.float32:  # the tensor-core kernel serves bf16 / fp16: its other forms
            others["mma_pass2"] = ka.block_attention_kernel(
                q, k, v, config=ka.mma_config(D, fused=False), **kw
            )
            others["mma_2warps_one_chunk"] = ka.block_attention_kernel(
                q, k, v, config=ka.mma_config(D, 2), splits=1, **kw
            )
            others["mma_fused_many_chunks"] = ka.block_attention_kernel(
                q, k, v, config=ka.mma_config(D, fused=True), splits=40, **kw
            )
        ref = ka.block_attention_reference(q, k, v, **kw)
        with mx.stream(mx.cpu):  # fp32 oracle on the CPU: GPU fp32 matmuls may round through TF32
            exact = ka.block_attention_reference(
                q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), **kw
            )
            mx.eval(exact)
        err = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        err_exact = mx.abs(got.astype(mx.float32) - exact).max().item()
        ref_exact = mx.abs(ref.astype(mx.float32) - exact).max().item()
        rows.append(
            {
                "case": dict(
                    B=B,
                    H=H,
                    Hk=Hk,
                    Lq=Lq,
                    Lk=Lk,
                    D=D,
                    dtype=dt,
                    causal=causal,
                    window=window,
                    kv_start=starts,
                ),
                "max_abs_err_vs_reference": err,
                "kernel_vs_fp32_exact": err_exact,
                "reference_vs_fp32_exact": ref_exact,
                "tolerance": TOL[dt],
                # pass: within the dtype's tolerance of the GPU reference, or (fp32) of the CPU oracle
                "ok": bool(min(err, err_exact) < TOL[dt]) and not bool(mx.isnan(got).any().item()),
                "first_call_ms": round(first, 1),
            }
        )
        for name, x in others.items():
            e = mx.abs(x.astype(mx.float32) - ref.astype(mx.float32)).max().item()
            e2 = mx.abs(x.astype(mx.float32) - exact).max().item()
            rows[-1][f"{name}_vs_reference"] = e
            rows[-1]["ok"] = (
                rows[-1]["ok"] and bool(min(e, e2) < TOL[dt]) and not bool(mx.isnan(x).any().item())
            )
        print(json.dumps(rows[-1]), flush=True)
    return {"cases": rows, "all_ok": all(r["ok"] for r in rows)}


def grow(fn, L0, n, cap_kb, cap_vb, q):
    """Per-call ms with key length L0, L0+1, ... (the live slice of a fixed buffer)."""
    ts = []
    for i in range(n):
        L = L0 + i
        k, v = cap_kb[:, :, :L], cap_vb[:, :, :L]
        ts.append(timed(lambda: fn(q, k, v)))
    return ts


def section_micro(with_tuning=False):
    H, Hk, D, Lq = 32, 8, 128, 16
    out = {}
    scale = D**-0.5
    stock_causal = lambda q, k, v: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=scale, mask="causal"
    )  # noqa: E731
    stock_full = lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)  # noqa: E731
    kern_causal = lambda q, k, v: ka.block_attention_kernel(q, k, v, scale=scale, causal=True)  # noqa: E731
    kern_full = lambda q, k, v: ka.block_attention_kernel(q, k, v, scale=scale, causal=False)  # noqa: E731
    for L0 in (2048, 8192, 32768):
        q, kb, vb = qkv(1, H, Hk, Lq, L0, D, mx.bfloat16, cap=L0 + 64)
        n = 30 if L0 == 2048 else 12
        res = {
            "kernel_causal_growing": summary(grow(kern_causal, L0, n, kb, vb, q)),
            "kernel_bidirectional_growing": summary(grow(kern_full, L0, n, kb, vb, q)),
            "stock_causal_fixed": summary(
                [timed(lambda: stock_causal(q, kb[:, :, :L0], vb[:, :, :L0])) for _ in range(n)]
            ),
        }
        if L0 == 2048:
            res["stock_causal_growing"] = summary(grow(stock_causal, L0, 15, kb, vb, q))
            res["stock_bidirectional_growing"] = summary(grow(stock_full, L0, 15, kb, vb, q))
            q1 = q[:, :, :1]
            res["stock_1row_growing"] = summary(
                grow(lambda q, k, v: stock_full(q1, k, v), L0, 15, kb, vb, q)
            )
        if with_tuning and L0 <= 8192:
            res["tuning"] = tuning(q, kb, vb, L0, scale)
        out[f"ctx{L0}"] = res
        print(json.dumps({f"ctx{L0}": res}), flush=True)
    return out


def tuning(q, kb, vb, L0, scale):
    """Median ms (growing key length) of other pass-1 shapes and chunk counts, for retuning."""
    B, H, Lq, D = q.shape
    Hk = kb.shape[1]
    base = ka.kernel_config("cuda" if ka.gpu_backend() == "cuda" else "metal", D)
    out = {}
    for warps in (4, 2, 8):
        cfg = ka.KernelConfig(
            warps, base.rows_per_warp, base.dim_groups, base.k_tile_dims, base.v_in_smem, D
        )
        rw = cfg.rows_per_warp
        auto = ka.split_count(Lq, L0, H, Hk, B, cfg.rows, None)
        for factor in (0.5, 1, 2):
            splits = max(1, int(auto * factor))
            fn = lambda q, k, v: ka.block_attention_kernel(
                q, k, v, scale=scale, config=cfg, splits=splits
            )  # noqa: E731
            out[f"nw{warps}_rw{rw}_splits{splits}"] = round(
                statistics.median(grow(fn, L0, 8, kb, vb, q)[2:]), 4
            )
    return out


def prefill(model, cache, n, chunk=2048):
    ids = mx.random.randint(0, 1000, (1, n))
    for i in range(0, n, chunk):
        model(ids[:, i : i + chunk], cache=cache)
        mx.eval([c.state for c in cache])


# Kernel variants timed side by side: (attention mode, USE_MMA, MMA_FUSED).
# "kernel" is what the engine runs by default on CUDA.
VARIANTS = {
    "kernel": ("kernel", True, True),  # tensor-core pass 1, reduction fused: one launch
    "kernel_mma_pass2": ("kernel", True, False),  # tensor-core pass 1, pass 2 its own kernel
    "kernel_cuda_cores": ("kernel", False, True),  # the CUDA-core kernel (v4) and its pass 2
    "stock": ("stock", True, True),
}


@contextmanager
def variant(name):
    mode, use_mma, mma_fused = VARIANTS[name]
    saved = ka.USE_MMA, ka.MMA_FUSED
    ka.USE_MMA, ka.MMA_FUSED = use_mma, mma_fused
    try:
        with switch.modes(attention=mode):
            yield
    finally:
        ka.USE_MMA, ka.MMA_FUSED = saved


def section_verify(model, context, pairs=60):
    """AR decode steps and 16-token verify passes, the cache growing by one per step or pass,
    measured in alternation: each repetition times one AR step, then one verify pass per kernel
    variant (order rotated), so that drift of the machine hits all alike. Reported: the median
    over repetitions of each verify / AR ratio (with quartiles), and the median times."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prefill(model, cache, context)
    x1 = mx.array([[5]])
    x16 = mx.random.randint(0, 1000, (1, 16))

    def verify_pass():
        t = timed(lambda: model(x16, cache=cache))
        for c in cache:
            c.trim(15)  # keep one row: the cache grows by one per pass, like a cycle
        return t

    names = [n for n in VARIANTS if n != "stock"]
    for name in names:  # warm-up: compile every kernel
        with variant(name):
            for _ in range(3):
                verify_pass()
    for _ in range(3):
        timed(lambda: model(x1, cache=cache))
    runs = {name: [] for name in ["ar"] + names}
    for r in range(pairs):
        runs["ar"].append(timed(lambda: model(x1, cache=cache)))
        for name in names[r % len(names) :] + names[: r % len(names)]:
            with variant(name):
                runs[name].append(verify_pass())

    def quartiles(xs):
        q = statistics.quantiles(xs, n=4)
        return {
            "median": round(statistics.median(xs), 3),
            "q1": round(q[0], 3),
            "q3": round(q[2], 3),
        }

    out = {"context": context, "pairs": pairs, "ar_step_ms": quartiles(runs["ar"])}
    for name in names:
        out[f"verify16_ms_{name}"] = quartiles(runs[name])
        out[f"verify_over_ar_{name}"] = quartiles([v / a for v, a in zip(runs[name], runs["ar"])])
    with variant("stock"):  # stock SDPA: a new key length every pass costs tens of ms
        out["verify16_ms_stock_growing"] = round(
            statistics.median(verify_pass() for _ in range(6)), 3
        )
    print(json.dumps(out), flush=True)
    return out


def section_tune(context):
    """ms per call of the op chained 36 times in one graph (host and GPU together, as in a
    forward pass) at the Qwen3-4B attention shape, for tensor-core configurations and chunk
    counts, key length growing by one per repetition; and GPU us per call from the CUDA
    profiler (PyTorch) where present."""
    H, Hk, D, Lq = 32, 8, 128, 16
    q, kb, vb = qkv(1, H, Hk, Lq, context, D, mx.bfloat16, cap=context + 64)
    scale = D**-0.5
    out = {"context": context, "chained_ms_per_call": {}, "gpu_us_per_call": {}}
    for warps in (4, 8):
        for kt, stages in ((16, 2), (16, 3), (32, 2)):
            for fused in (True, False):
                cfg = ka.mma_config(D, warps, fused, kt, stages)
                if cfg.smem_bytes > 200 * 1024:
                    continue
                for splits in (1, 2, 3, 4, 8):

                    def op(x, k, v, cfg=cfg, splits=splits):
                        return ka.block_attention_kernel(
                            x, k, v, scale=scale, causal=True, config=cfg, splits=splits
                        )

                    ts = chained_ms(op, q, kb, vb, context, reps=6)
                    name = f"nw{warps}_kt{kt}_st{stages}_{'fused' if fused else 'pass2'}_splits{splits}"
                    out["chained_ms_per_call"][name] = round(statistics.median(ts[2:]), 4)
                    gpu = gpu_us(
                        lambda: chain(op, q, kb[:, :, : context + 5], vb[:, :, : context + 5]),
                        CHAIN,
                    )
                    if gpu is not None:
                        out["gpu_us_per_call"][name] = gpu
    auto = {}
    default_op = lambda x, k, v: ka.block_attention_kernel(x, k, v, scale=scale, causal=True)  # noqa: E731
    for name in ("kernel", "kernel_cuda_cores"):
        with variant(name):
            ts = chained_ms(default_op, q, kb, vb, context, reps=6)
            auto[name] = {
                "chained_ms_per_call": round(statistics.median(ts[2:]), 4),
                "gpu_us_per_call": gpu_us(
                    lambda: chain(default_op, q, kb[:, :, : context + 5], vb[:, :, : context + 5]),
                    CHAIN,
                ),
            }
    out["defaults"] = auto
    best = sorted(out["chained_ms_per_call"].items(), key=lambda kv: kv[1])[:8]
    out["fastest_chained"] = best
    print(json.dumps(out), flush=True)
    return out


def gpu_us(fn, calls):
    """GPU us per call of the dflash kernels that ``fn`` runs (CUDA profiler), or None."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except Exception:  # noqa: BLE001
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        mx.eval(fn())
        mx.synchronize()
    total = 0.0
    for ev in prof.key_averages():
        if "dflash" in ev.key:
            total += getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
    return round(total / calls, 2)


CHAIN = 36  # attention calls per graph in the chained timings: one per layer of Qwen3-4B


def chain(op, q, k, v):
    """``op`` applied CHAIN times in one graph, each call on the previous call's output."""
    x = q
    for _ in range(CHAIN):
        x = op(x, k, v)
    return x


def chained_ms(op, q, kb, vb, context, reps, grow=True):
    """ms per call of ``chain`` (host and GPU together, as in a forward pass), one time per
    repetition; repetition i reads context + i keys (grow) or always context."""
    ts = []
    for i in range(reps):
        L = context + i if grow else context
        ts.append(timed(lambda: chain(op, q, kb[:, :, :L], vb[:, :, :L])) / CHAIN)
    return ts


def section_profile(model, context):
    from mlx_lm.models.cache import make_prompt_cache

    out = {}
    cache = make_prompt_cache(model)
    prefill(model, cache, context)
    x16 = mx.random.randint(0, 1000, (1, 16))
    real = ka.block_attention_kernel

    def verify_growing(n=15):
        ts = []
        for _ in range(n):
            ts.append(timed(lambda: model(x16, cache=cache)))
            for c in cache:
                c.trim(15)
        for c in cache:
            c.trim(n)
        return summary(ts)

    variants = {
        "kernel": real,
        "no_attention": lambda q, k, v, **kw: q,  # the rest of the pass alone
        "one_elementwise_op": lambda q, k, v, **kw: q * 1,  # one launch in place of the op
    }
    for name, fn in variants.items():
        ka.block_attention_kernel = fn
        try:
            with variant("kernel"):
                verify_growing(4)  # warm-up
                out[f"verify16_growing_{name}"] = verify_growing()
        finally:
            ka.block_attention_kernel = real
    with variant("stock"):
        out["verify16_fixed_stock"] = summary(
            [timed(lambda: _fixed(model, cache, x16)) for _ in range(12)]
        )

    # the op alone: 36 chained calls (one per layer of the shape) in one graph
    H, Hk, D, Lq = 32, 8, 128, 16
    q, kb, vb = qkv(1, H, Hk, Lq, context, D, mx.bfloat16, cap=context + 64)
    scale = D**-0.5
    ops = {
        "kernel": lambda q, k, v: ka.block_attention_kernel(q, k, v, scale=scale, causal=True),
        "stock_fixed_length": lambda q, k, v: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask="causal"
        ),
        "elementwise": lambda q, k, v: q * 1,
    }
    for name, op in ops.items():
        ts = chained_ms(op, q, kb, vb, context, reps=8, grow=name != "stock_fixed_length")
        out[f"chained36_per_call_{name}"] = summary(ts, skip=2)
    for splits in (4, 8, 16, 32, 64):

        def op(x, k, v, splits=splits):
            return ka.block_attention_kernel(x, k, v, scale=scale, causal=True, splits=splits)

        out[f"chained36_per_call_kernel_splits{splits}"] = summary(
            chained_ms(op, q, kb, vb, context, reps=8), skip=2
        )
    out["cuda_profile"] = torch_profile(model, cache, x16)
    print(json.dumps(out), flush=True)
    return out


def _fixed(model, cache, x):
    y = model(x, cache=cache)
    for c in cache:
        c.trim(x.shape[1])
    return y


def torch_profile(model, cache, x16):
    """GPU time per kernel name over 5 verify passes, from PyTorch's CUDA profiler (CUPTI sees
    every kernel of the process, MLX's included); None when PyTorch is not installed."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except Exception as e:  # noqa: BLE001
        return {"skipped": f"{type(e).__name__}: {e}"}
    torch.cuda.init()
    res = {}
    for label in ("kernel", "kernel_cuda_cores"):
        with variant(label), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                mx.eval(model(x16, cache=cache))
                for c in cache:
                    c.trim(15)
            mx.synchronize()
        rows = []
        for ev in prof.key_averages():
            us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
            rows.append((us, ev.key, ev.count))
        rows.sort(reverse=True)
        res[label] = [
            {"name": k[:90], "total_us_5_passes": round(us, 1), "calls": n}
            for us, k, n in rows[:25]
            if us > 0
        ]
    return res


def greedy_cycles(target, drafter, prompt, max_tokens, block=16):
    """One sequence through the engine's cycle functions (greedy, whole blocks): yields the
    tokens each cycle commits, after the prefill's first one."""
    from dflash_batch.engine import decode
    from dflash_batch.engine.ops.batch_cache import Lengths

    lengths, draft_lengths = Lengths([0]), Lengths([0])
    cache, dcache = target.make_cache(lengths), drafter.make_cache(draft_lengths)
    logits, context = decode.prefill(target, prompt, cache, lengths, 2048)
    last = mx.argmax(logits, axis=-1).astype(mx.int32)
    produced = 1
    while produced < max_tokens:
        L = min(block, max_tokens - produced)
        drafted = decode.draft_block(drafter, target, last, context, None, dcache, L - 1)
        draft_lengths.advance([context.shape[1]])
        logits, hidden = target.verify(mx.concatenate([last, drafted], axis=1), cache)
        chosen = mx.argmax(logits, axis=-1)
        a = decode.accept_lengths(drafted.tolist(), chosen.tolist(), [L])[0]
        target.rollback(cache, [a + 1])
        lengths.advance([a + 1])
        context, last = hidden[:, : a + 1, :], chosen[:, a : a + 1].astype(mx.int32)
        produced += a + 1
        yield a + 1


def dflash_rate(target, drafter, prompt, max_tokens):
    """Tokens per second of the cycles after the first (the prefill and the first cycle untimed)."""
    committed = greedy_cycles(target, drafter, prompt, max_tokens)
    next(committed)
    mx.synchronize()
    t0 = time.perf_counter()
    n = cycles = 0
    for k in committed:
        n += k
        cycles += 1
    dt = time.perf_counter() - t0
    return {
        "tok_s": round(n / dt, 1),
        "tokens": n,
        "cycles": cycles,
        "tokens_per_cycle": round(n / cycles, 2),
    }


def mlx_lm_ar_rate(model, prompt, max_tokens):
    from mlx_lm.generate import generate_step

    first = None
    count = 0
    for _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if first is None:
            first = time.perf_counter()
        count += 1
    return {"tok_s": round((count - 1) / (time.perf_counter() - first), 1), "tokens": count}


def cycle_phases(target, drafter, prompt, cycles=20):
    """Per-phase ms of a cycle with syncs between phases (every block accepted)."""
    from dflash_batch.engine.decode import draft_block
    from dflash_batch.engine.decode import prefill as dprefill
    from dflash_batch.engine.ops.batch_cache import Lengths

    lengths, draft_lengths = Lengths([0]), Lengths([0])
    cache, dcache = target.make_cache(lengths), drafter.make_cache(draft_lengths)
    logits, context = dprefill(target, prompt, cache, lengths, 2048)
    last = mx.argmax(logits, axis=-1).astype(mx.int32)
    ph = {"draft": [], "verify": [], "host_sync": [], "rollback": []}
    for _ in range(cycles):
        t0 = now_ms()
        drafted = draft_block(drafter, target, last, context, None, dcache, 15)
        draft_lengths.advance([context.shape[1]])
        mx.eval(drafted)
        t1 = now_ms()
        logits, hidden = target.verify(mx.concatenate([last, drafted], axis=1), cache)
        mx.eval(logits, hidden)
        t2 = now_ms()
        chosen = mx.argmax(logits, axis=-1)
        d, t = drafted.tolist()[0], chosen.tolist()[0]
        t3 = now_ms()
        a = 0
        while a < len(d) and d[a] == t[a]:
            a += 1
        target.rollback(cache, [a + 1])
        lengths.advance([a + 1])
        context = hidden[:, : a + 1, :]
        last = chosen[:, a : a + 1].astype(mx.int32)
        mx.eval(context, last)
        t4 = now_ms()
        for k, v in zip(ph, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            ph[k].append(v)
    return {k: round(statistics.median(v[3:]), 3) for k, v in ph.items()}


def section_cycle(model, shape, context, rounds=5):
    """DFlash tok/s (every block accepted) for each kernel variant and mlx_lm AR tok/s, in
    interleaved rounds on the same prompt; ratios of medians."""
    from dflash_batch.engine.models.target import Target

    drafter = build_drafter(shape.drafter, shape.target["hidden_size"], mx.bfloat16)
    model.model.embed_tokens.weight = mx.zeros_like(model.model.embed_tokens.weight)  # all logits 0
    mx.eval(model.parameters())
    target = Target(model, tap_ids=drafter.args.target_layer_ids)
    prompt = mx.random.randint(0, 1000, (context,)).tolist()
    out = {"context": context, "rounds": rounds}
    arms = ("kernel", "kernel_cuda_cores")
    for name in arms:
        with variant(name):
            dflash_rate(target, drafter, prompt, 64)  # warm-up
    mlx_lm_ar_rate(model, prompt, 16)  # warm-up
    runs = {name: [] for name in arms + ("mlx_lm_ar",)}
    order = list(arms) + ["mlx_lm_ar"]
    for r in range(rounds):
        for name in (
            order[r % len(order) :] + order[: r % len(order)]
        ):  # rotated: no arm always first
            if name == "mlx_lm_ar":
                runs[name].append(mlx_lm_ar_rate(model, prompt, 257))
            else:
                with variant(name):
                    runs[name].append(dflash_rate(target, drafter, prompt, 513))
        print(json.dumps({k: v[-1] for k, v in runs.items()}), flush=True)
    ar = statistics.median(r["tok_s"] for r in runs["mlx_lm_ar"])
    out["mlx_lm_ar_tok_s"] = {"median": ar, "runs": [r["tok_s"] for r in runs["mlx_lm_ar"]]}
    for name in arms:
        rate = statistics.median(r["tok_s"] for r in runs[name])
        ratios = [d["tok_s"] / a["tok_s"] for d, a in zip(runs[name], runs["mlx_lm_ar"])]
        out[f"dflash_{name}_tok_s"] = {
            "median": rate,
            "runs": [r["tok_s"] for r in runs[name]],
            "tokens_per_cycle": runs[name][0]["tokens_per_cycle"],
        }
        out[f"speedup_{name}_vs_mlx_lm_ar"] = round(rate / ar, 2)  # ratio of medians
        out[f"speedup_{name}_per_round"] = {
            "median": round(statistics.median(ratios), 2),
            "min": round(min(ratios), 2),
            "max": round(max(ratios), 2),
        }
    with variant("kernel"):
        out["phases_kernel_ms"] = cycle_phases(target, drafter, prompt)
    print(json.dumps(out), flush=True)
    with variant("stock"):
        out["dflash_stock"] = dflash_rate(target, drafter, prompt, 129)
    print(json.dumps(out), flush=True)
    return out


def device_name() -> str:
    try:
        info = mx.device_info()
        return str(info.get("device_name") or info.get("name") or info)
    except Exception:  # older MLX
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="check,micro,verify,cycle")
    ap.add_argument("--shape", default="qwen3-4b", help="a Qwen3 shape from benchmarks/shapes.py")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument(
        "--tuning", action="store_true", help="also time other kernel shapes and chunk counts"
    )
    args = ap.parse_args(argv)
    backend = ka.gpu_backend()
    if backend is None:
        sys.exit("needs the CUDA or Metal backend")
    res = {
        "command": "python -m benchmarks.gpu_attention " + " ".join(argv or sys.argv[1:]),
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "backend": backend,
        "device": device_name(),
        "mlx": mx.__version__,
        "python": platform.python_version(),
    }

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    def run(name, fn, *a):
        try:
            res[name] = fn(*a)
        except Exception as e:  # keep the other sections' results
            res[name] = {"error": f"{type(e).__name__}: {e}"}
            print(name, "failed:", res[name]["error"], flush=True)
        save()

    sections = args.sections.split(",")
    if "check" in sections:
        run("check", section_check)
    if "micro" in sections:
        run("micro", section_micro, args.tuning)
    if "tune" in sections:
        run("tune", section_tune, args.context)
    if {"verify", "cycle", "profile"} & set(sections):
        shape = SHAPES[args.shape]
        res["shape"] = args.shape
        model = build_target(shape.target, mx.bfloat16)
        routing.install(model)
        if "verify" in sections:
            run("verify", section_verify, model, args.context)
        if "profile" in sections:
            run("profile", section_profile, model, args.context)
        if "cycle" in sections:
            run("cycle", section_cycle, model, shape, args.context)
    print("done", flush=True)


if __name__ == "__main__":
    main()
