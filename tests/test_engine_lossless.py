"""Greedy DFlash output must equal the target's own greedy output, token for token (fp32, CPU)."""

from __future__ import annotations

from dflash_batch.engine import load_engine
from dflash_batch.engine.widths import CostModel

import pytest

from tests import synthetic
from tests.helpers import PROMPTS, fixed_costs, greedy_reference, make_drafter
from tests.scripting import ScriptedDrafts


@pytest.fixture
def scripted(monkeypatch):
    """Replace the drafter's proposals by the true continuation, corrupted at random positions
    (tests/scripting.py). This drives every acceptance length 0..B-1 through verify, accept and
    rollback."""
    return ScriptedDrafts(monkeypatch)


def _cases():
    for target in ("qwen3", "llama"):
        for block, nested in ((4, False), (8, True), (16, False), (16, True)):
            yield target, block, nested


@pytest.mark.parametrize("target_name,block,nested", list(_cases()))
def test_greedy_dflash_equals_target_greedy(
    request, model_dir, target_name, block, nested, scripted
):
    target = request.getfixturevalue(f"{target_name}_target")
    cfg = synthetic.tiny_qwen3_config() if target_name == "qwen3" else synthetic.tiny_llama_config()
    draft = make_drafter(
        model_dir, f"d-{target_name}-{block}-{nested}", cfg, block_size=block, nested=nested
    )
    # given costs: widths, and so the acceptance lengths seen, that no load changes
    engine = load_engine(str(target), str(draft), cost_model=fixed_costs())
    assert engine.block_size == block
    hist = [0] * (block + 1)
    for n, prompt in enumerate(PROMPTS):
        ids = engine.encode(prompt)
        max_tokens = [7, 33, 64, 100][n % 4]
        ref = greedy_reference(target, ids, max_tokens, engine.tokenizer.eos_token_ids)
        scripted(ids + ref + [0] * block, p_wrong=[0.0, 0.1, 0.3, 0.7][n % 4], seed=n)
        c = engine.generate(ids, max_tokens=max_tokens)
        assert c.token_ids == ref, f"prompt {n}: diverged at {_first_diff(c.token_ids, ref)}"
        s = c.stats
        assert s.generated_tokens == len(ref) + (c.finish_reason == "stop")
        assert sum(s.acceptance_histogram) == s.cycles
        hist = [a + b for a, b in zip(hist, s.acceptance_histogram)]
    # Every acceptance length showed up at least somewhere across the prompts for small blocks.
    assert sum(1 for h in hist[1:] if h) >= min(block, 4)


def test_random_drafter_lossless_without_scripting(tiny_pair):
    target, draft = tiny_pair
    engine = load_engine(
        str(target), str(draft), adaptive_block=False
    )  # every cycle verifies a random block
    for prompt in PROMPTS[:4]:
        ids = engine.encode(prompt)
        c = engine.generate(ids, max_tokens=40)
        assert c.token_ids == greedy_reference(target, ids, 40, engine.tokenizer.eos_token_ids)
        assert c.stats.acceptance_drafted < 0.2  # a random drafter rarely guesses right


def test_long_prompt_over_one_prefill_chunk(tiny_pair, scripted):
    target, draft = tiny_pair
    engine = load_engine(str(target), str(draft), prefill_chunk=256)
    ids = [(i * 37) % 500 + 4 for i in range(1100)]
    ref = greedy_reference(target, ids, 48, engine.tokenizer.eos_token_ids)
    scripted(ids + ref + [0] * 16, p_wrong=0.2)
    assert engine.generate(ids, max_tokens=48).token_ids == ref


def _first_diff(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_adaptive_verify_length_is_lossless_and_drafts_less(tiny_pair, scripted, chain_drafts):
    """Where each verified row costs (a CPU-like cost model: 5% of a pass per row, a draft half a
    pass) and about half the drafts fail, the width policy verifies short chains; output unchanged.
    (A draft tree holds the script's true token as its second candidate, so there wide trees pay:
    tests/test_tree.py.)"""
    target, draft = tiny_pair
    fixed = load_engine(str(target), str(draft), adaptive_block=False)
    adaptive = load_engine(str(target), str(draft), adaptive_block=True)
    adaptive.cost[1] = CostModel(
        t0=1.0, t1=0.05, d0=0.5, window=0
    )  # as if measured; no timing enters
    ids = fixed.encode(PROMPTS[2])
    ref = greedy_reference(target, ids, 80, fixed.tokenizer.eos_token_ids)
    runs = []
    for engine in (fixed, adaptive):
        scripted(ids + ref + [0] * 16, p_wrong=0.5, seed=5)
        runs.append(engine.generate(ids, max_tokens=80))
    assert runs[0].token_ids == runs[1].token_ids == ref
    assert (
        runs[1].stats.drafted_tokens < runs[0].stats.drafted_tokens / 2
    )  # low acceptance: short blocks
    assert all(
        n == 0 for n in runs[1].stats.acceptance_histogram[9:]
    )  # never more than 8 rows after misses
