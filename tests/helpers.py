"""Helpers the tests share, imported from here rather than from conftest or another test
module (huey's tests/base.py is the model)."""

from __future__ import annotations

from pathlib import Path

# MLX and the synthetic models are imported where used: the runner's tests import this module
# through conftest and run without MLX (tests/test_layering.py).


def make_drafter(model_dir: Path, name: str, target_config: dict, **kw) -> Path:
    from tests import synthetic

    folder = model_dir / name
    if not folder.exists():
        synthetic.save_drafter(folder, synthetic.drafter_config(target_config, **kw), seed=kw.get("layers", 2) + 7)
    return folder


def fixed_costs():
    """Pass costs as if measured that no timing changes (``window=0``): an adaptive engine given
    them (``load_engine(cost_model=...)``) chooses the same widths on a busy machine as on an
    idle one."""
    from dflash_batch.engine.scheduler import CostModel

    return CostModel(t0=1.0, t1=0.05, d0=0.5, window=0)


PROMPTS = [
    "Hi",
    "Write a haiku about the sea.",
    "Summarize: The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n# now multiply",
    "12 * 7 = ? Explain step by step.",
    "How are you today? " * 20,
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List three colors."}],
]


def greedy_reference(folder, ids, max_tokens, eos=()):
    """mlx-lm's own greedy decoding of the target from the same prompt ids."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    model, _ = _mlx_model(folder)
    out = []
    for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
        tok = int(tok)
        if tok in eos:
            break
        out.append(tok)
    return out


_MODELS = {}


def _mlx_model(folder):
    from mlx_lm import load as mlx_load

    if folder not in _MODELS:
        _MODELS[folder] = mlx_load(str(folder))
    return _MODELS[folder]


# Very different lengths: 2 to about 400 tokens (and one over a 256-token prefill chunk below).
PROMPTS_B = PROMPTS + ["Tell me everything about the number seven. " * 40, "x"]
MAX_TOKENS = [7, 40, 23, 64, 1, 33, 50, 17, 45]
P_WRONG = [0.0, 0.1, 0.3, 0.7, 0.5, 0.2, 1.0, 0.05, 0.4]  # every acceptance length in some row


def scripted_batch(target, drafter, monkeypatch, prompts=PROMPTS_B[:5], max_tokens=30, **kw):
    """An engine (``kw``: its options), ``prompts`` (default five of very different lengths), their
    greedy outputs of ``max_tokens`` (one budget, or one per prompt) and the scripted drafts: row n's
    are wrong with probability P_WRONG[n] (every acceptance length in some row). Returns (engine,
    script, prompt ids, greedy outputs)."""
    from dflash_batch.engine import load_engine
    from tests.scripting import ScriptedDrafts

    engine = load_engine(str(target), str(drafter), prefill_chunk=256, **kw)
    script = ScriptedDrafts(monkeypatch)
    ids = [engine.encode(p) for p in prompts]
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ids)
    refs = [greedy_reference(target, i, n, engine.tokenizer.eos_token_ids) for i, n in zip(ids, budgets)]
    for n, (i, ref) in enumerate(zip(ids, refs)):
        script(i + ref + [0] * 16, p_wrong=P_WRONG[n], seed=n)
    return engine, script, ids, refs


def gated_delta_inputs(T=16, Hk=2, Hv=4, Dk=32, Dv=32, dtype=None, seed=0):
    """Seeded inputs of a GatedDeltaNet recurrence: q, k, v, g, beta and a start state."""
    import mlx.core as mx

    dtype = dtype or mx.float32
    mx.random.seed(seed)
    q = mx.random.normal((1, T, Hk, Dk)) * Dk**-0.5
    k = mx.random.normal((1, T, Hk, Dk))
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    v = mx.random.normal((1, T, Hv, Dv))
    g = mx.random.uniform(0.5, 1.0, (1, T, Hv))
    beta = mx.sigmoid(mx.random.normal((1, T, Hv)))
    state = mx.random.normal((1, Hv, Dv, Dk)) * 0.5
    return (*(x.astype(dtype) for x in (q, k, v)), g, beta.astype(dtype), state)
