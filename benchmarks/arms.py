"""The benchmark arms: one function per way of generating, each returning one run's figures.

Every arm gets the same prompt token ids and generates exactly ``max_tokens`` (the benchmark
tokenizer has no EOS). Figures are timed the same way for every arm:

- prefill_s: from the call to the first generated token (prompt pass + first choice);
- decode_s: from the first generated token to the last; decode tok/s = (generated - 1) / decode_s
  per sequence (batch arms also give the aggregate over the batch).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .scripted import AcceptanceScript, ScriptedDrafter, head_rows_of
from .shapes import (
    SHAPES,
    Shape,
    build_drafter,
    build_target,
    build_tokenizer,
    final_norm,
    text_config,
    weight_bytes,
)


class Unsupported(Exception):
    """The arm cannot run on this shape or machine (reported, not a failure of the harness)."""


@dataclass
class Setup:
    """One shape built in memory: target, DFlash drafter, small AR draft and tokenizer."""

    shape: Shape
    model: nn.Module
    tokenizer: Any
    drafter: Optional[nn.Module]
    ar_draft: Optional[nn.Module]
    dtype: mx.Dtype
    target_bytes: int
    drafter_bytes: int

    @property
    def vocab_size(self) -> int:
        return text_config(self.shape.target)["vocab_size"]


def build_setup(name: str, dtype: mx.Dtype, with_ar_draft: bool = True) -> Setup:
    shape = SHAPES[name]
    model = build_target(shape.target, dtype, seed=0)
    hidden = text_config(shape.target)["hidden_size"]
    drafter = build_drafter(shape.drafter, hidden, dtype, seed=1) if shape.drafter else None
    ar_draft = None
    if with_ar_draft and shape.ar_draft and not shape.hybrid:
        ar_draft = build_target(SHAPES[shape.ar_draft].target, dtype, seed=2)
    return Setup(
        shape,
        model,
        build_tokenizer(text_config(shape.target)["vocab_size"]),
        drafter,
        ar_draft,
        dtype,
        weight_bytes(model),
        weight_bytes(drafter) if drafter is not None else 0,
    )


def engine_setup(setup: Setup, model: Optional[nn.Module] = None) -> Setup:
    """The same shape with a second copy of the target (same seed, same weights; ``model``: one
    built otherwise, such as quantized) for the engine, which wraps layers of the model it is
    given; the drafter is shared."""
    if model is None:
        model = build_target(setup.shape.target, setup.dtype, seed=0)
    return dataclasses.replace(setup, model=model, ar_draft=None)


class zeroed_final_norm:
    """Context manager: zero a model's final-norm scale, so every logit is exactly 0 and the
    greedy choice is token 0 (a known continuation). Every pass still does all its work."""

    def __init__(self, *models: Optional[nn.Module]):
        self.norms = [final_norm(m) for m in models if m is not None]
        self.saved: List[mx.array] = []

    def __enter__(self):
        self.saved = [n.weight for n in self.norms]
        for n in self.norms:
            n.weight = mx.zeros_like(n.weight)
        return self

    def __exit__(self, *exc):
        for n, w in zip(self.norms, self.saved):
            n.weight = w


def stock_ops():
    """Context manager for the mlx-lm arms: MLX's own attention and matmul
    (``dflash_batch.engine.stock_ops``; a no-op for an engine tree without routing)."""
    try:
        from dflash_batch.engine import stock_ops as engine_stock_ops
    except ImportError:
        return contextlib.nullcontext()
    return engine_stock_ops()


def attention_mode() -> str:
    """The engine's attention routing for multi-row passes ("stock", "kernel", ...)."""
    try:
        from dflash_batch.engine.ops import attention
    except ImportError:
        return "stock"
    return attention.mode()


def prompt_ids(length: int, vocab_size: int, seed: int = 0) -> List[int]:
    """Seeded random prompt ids (the same ids for every arm of a suite)."""
    key = mx.random.key(seed)
    return mx.random.randint(1, vocab_size, (length,), key=key).tolist()


def _peak_reset() -> None:
    mx.synchronize()
    mx.reset_peak_memory()


def _figures(prompt_tokens, generated, prefill_s, decode_s, **extra) -> Dict[str, Any]:
    out = {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "prefill_tps": prompt_tokens / prefill_s if prefill_s > 0 else 0.0,
        "decode_tps": (generated - 1) / decode_s if decode_s > 0 else 0.0,
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }
    out.update(extra)
    return out


# -- mlx-lm arms ---------------------------------------------------------------------------------


def stream_generate(
    setup: Setup, prompt: List[int], max_tokens: int, draft_model=None, num_draft_tokens: int = 4
):
    """``mlx_lm.stream_generate``: plain, or speculative with a small AR draft model."""
    from mlx_lm import stream_generate as mlx_stream

    kwargs = (
        {"draft_model": draft_model, "num_draft_tokens": num_draft_tokens}
        if draft_model is not None
        else {}
    )
    with stock_ops():
        _peak_reset()
        start = time.perf_counter()
        first, last, from_draft = None, None, 0
        for r in mlx_stream(
            setup.model, setup.tokenizer, mx.array(prompt), max_tokens=max_tokens, **kwargs
        ):
            if first is None:
                first = time.perf_counter()
            last = r
            from_draft += bool(r.from_draft)
        end = time.perf_counter()
    extra = {"mlx_lm_generation_tps": last.generation_tps, "mlx_lm_prompt_tps": last.prompt_tps}
    if draft_model is not None:
        extra.update(
            acceptance_generated=from_draft / last.generation_tokens,
            num_draft_tokens=num_draft_tokens,
        )
    return _figures(len(prompt), last.generation_tokens, first - start, end - first, **extra)


def mlx_speculative(setup: Setup, prompt: List[int], max_tokens: int, num_draft_tokens: int = 4):
    if setup.shape.hybrid:
        raise Unsupported("mlx_lm speculative decoding refuses hybrid (GatedDeltaNet) caches")
    if setup.ar_draft is None:
        raise Unsupported("no small AR draft model for this shape")
    return stream_generate(setup, prompt, max_tokens, setup.ar_draft, num_draft_tokens)


def batch_generate(setup: Setup, prompt: List[int], max_tokens: int, batch: int):
    """``mlx_lm.batch_generate`` over ``batch`` copies of the prompt; tok/s per sequence and total."""
    from mlx_lm import batch_generate as mlx_batch

    with stock_ops():
        _peak_reset()
        start = time.perf_counter()
        resp = mlx_batch(
            setup.model, setup.tokenizer, [list(prompt)] * batch, max_tokens=max_tokens
        )
        wall = time.perf_counter() - start
    s = resp.stats
    per_seq = s.generation_tokens // batch
    decode_s = s.generation_time
    # The aggregate counts every generated token of every row over the generation time.
    return _figures(
        len(prompt),
        per_seq,
        s.prompt_time,
        decode_s,
        batch=batch,
        prefill_tps_total=s.prompt_tps,
        decode_tps_total=s.generation_tokens / decode_s if decode_s > 0 else 0.0,
        wall_s=wall,
        peak_memory_gb_mlx_lm=s.peak_memory,
    )


# -- dflash-batch arms ---------------------------------------------------------------------------


def make_engine(setup: Setup, drafter=None, **options):
    """The engine as a user gets it (its defaults), on the setup's model; ``options`` go to Engine."""
    from dflash_batch.engine import Engine

    return Engine(
        setup.model, setup.tokenizer, drafter, config=text_config(setup.shape.target), **options
    )


def engine_generate(
    engine, prompt: List[int], max_tokens: int, scripted: Optional[ScriptedDrafter] = None
):
    """dflash-batch ``Engine.generate``; figures from its own GenerationStats."""
    _peak_reset()
    c = engine.generate(list(prompt), max_tokens=max_tokens)
    s = c.stats
    out = _figures(s.prompt_tokens, s.generated_tokens, s.prefill_s, s.decode_s)
    out.update(
        cycles=s.cycles,
        tokens_per_cycle=s.tokens_per_cycle,
        acceptance_drafted=s.acceptance_drafted,
        acceptance_generated=s.acceptance_generated,
        acceptance_histogram=s.acceptance_histogram,
        peak_memory_gb=s.peak_memory_gb,
        block_size=s.block_size,
        attention=attention_mode(),
        engine=dict(getattr(engine, "description", {})),
    )
    if scripted is not None:
        # The script assumes the target always picks token 0 (zeroed final norm): check it did.
        out["script_matches_target"] = c.token_ids == [0] * len(c.token_ids)
    return out


def scripted_drafter(setup: Setup, script: AcceptanceScript) -> ScriptedDrafter:
    return ScriptedDrafter(setup.drafter, head_rows_of(setup.model), script, setup.vocab_size)


def cycle_breakdown(engine, prompt: List[int], keep: int, cycles: int = 12) -> Dict[str, float]:
    """Median milliseconds of one DFlash cycle's parts, each synchronised on its own:
    draft (embed + drafter + LM head + argmax), verify (target pass over B rows), rollback
    (keep ``keep`` of the B rows, so the KV length grows like in a real loop)."""
    from dflash_batch.engine.decode import draft_block, prefill
    from dflash_batch.engine.ops.batch_cache import Lengths

    target, drafter, B = engine.target, engine.drafter, engine.block_size
    lengths, draft_lengths = Lengths([0]), Lengths([0])
    cache, dcache = target.make_cache(lengths), drafter.make_cache(draft_lengths)
    _, context = prefill(target, list(prompt), cache, lengths, engine.prefill_chunk)
    last = mx.array([[0]], dtype=mx.int32)
    parts: Dict[str, List[float]] = {"draft_ms": [], "verify_ms": [], "rollback_ms": []}
    for _ in range(cycles + 2):
        t0 = time.perf_counter()
        ids = draft_block(drafter, target, last, context, None, dcache, B - 1)
        draft_lengths.advance([context.shape[1]])
        mx.eval(ids)
        t1 = time.perf_counter()
        logits, hidden = target.verify(mx.concatenate([last, ids], axis=1), cache)
        mx.eval(logits, hidden)
        t2 = time.perf_counter()
        target.rollback(cache, [keep])
        lengths.advance([keep])
        context = hidden[:, :keep, :]
        mx.eval(context, [c.arrays() for c in cache])
        t3 = time.perf_counter()
        for key, seconds in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
            parts[key].append(seconds * 1e3)
    return {k: sorted(v[2:])[len(v[2:]) // 2] for k, v in parts.items()}


def runner_end_to_end(engine, context: int, max_tokens: int, items: int = 4) -> Dict[str, Any]:
    """The whole runner in this process: a JSONL job file in, Parquet rows out, through
    ``dflash_batch.run`` with the given engine. ``items`` prompts of ``context`` tokens (the
    benchmark tokenizer maps each ASCII letter to one token; the ids differ from the other
    arms', the lengths and the compute do not). tok/s = generated tokens / wall time, prefill included."""
    import json as _json
    import random as _random
    import tempfile

    try:
        import pyarrow  # noqa: F401

        import dflash_batch
    except ImportError as e:
        raise Unsupported(f"runner dependencies missing here: {e}")
    rng = _random.Random(context)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.jsonl"
        lines = [
            {
                "id": f"p{i}",
                "prompt": "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(context)),
            }
            for i in range(items)
        ]
        path.write_text("".join(_json.dumps(l) + "\n" for l in lines))
        _peak_reset()
        start = time.perf_counter()
        job = dflash_batch.run(
            str(path),
            engine=engine,
            home=Path(tmp) / "home",
            max_tokens=max_tokens,
            output_dir=str(Path(tmp) / "out"),
        )
        wall = time.perf_counter() - start
        table = job.to_arrow()
        status = job.status()
    rows = table.to_pylist()
    ok = [r for r in rows if r.get("status") == "ok"]
    if len(ok) != items:
        errors = [r.get("error") for r in rows if r.get("status") != "ok"]
        raise RuntimeError(f"runner wrote {len(ok)} ok rows of {items}: {errors[:2]}")
    generated = sum(r["completion_tokens"] for r in ok)

    def mean(key):  # over the rows where the rate is defined (None: nothing to divide by)
        values = [r[key] for r in ok if r[key] is not None]
        return sum(values) / len(values) if values else None

    return {
        "prompt_tokens": mean("prompt_tokens"),
        "items": items,
        "generated_tokens": generated,
        "wall_s": wall,
        "throughput_tps": generated / wall,  # end to end: prefill, decode, runner and Parquet
        "decode_tps": mean("decode_tps"),  # per item, as the rows record it
        "prefill_tps": mean("prefill_tps"),
        "tokens_per_cycle": mean("tokens_per_cycle"),
        "acceptance_drafted": mean("acceptance_drafted"),
        "per_item_s": wall / items,
        "job_state": status.get("state"),
        "peak_memory_gb": mx.get_peak_memory() / 1e9,
    }


# -- measurement -----------------------------------------------------------------------------------


def measure(run, reps: int, warmup: int = 1) -> Dict[str, Any]:
    """Warm up, then ``reps`` timed runs; the median of each numeric figure, and every run's decode tok/s."""
    for _ in range(warmup):
        run()
    runs = [run() for _ in range(reps)]
    median: Dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            vals = sorted(
                r[key] for r in runs if r[key] is not None
            )  # None: a rate undefined in that run
            median[key] = (
                vals[len(vals) // 2]
                if len(vals) % 2
                else (vals[len(vals) // 2 - 1] + vals[len(vals) // 2]) / 2
            )
        else:
            median[key] = value
    median["decode_tps_runs"] = [r["decode_tps"] for r in runs]
    return median


def release() -> None:
    """Free what the last arm left behind (its engine's caches, MLX's buffer cache) before the next:
    an arm must neither run short of memory nor pay for another arm's allocations."""
    gc.collect()
    mx.clear_cache()


WARM_TOKENS = 32  # new tokens per prompt of an arm's warm-up job


def apply_smoke(args, smoke: Dict[str, Any]) -> None:
    """A benchmark's ``--smoke``: its tiny shape and job in place of the options given; and an
    unset ``--dtype`` (where it has one) float32 on the CPU, bfloat16 on a GPU."""
    if args.smoke:
        for key, value in smoke.items():
            setattr(args, key, value)
    if getattr(args, "dtype", "") is None:
        args.dtype = "float32" if mx.default_device() == mx.cpu else "bfloat16"


def median_of(
    run: Callable[[list, int], Dict[str, Any]],
    prompts: list,
    warmup: int,
    reps: int,
    max_tokens: int,
) -> Dict[str, Any]:
    """A warm-up job of the first ``warmup`` prompts, WARM_TOKENS new tokens each (compilation,
    the engine's cost model at this batch size and context: the job's typical context falls in
    the same power of two), then ``reps`` timed runs of the whole job."""
    run(prompts[:warmup], min(WARM_TOKENS, max_tokens))
    runs = [run(prompts, max_tokens) for _ in range(reps)]
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
    out["tok_s_runs"] = [round(r["tok_s"], 1) for r in runs]
    return out


def record(
    doc: Dict[str, Any],
    save: Callable[[Dict[str, Any]], None],
    arm: str,
    B: int,
    run: Callable[[list, int], Dict[str, Any]],
    prompts: list,
    reps: int,
    max_tokens: int,
) -> None:
    """One arm of a whole-job benchmark at batch size ``B`` (``median_of`` its runs, after the last
    arm's memory is released): its figures and peak memory, or its error (the other arms still
    run), appended to ``doc["results"]``; then ``save(doc)`` and the row printed."""
    try:
        release()
        mx.reset_peak_memory()
        figures = median_of(run, prompts, min(B, len(prompts)), reps, max_tokens)
        figures["peak_memory_gb"] = round(mx.get_peak_memory() / 1e9, 2)
        status = "ok"
    except Exception as e:  # reported; the other arms still run
        figures, status = {"error": f"{type(e).__name__}: {e}"}, "error"
    doc["results"].append({"arm": arm, "batch": B, "status": status, "figures": figures})
    save(doc)
    print(json.dumps(doc["results"][-1]), flush=True)
