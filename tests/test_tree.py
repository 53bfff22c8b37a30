"""Draft trees (engine/tree.py): the best-first tree, the walk, a tree pass (each node sees its
prefix at its own positions), the move of the accepted path to the front of the cache, and
whole runs that give the target's own output, greedy and sampled, whatever the other rows are."""

from __future__ import annotations

import itertools
import random

from dflash_batch.engine import load_engine, tree
from dflash_batch.engine.models.target import Target
from dflash_batch.engine.ops import switch
from dflash_batch.engine.widths import CostModel, WidthPolicy

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers import (
    MAX_TOKENS,
    P_WRONG,
    PROMPTS_B,
    TREE_PROMPT,
    branchy_trees,
    greedy_reference,
    prefilled,
    scripted_batch,
    set_modes,
    tree_pass,
)
from tests.scripting import ScriptedDrafts

BRANCHY = branchy_trees()


def _candidates(rng: np.random.Generator, P: int, C: int):
    ids = np.arange(P * C).reshape(1, P, C)
    logprobs = -np.sort(rng.exponential(1.0, size=(1, P, C)), axis=-1)  # best first per position
    return ids, logprobs


def _grow(last, ids, logprobs, nodes: int, reach):
    """Each row's tree of at most ``nodes`` nodes, ``reach[b]`` at most (what row b may commit
    beyond its bonus), padded to ``nodes`` + 1: ``best_first`` then ``fit``, as a cycle runs them."""
    capped = [min(int(r), nodes) for r in reach]
    return tree.fit(
        tree.best_first(last, ids, logprobs, capped), [r + 1 for r in capped], nodes + 1
    )


def test_grow_takes_the_best_scoring_prefixes():
    rng = np.random.default_rng(0)
    P, C = 4, 3
    for nodes, reach in [(10, 4), (20, 4), (9, 2), (5, 1)]:
        ids, logprobs = _candidates(rng, P, C)
        trees = _grow([99], ids, logprobs, nodes, [reach])
        # every prefix of ranks up to ``reach`` deep, scored by brute force
        prefixes = [r for d in range(1, reach + 1) for r in itertools.product(range(C), repeat=d)]
        score = {r: sum(logprobs[0, k, c] for k, c in enumerate(r)) for r in prefixes}
        best = sorted(prefixes, key=lambda r: -score[r])[: min(nodes, reach)]
        got = set()
        tokens, parents, depths = trees.tokens[0], trees.parents[0], trees.depths[0]
        assert len(tokens) == nodes + 1 and tokens[0] == 99 and parents[0] == -1
        for i in range(1, min(nodes, reach) + 1):
            assert parents[i] < i and depths[i] == depths[parents[i]] + 1 <= reach
            path, j = [], i
            while j > 0:
                path.append(int(tokens[j]) % C)  # ids[0, k, c] = k * C + c
                j = parents[j]
            got.add(tuple(reversed(path)))
        assert got == set(best)
        # the chain of top candidates, as deep as the tree holds it, takes nodes 1..k
        k = max(d for d in range(reach + 1) if (0,) * d in got or d == 0)
        assert [tokens[i] for i in range(1, k + 1)] == [int(ids[0, d, 0]) for d in range(k)]
        assert parents[1 : k + 1] == list(range(k))


def test_the_top_chain_takes_the_first_nodes():
    """Best first, the runner-up at depth 1 (score -0.2) comes before the top chain's second node
    (-1.1); the layout still puts the chain at nodes 1..3, so a walk along it needs no move."""
    ids = np.arange(3 * 2).reshape(1, 3, 2)  # position k's candidates: 2k, 2k + 1
    logprobs = np.array([[[-0.1, -0.2], [-1.0, -3.0], [-0.5, -4.0]]])
    trees = _grow([99], ids, logprobs, 5, [5])
    assert trees.tokens[0][:4] == [99, 0, 2, 4] and trees.parents[0][:4] == [-1, 0, 1, 2]
    assert sorted(zip(trees.tokens[0][4:], trees.parents[0][4:])) == [
        (1, 0),
        (2, 4),
    ]  # the runner-up and its child
    assert tree.order(tree.walk(trees, [[0, 2, 4, 7, 0, 0]]), 6) == [list(range(6))]


def test_walk_follows_the_targets_choices():
    # root 0 -> 1 (a) -> 3 (c); root -> 2 (b) -> 4 (d); 5 copies 1 (padding)
    trees = tree.Trees([[7, 10, 11, 12, 13, 10]], [[-1, 0, 0, 1, 2, 0]], [[0, 1, 1, 2, 2, 1]])
    assert tree.walk(trees, [[11, 0, 13, 0, 0, 0]]) == [[0, 2, 4]]  # b then d
    assert tree.walk(trees, [[10, 12, 0, 0, 0, 0]]) == [[0, 1, 3]]
    assert tree.walk(trees, [[10, 5, 0, 0, 0, 0]]) == [[0, 1]]
    assert tree.walk(trees, [[42, 0, 0, 0, 0, 0]]) == [[0]]
    assert tree.order([[0, 2, 4]], 6) == [[0, 2, 4, 1, 3, 5]]


def test_padding_is_never_walked():
    """A row that may commit nothing past its bonus (reach 0) or one token (reach 1) gets copies
    of its root or first child, which the walk never takes, whatever the target chooses."""
    ids, logprobs = _candidates(np.random.default_rng(1), 3, 2)
    trees = _grow(
        [7, 7], np.concatenate([ids, ids]), np.concatenate([logprobs, logprobs]), 5, [0, 1]
    )
    assert trees.depths == [[0] * 6, [0] + [1] * 5]
    every = [7] + [int(i) for i in ids.reshape(-1)]
    for t in every:
        paths = tree.walk(trees, [[t] * 6, [t] * 6])
        assert paths[0] == [0] and len(paths[1]) <= 2


def _path(trees, b, i):
    out = []
    while i >= 0:
        out.append(trees.tokens[b][i])
        i = trees.parents[b][i]
    return out[::-1]


@pytest.mark.parametrize("rows", [1, 2])
def test_each_node_sees_its_prefix_at_its_positions(tiny_pair, rows):
    """Node i's logits and taps equal a causal pass over its own prefix (ragged rows too)."""
    engine = load_engine(*map(str, tiny_pair))
    target = engine.target
    trees = tree.Trees(BRANCHY.tokens[:rows], BRANCHY.parents[:rows], BRANCHY.depths[:rows])
    cache, lengths = prefilled(target, TREE_PROMPT, rows)
    logits, hidden = tree_pass(target, cache, lengths, trees)
    for b in range(rows):
        n = lengths.host[b]
        for i in range(len(trees.tokens[b])):
            alone, alone_lengths = prefilled(target, TREE_PROMPT[:n])
            path = _path(trees, b, i)
            ref_logits, ref_hidden = target.verify(mx.array([path]), alone)
            np.testing.assert_allclose(
                np.array(logits[b, i]), np.array(ref_logits[0, -1]), atol=2e-5, rtol=1e-5
            )
            np.testing.assert_allclose(
                np.array(hidden[b, i]), np.array(ref_hidden[0, -1]), atol=2e-5, rtol=1e-5
            )


def test_positions_by_index_are_not_a_tree_pass(tiny_pair, monkeypatch):
    """Negative control: RoPE at the node's index instead of its depth changes the branch's logits."""
    engine = load_engine(*map(str, tiny_pair))
    target = engine.target
    cache, lengths = prefilled(target, TREE_PROMPT)
    trees = tree.Trees(BRANCHY.tokens[:1], BRANCHY.parents[:1], [list(range(7))])  # depth := index
    logits, _ = tree_pass(target, cache, lengths, trees)
    alone, _ = prefilled(target, TREE_PROMPT)
    ref, _ = target.verify(mx.array([_path(BRANCHY, 0, 4)]), alone)  # node 4: depth 2, index 4
    assert not np.allclose(np.array(logits[0, 4]), np.array(ref[0, -1]), atol=1e-3)


def test_reorder_leaves_the_path_where_a_chain_would(tiny_pair):
    """After a tree pass and the move, row b's columns n_b.. hold the accepted path's keys: equal
    to a causal pass over the path."""
    engine = load_engine(*map(str, tiny_pair))
    target = engine.target
    cache, lengths = prefilled(target, TREE_PROMPT, 2)
    tree_pass(target, cache, lengths, BRANCHY)
    paths = [[0, 2, 4], [0, 1, 2, 3]]
    target.reorder(cache, mx.array(tree.order(paths, 7), dtype=mx.int32))
    for b, path in enumerate(paths):
        n = lengths.host[b]
        alone, _ = prefilled(target, TREE_PROMPT[:n])
        target.verify(mx.array([[BRANCHY.tokens[b][i] for i in path]]), alone)
        for big, small in zip(cache, alone):
            np.testing.assert_allclose(
                np.array(big.keys[b, :, : n + len(path)]),
                np.array(small.keys[0, :, : n + len(path)]),
                atol=2e-5,
                rtol=1e-5,
            )


@pytest.mark.parametrize("batch_size", [1, 3])
def test_tree_runs_equal_the_targets_greedy_output(
    qwen3_target, qwen3_b8, monkeypatch, tree_drafts, batch_size
):
    """Scripted drafts (tests/scripting.py: a corrupted draft's true token is the second candidate,
    so a branch repairs it): every row equals mlx-lm's greedy output, budgets cut inside blocks,
    alone or batched, and trees commit more per cycle than chains on the same script."""
    engine, script, ids, refs = scripted_batch(
        qwen3_target, qwen3_b8, monkeypatch, PROMPTS_B, MAX_TOKENS, adaptive_block=False
    )
    walked, moved = [], []
    real_walk, real_reorder = tree.walk, Target.reorder
    monkeypatch.setattr(
        tree, "walk", lambda trees, chosen: walked.append(real_walk(trees, chosen)) or walked[-1]
    )
    monkeypatch.setattr(
        Target,
        "reorder",
        lambda self, cache, order: moved.append(1) or real_reorder(self, cache, order),
    )
    batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=batch_size)
    assert [c.token_ids for c in batched] == refs
    branched = sum(any(p != list(range(len(p))) for p in paths) for paths in walked)
    assert branched > 10, branched  # the walk left the top chain many times
    assert (
        len(moved) == branched < len(walked)
    )  # the cache moves only then: the top chain is nodes 1..k
    tree_tokens = sum(c.stats.accepted_tokens for c in batched)
    set_modes(monkeypatch, engine, drafts="chain")
    script.references.clear()
    for n, (i, ref) in enumerate(zip(ids, refs)):
        script(i + ref + [0] * 16, p_wrong=P_WRONG[n], seed=n)
    chained = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=batch_size)
    assert [c.token_ids for c in chained] == refs
    assert tree_tokens > 1.2 * sum(c.stats.accepted_tokens for c in chained)


def test_a_row_of_a_tree_batch_runs_as_it_would_alone(
    qwen3_target, qwen3_b8, monkeypatch, tree_drafts
):
    engine, script, ids, refs = scripted_batch(
        qwen3_target, qwen3_b8, monkeypatch, PROMPTS_B, MAX_TOKENS, adaptive_block=False
    )
    batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=4)
    script.references.clear()
    for n, (i, ref) in enumerate(zip(ids, refs)):
        script(i + ref + [0] * 16, p_wrong=P_WRONG[n], seed=n)
    alone = [engine.generate(i, max_tokens=m) for i, m in zip(ids, MAX_TOKENS)]
    for n, (a, b) in enumerate(zip(alone, batched)):
        assert a.token_ids == b.token_ids == refs[n], f"row {n}"
        assert a.stats.acceptance_histogram == b.stats.acceptance_histogram, f"row {n}"


def test_without_the_move_a_tree_run_goes_wrong(qwen3_target, qwen3_b8, monkeypatch, tree_drafts):
    """Negative control: keep the nodes where the pass wrote them (no reorder) and output breaks."""
    engine, script, ids, refs = scripted_batch(
        qwen3_target, qwen3_b8, monkeypatch, PROMPTS_B, MAX_TOKENS, adaptive_block=False
    )
    monkeypatch.setattr(Target, "reorder", lambda self, cache, order: None)
    batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=3)
    assert [c.token_ids for c in batched] != refs


def test_sampled_tree_runs_equal_plain_sampled_decoding(
    qwen3_target, qwen3_b8, monkeypatch, tree_drafts
):
    """A node's sample is the target's at that node's position (engine/decode.py: choose), so a
    seeded tree run writes what plain seeded decoding writes; another seed writes something else."""
    engine, script, ids, _ = scripted_batch(
        qwen3_target, qwen3_b8, monkeypatch, PROMPTS_B[:4], 40, adaptive_block=False
    )
    plain = load_engine(str(qwen3_target), None)
    rng = random.Random(1)
    for i in ids:
        seed = rng.randrange(1 << 30)
        ref = plain.generate(i, max_tokens=40, temperature=0.9, seed=seed).token_ids
        script.references.clear()
        script(i + ref + [0] * 16, p_wrong=0.3, seed=seed)
        spec = engine.generate(i, max_tokens=40, temperature=0.9, seed=seed)
        assert spec.token_ids == ref
        assert spec.stats.accepted_tokens > 0
        assert plain.generate(i, max_tokens=40, temperature=0.9, seed=seed + 1).token_ids != ref


def test_tree_runs_equal_the_targets_greedy_output_at_any_width_chosen(
    qwen3_target, qwen3_b8, monkeypatch, tree_drafts, joins_at_once
):
    """The adaptive width policy chooses a tree cycle's width after the drafts
    (WidthPolicy.tree_width, each row's tree its first L_b - 1 prefixes): output stays the
    target's own whatever width it picks, here a random one each cycle. Each free slot takes a
    waiting request at once (``joins_at_once``): where slots waited for a later join (measured
    seconds, on a loaded machine), a row with one token left ran a cycle alone, and this test's
    cycles, every one drafting, found no width above 1 to pick."""
    engine, script, ids, refs = scripted_batch(
        qwen3_target, qwen3_b8, monkeypatch, PROMPTS_B, MAX_TOKENS, adaptive_block=True
    )
    rng = random.Random(5)
    picked = []

    def any_width(self, trees, budgets):
        assert len(trees) == len(budgets) and all(
            len(d) == len(s) <= min(n, self.block) for (d, s), n in zip(trees, budgets)
        )
        picked.append(rng.choice([T for T in self.widths(max(budgets)) if T > 1]))
        return picked[-1]

    # every cycle drafts
    monkeypatch.setattr(WidthPolicy, "width", lambda self, estimates, budgets, tail=None: 4)
    monkeypatch.setattr(WidthPolicy, "tree_width", any_width)
    batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=3)
    assert [c.token_ids for c in batched] == refs
    assert len(set(picked)) >= 4, picked


def test_adaptive_trees_learn_the_drafters_calibration(tiny_pair, monkeypatch, tree_drafts):
    """The adaptive engine's tree cycles feed its node calibration (engine/widths.py): the
    script's drafts are half wrong with the truth second (log q -0.2 and -1: 1.19 of probability
    at depth 1 for one node accepted), so c_1 falls below 1; where trees pay (a CPU-like cost
    model) they go wider than a chain's width policy verifies for the same drafts
    (tests/test_engine_lossless.py: short chains); output unchanged."""
    target, draft = tiny_pair
    engine = load_engine(str(target), str(draft), adaptive_block=True)
    engine.cost[1] = CostModel(
        t0=1.0, t1=0.05, d0=0.5, window=0
    )  # as if measured; no timing enters
    ids = engine.encode(PROMPTS_B[2])
    ref = greedy_reference(target, ids, 80, engine.tokenizer.eos_token_ids)
    ScriptedDrafts(monkeypatch)(ids + ref + [0] * 16, p_wrong=0.5, seed=5)
    widths = []
    real = WidthPolicy.tree_width
    monkeypatch.setattr(
        WidthPolicy, "tree_width", lambda self, *a: widths.append(real(self, *a)) or widths[-1]
    )
    out = engine.generate(ids, max_tokens=80)
    assert out.token_ids == ref
    assert engine.node_calibration.predicted[0] > 0 and engine.node_calibration.scales()[0] < 0.95
    assert sorted(widths)[len(widths) // 2] >= 12, widths


def _on_the_ladder(cache, width: int = 512):
    """The same rows in buffers ``width`` columns wide (a compiling batch's: engine/ops/compiled.py)."""
    for c in cache:
        B, H, n, D = c.keys.shape
        for name in ("keys", "values"):
            wide = mx.zeros((B, H, width, D), dtype=c.keys.dtype)
            wide[:, :, :n] = getattr(c, name)
            setattr(c, name, wide)
    return cache


@pytest.mark.parametrize("rows", [1, 2])
def test_a_compiled_tree_pass_equals_the_eager_one(tiny_pair, rows):
    """A tree pass traced once and replayed (its depths and ancestors inputs of the trace): the
    same logits, taps and keys written as the eager tree pass, ragged rows too."""
    engine = load_engine(*map(str, tiny_pair))
    target = engine.target
    trees = tree.Trees(BRANCHY.tokens[:rows], BRANCHY.parents[:rows], BRANCHY.depths[:rows])
    cache, lengths = prefilled(target, TREE_PROMPT, rows)
    want_logits, want_hidden = tree_pass(target, cache, lengths, trees)
    T = len(trees.tokens[0])
    with switch.modes(passes="compiled"):
        for _ in range(3):  # the first eagerly through the view, then a trace, then a replay
            wide, wide_lengths = prefilled(target, TREE_PROMPT, rows)
            _on_the_ladder(wide)
            assert target.passes.applies(wide, T)
            logits, hidden = tree_pass(target, wide, wide_lengths, trees, target.decode_pass)
            np.testing.assert_allclose(
                np.array(logits), np.array(want_logits), atol=2e-5, rtol=1e-5
            )
            np.testing.assert_allclose(
                np.array(hidden), np.array(want_hidden), atol=2e-5, rtol=1e-5
            )
            for c, e in zip(wide, cache):
                for b in range(rows):
                    n = lengths.host[b] + T
                    np.testing.assert_allclose(
                        np.array(c.keys[b, :, :n]), np.array(e.keys[b, :, :n]), atol=2e-5, rtol=1e-5
                    )
    assert target.passes.calls["compiled"] >= 2


def test_tree_runs_with_compiled_passes_equal_the_targets_greedy_output(
    qwen3_target, qwen3_b8, monkeypatch, tree_drafts
):
    """Scripted tree runs with compiled passes (engine/ops/compiled.py): mlx-lm's greedy output, batch
    1 and 3, and the tree passes were replayed, not rebuilt each cycle."""
    engine, _, ids, refs = scripted_batch(
        qwen3_target,
        qwen3_b8,
        monkeypatch,
        PROMPTS_B,
        MAX_TOKENS,
        adaptive_block=False,
        passes="compiled",
    )
    for batch_size in (1, 3):
        batched = engine.generate_batch(ids, max_tokens=MAX_TOKENS, batch_size=batch_size)
        assert [c.token_ids for c in batched] == refs
    passes = engine.target.passes
    assert any(key[-1] == "tree" for key in passes._compiled)
    assert passes.calls["compiled"] > 3 * passes.traced, passes.calls


def test_the_engine_says_what_its_drafting_cycles_verify(tiny_pair, tree_drafts):
    target, draft = tiny_pair
    assert load_engine(str(target), str(draft)).description["drafts"] == "tree"
    assert (
        load_engine(str(target), None).description["drafts"] is None
    )  # no drafter: no drafting cycles
    assert load_engine(str(target), str(draft), drafts="chain").description["drafts"] == "chain"


def test_a_probe_drafts_and_verifies_no_wider_than_the_probe(tiny_pair, monkeypatch, tree_drafts):
    """Drafts always wrong, the drafter sure of them: a tree grown from them would go wide, and
    the chain model never drafts by choice, so every drafting cycle is a probe. Each drafts the
    probe's positions alone, verifies no wider than the probe, and teaches the cost model
    nothing (its drafter pass is not a tree cycle's); output unchanged."""
    from dflash_batch.engine.batch import BatchDecoder
    from dflash_batch.engine.widths import PROBE_WIDTH

    target, draft = tiny_pair
    engine = load_engine(str(target), str(draft))
    engine.cost[1] = CostModel(t0=1.0, t1=0.001, d0=2.0, window=0)  # as if measured
    ids = engine.encode(PROMPTS_B[2])
    ref = greedy_reference(target, ids, 200, engine.tokenizer.eos_token_ids)
    ScriptedDrafts(monkeypatch)(ids + ref + [0] * 16, p_wrong=1.0, seed=5)
    drafted, observed, verified = [], [], []
    scripted, observe = BatchDecoder.draft, CostModel.observe
    monkeypatch.setattr(
        BatchDecoder,
        "draft",
        lambda self, last, rows, **k: drafted.append(rows) or scripted(self, last, rows, **k),
    )
    monkeypatch.setattr(
        CostModel, "observe", lambda self, B, T, s: observed.append(T) or observe(self, B, T, s)
    )
    real = WidthPolicy.tree_width
    monkeypatch.setattr(
        WidthPolicy, "tree_width", lambda self, *a: verified.append(real(self, *a)) or verified[-1]
    )
    out = engine.generate(ids, max_tokens=200)
    assert out.token_ids == ref
    assert verified and max(verified) <= PROBE_WIDTH
    assert drafted and max(drafted) <= PROBE_WIDTH - 1
    assert observed and set(observed) == {1}
