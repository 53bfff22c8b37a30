"""Helpers the tests share, imported from here rather than from conftest or another test
module (huey's tests/base.py is the model)."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

# MLX and the synthetic models are imported where used: the runner's tests import this module
# through conftest and run without MLX (tests/test_layering.py).


def make_drafter(model_dir: Path, name: str, target_config: dict, **kw) -> Path:
    from tests import synthetic

    folder = model_dir / name
    if not folder.exists():
        config = synthetic.drafter_config(target_config, **kw)
        synthetic.save_drafter(folder, config, seed=kw.get("layers", 2) + 7)
    return folder


def fixed_costs():
    """Pass costs as if measured that no timing changes (``window=0``): an adaptive engine given
    them (``load_engine(cost_model=...)``) chooses the same widths on a busy machine as on an
    idle one."""
    from dflash_batch.engine.widths import CostModel

    return CostModel(t0=1.0, t1=0.05, d0=0.5, window=0)


PROMPTS = [
    "Hi",
    "Write a haiku about the sea.",
    "Summarize: The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n# now multiply",
    "12 * 7 = ? Explain step by step.",
    "How are you today? " * 20,
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "List three colors."}],
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
    """An engine (``kw``: its options), ``prompts`` (default five of very different lengths),
    their greedy outputs of ``max_tokens`` (one budget, or one per prompt) and the scripted
    drafts: row n's are wrong with probability P_WRONG[n] (every acceptance length in some row).
    Returns (engine, script, prompt ids, greedy outputs)."""
    from dflash_batch.engine import load_engine
    from tests.scripting import ScriptedDrafts

    engine = load_engine(str(target), str(drafter), prefill_chunk=256, **kw)
    script = ScriptedDrafts(monkeypatch)
    ids = [engine.encode(p) for p in prompts]
    budgets = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(ids)
    eos = engine.tokenizer.eos_token_ids
    refs = [greedy_reference(target, i, n, eos) for i, n in zip(ids, budgets)]
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


TREE_PROMPT = [5, 17, 3, 88, 41, 9, 23, 60, 2, 71, 14]


def prefilled(target, prompt, rows: int = 1):
    """A cache of ``rows`` rows, row b prefilled with the prompt less its last b tokens."""
    from dflash_batch.engine import decode
    from dflash_batch.engine.ops.batch_cache import Lengths

    lengths = Lengths([0] * rows)
    cache = target.make_cache(lengths)
    for b in range(rows):
        alone = Lengths([0])
        one = target.make_cache(alone)
        decode.prefill(target, prompt[: len(prompt) - b], one, alone, 256)
        for big, small in zip(cache, one):
            big.put_row(b, small.row_state(0, alone.host[0]), rows)
    lengths.set([len(prompt) - b for b in range(rows)])
    return cache, lengths


def tree_pass(target, cache, lengths, trees, run=None):
    """A verify pass of ``trees`` over the cache: (logits, hidden)."""
    tokens, depth, ancestors = trees.device()
    lengths.tree = (depth, ancestors)
    try:
        logits, hidden = (run or target.verify)(tokens, cache)
    finally:
        lengths.tree = None
    return logits, hidden


def branchy_trees():
    """Two rows of seven nodes: a branching tree and a chain."""
    from dflash_batch.engine import tree

    return tree.Trees(
        # row 0: root -> 31 -> (44 -> 45, 46); root -> 32 -> 47.
        # row 1: a chain 50 -> 51 -> 52 -> 53 -> 54 -> 55
        [[60, 31, 32, 44, 47, 45, 46], [61, 50, 51, 52, 53, 54, 55]],
        [[-1, 0, 0, 1, 2, 3, 3], [-1, 0, 1, 2, 3, 4, 5]],
        [[0, 1, 1, 2, 2, 3, 3], [0, 1, 2, 3, 4, 5, 6]],
    )


@contextmanager
def engine_modes(engine, **modes):
    """``engine`` with its routing modes (``EngineConfig``'s attention, matmul, passes, drafts,
    cpu_ops) changed for the block: it runs as an engine made with them."""
    made = engine.settings
    engine.settings = dataclasses.replace(made, **modes)
    try:
        yield engine
    finally:
        engine.settings = made


def set_modes(monkeypatch, engine, **modes) -> None:
    """``engine_modes`` for the rest of the test."""
    monkeypatch.setattr(engine, "settings", dataclasses.replace(engine.settings, **modes))
