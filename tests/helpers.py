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
