"""Helpers the tests share, imported from here rather than from conftest or another test
module (huey's tests/base.py is the model)."""

from __future__ import annotations

import dataclasses
import math
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

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


class StepClock:
    """``time`` for an engine module that times its work (engine/batch.py: a decoding cycle,
    engine/prefill.py: a prefill pass): each reading ``step`` seconds after the one before, so
    what it times from one reading to the next takes ``step`` seconds, however loaded the
    machine."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


PROMPTS = [
    "Hi",
    "Write a haiku about the sea.",
    "Summarize: The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n# now multiply",
    "12 * 7 = ? Explain step by step.",
    "How are you today? " * 20,
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List three colors."},
    ],
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


def eager_and_compiled_drafts(engine, monkeypatch, prompts, budgets, batch_size: int = 3) -> dict:
    """One batch decoded with eager draft passes, then with compiled ones (``EngineConfig.passes``):
    ``{passes: (each prompt's token ids, every cycle's drafts)}``, the drafts as
    ``decode.draft_block`` returned them (spied on for the rest of the test)."""
    from dflash_batch.engine import decode

    real, drafted = decode.draft_block, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        drafted.append(out.tolist())
        return out

    monkeypatch.setattr(decode, "draft_block", spy)
    runs = {}
    for passes in ("eager", "compiled"):
        drafted.clear()
        with engine_modes(engine, passes=passes):
            tokens = [
                c.token_ids
                for c in engine.generate_batch(prompts, max_tokens=budgets, batch_size=batch_size)
            ]
        runs[passes] = tokens, list(drafted)
    return runs


# The README as the tests read it: its set-up commands, its bash blocks, its command lines
# (tests/test_readme*.py).
README = (REPO / "README.md").read_text()
SET_UP = (
    "bash .ci/install && .venv/bin/dflash-batch run examples/prompts.jsonl",
    "bash .ci/install && .venv/bin/python -m pytest -q",
)
# A program the install puts in .venv/bin, named where a command starts (not as part of a path).
BARE = re.compile(r"(?<![\w./-])(?<!-m )(dflash-batch|python3?|pytest|pip3?|honcho)(?=\s|$)")


def shell_blocks(text: str):
    return re.findall(r"```bash\n(.*?)```", text, flags=re.S)


def command_lines(text: str):
    """Lines of the bash blocks and inline code spans that are commands, without comments."""
    lines = [
        line.split(" # ")[0].strip() for block in shell_blocks(text) for line in block.splitlines()
    ]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    lines += [s for s in spans if BARE.match(s) or s.startswith((".venv/bin/", "bash "))]
    return [line for line in lines if line and not line.startswith("#")]


def shim(tmp_path):
    """A folder standing in for .venv/bin: this interpreter, this checkout."""
    folder = tmp_path / "venv-bin"
    folder.mkdir()
    for name, command in (("python", ""), ("dflash-batch", " -m dflash_batch.cli")):
        (folder / name).write_text(f'#!/bin/sh\nexec {sys.executable}{command} "$@"\n')
        (folder / name).chmod(0o755)
    return folder


def sh(line: str, bin_dir, env, timeout: float = 300) -> subprocess.CompletedProcess:
    """One README line in bash from the repository root, with .venv/bin/ as the shim."""
    line = line.replace(".venv/bin/", f"{bin_dir}/")
    return subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


# A Markov-chain target for the sampling tests (tests/test_sampling.py's docstring), the
# transitions sampled decoding emits on it, and a chi-square test of them.
MARKOV_TEMPERATURE = 0.5
CLUSTER, NOISE = 8, 0.1  # tokens a cluster; the spread of its tokens' embeddings around its center
MARKOV_SEEDS = range(12)  # run n starts in cluster n % 4
MARKOV_TOKENS = 200  # per run


def markov_engine(target_dir, drafter_dir):
    """An engine whose target is a Markov chain over clusters of tokens (tests/test_sampling.py
    says how), and the chain's exact next-token probabilities at ``MARKOV_TEMPERATURE``."""
    from dflash_batch.engine import load_engine

    import mlx.core as mx
    import numpy as np

    engine = load_engine(
        target_dir, draft=drafter_dir, adaptive_block=False
    )  # whole blocks: many drafts checked
    engine.tokenizer.eos_token_ids = set()  # runs of a fixed length
    for layer in engine.target.model.model.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    model = engine.target.model
    vocab, hidden = model.args.vocab_size, model.args.hidden_size
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(vocab // CLUSTER, hidden))
    embed = centers[np.arange(vocab) // CLUSTER] + NOISE * rng.normal(size=(vocab, hidden))
    model.model.embed_tokens.weight = mx.array(embed, dtype=model.model.embed_tokens.weight.dtype)
    logits = model(mx.arange(vocab)[:, None])[:, 0, :].astype(
        mx.float32
    )  # row a: next-token logits after a
    probs = np.array(mx.softmax(logits / MARKOV_TEMPERATURE, axis=-1))
    return engine, probs


def transitions(engine):
    """(from, to) pairs of every emitted token, and how many tokens came from drafts."""
    pairs, drafted = [], 0
    for seed in MARKOV_SEEDS:
        prompt = [1, 2, 3, CLUSTER * (seed % 4) + 3]
        c = engine.generate(
            prompt, max_tokens=MARKOV_TOKENS, temperature=MARKOV_TEMPERATURE, seed=seed
        )
        seq = [prompt[-1]] + c.token_ids
        drafted += c.stats.accepted_tokens
        pairs += list(zip(seq[:-1], seq[1:]))
    return pairs, drafted


def chi_square(pairs, probs, min_visits=30):
    """Sum over source tokens with at least min_visits of the chi-square statistic of the next
    token's counts against probs[source] (bins with expected count < 5 pooled); its dof."""
    import numpy as np

    counts = {}
    for a, b in pairs:
        counts.setdefault(a, {}).setdefault(b, 0)
        counts[a][b] += 1
    stat, dof = 0.0, 0
    for a, row in counts.items():
        n = sum(row.values())
        if n < min_visits:
            continue
        expected = n * probs[a]
        big = expected >= 5
        observed = np.zeros_like(expected)
        for b, c in row.items():
            observed[b] = c
        obs = list(observed[big]) + [observed[~big].sum()]
        exp = list(expected[big]) + [expected[~big].sum()]
        for o, e in zip(obs, exp):
            if e > 0:
                stat += (o - e) ** 2 / e
        dof += len(obs) - 1
    return stat, dof


def chi_square_critical(dof: int, z: float = 3.09) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: p = 0.001)."""
    k = float(dof)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3
