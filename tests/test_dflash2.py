"""DFlash 2 drafters (engine/models/dflash2.py): the published checkpoint format loads strictly,
v1 and v2 are told apart by the config alone, the drafts equal an independent numpy reference of
the published forward pass (and two broken variants do not), and greedy and sampled DFlash
through a DFlash 2 drafter keep the target's output, batch 1 and batched, on a qwen3 and a
hybrid qwen3_5 target (fp32, CPU)."""

from __future__ import annotations

import json
from collections import Counter

from dflash_batch.engine import decode, load_engine
from dflash_batch.engine.batch import BatchDecoder
from dflash_batch.engine.models import dflash2, loading
from dflash_batch.engine.models import drafter as drafter_v1
from dflash_batch.engine.ops.batch_cache import Lengths

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tests import dflash2_models as d2
from tests import synthetic
from tests.helpers import (
    chi_square,
    chi_square_critical,
    eager_and_compiled_drafts,
    fixed_costs,
    greedy_reference,
    markov_engine,
    transitions,
)

PROMPTS = [
    "Hi",
    "Write a haiku about the sea.",
    "How are you today? " * 6,
    "def add(a, b):\n    return a + b\n# now multiply",
    "12 * 7 = ? Explain step by step.",
]


@pytest.fixture(scope="module")
def q3(tmp_path_factory):
    """A tiny qwen3 target and a random DFlash 2 drafter for it, in the published format."""
    folder = tmp_path_factory.mktemp("dflash2")
    cfg = synthetic.tiny_qwen3_config()
    target = synthetic.save_target(folder / "target", cfg, seed=0)
    draft = d2.save_dflash2(folder / "draft", d2.dflash2_config(cfg, block_size=8), seed=11)
    return target, draft, cfg


@pytest.fixture(scope="module")
def q35(tmp_path_factory):
    """A tiny hybrid qwen3_5 target (GatedDeltaNet and attention layers) and a DFlash 2 drafter."""
    folder = tmp_path_factory.mktemp("dflash2-q35")
    cfg = synthetic.tiny_qwen3_5_config(layers=8)
    target = synthetic.save_target(folder / "target", cfg, seed=1)
    draft = d2.save_dflash2(
        folder / "draft", d2.dflash2_config(cfg, block_size=8, sliding_window=24), seed=12
    )
    return target, draft, cfg


# -- the format -----------------------------------------------------------------------------


def test_published_names_load_strictly(q3):
    target, draft, cfg = q3
    model = loading.load_drafter(draft)
    assert isinstance(model, dflash2.Model)
    config = json.loads((draft / "config.json").read_text())
    shapes = d2.published_shapes(config)
    ours = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters())}
    assert ours == shapes  # exactly the published tensors: no embedding, no head, bare codebooks
    assert "candidate_selector.predecessor_codebook" in ours and "embed_tokens.weight" not in ours
    args = model.args
    assert (
        args.conv_kernel_size,
        args.conv_group_size,
        args.selector_rank,
        args.selector_top_k,
    ) == (2, 16, 16, 8)
    assert args.runtime_block_size == 5  # none named: min(5, block_size)


def test_v1_and_v2_are_told_apart_by_the_config_alone(q3, tmp_path):
    target, draft, cfg = q3
    v1 = synthetic.save_drafter(
        tmp_path / "v1", synthetic.drafter_config(cfg, block_size=8, nested=True)
    )
    assert type(loading.load_drafter(v1)) is drafter_v1.Model
    assert type(loading.load_drafter(draft)) is dflash2.Model
    config = json.loads((draft / "config.json").read_text())
    assert (
        loading.drafter_format({k: v for k, v in config.items() if k != "architectures"}) is dflash2
    )

    other = dict(config, architectures=["MuseGlimmerAssistantModel"])
    with pytest.raises(ValueError) as e:
        loading.drafter_format(other, "x/config.json")
    text = str(e.value)
    assert (
        "MuseGlimmerAssistantModel" in text
        and "DFlashDraftModel" in text
        and "DFlash2DraftModel" in text
    )
    assert "selector_top_k" in text

    broken = json.loads(json.dumps(config))
    del broken["dflash_config"]["selector_rank"]
    (tmp_path / "v2").mkdir()
    (tmp_path / "v2" / "config.json").write_text(json.dumps(broken))
    with pytest.raises(KeyError, match="selector_rank"):
        loading.load_drafter(tmp_path / "v2")
    bad_group = json.loads(json.dumps(config))
    bad_group["dflash_config"]["conv_group_size"] = 48  # does not divide the hidden size (128)
    with pytest.raises(ValueError, match="conv_group_size 48 must divide hidden_size 128"):
        dflash2.ModelArgs.from_config(bad_group)


def test_runtime_block_size_is_the_engines_default_block(q3, tmp_path):
    target, _, cfg = q3
    draft = d2.save_dflash2(
        tmp_path / "d", d2.dflash2_config(cfg, block_size=8, runtime_block_size=4), seed=3
    )
    assert load_engine(target, draft).block_size == 4
    assert (
        load_engine(target, draft, block_size=6).block_size == 6
    )  # asked: up to the trained block
    assert load_engine(target, draft, block_size=16).block_size == 8


def test_a_selector_over_another_vocabulary_is_refused(q3, tmp_path):
    from dflash_batch.errors import ModelMismatchError

    target, _, cfg = q3
    draft = d2.save_dflash2(tmp_path / "d", d2.dflash2_config(dict(cfg, vocab_size=1024)), seed=3)
    with pytest.raises(ModelMismatchError, match="selector covers 1024 tokens"):
        load_engine(target, draft)


# -- the forward pass against an independent reference ------------------------------------------


def _context(engine, ids):
    """The target's tapped hidden states [1, n, taps*H] of a prompt, and its greedy next token."""
    lengths = Lengths([0])
    cache = engine.target.make_cache(lengths)
    logits, context = decode.prefill(engine.target, ids, cache, lengths, 256)
    return context, int(mx.argmax(logits[0, -1]))


def _weights(draft):
    return {k: np.array(v) for k, v in mx.load(str(draft / "model.safetensors")).items()}


def _reference(engine, draft, context, anchor, pairwise=True):
    cfg = json.loads((draft / "config.json").read_text())
    W = _weights(draft)
    bs = cfg["dflash_config"]["block_size"]
    block = mx.array([[anchor] + [cfg["dflash_config"]["mask_token_id"]] * (bs - 1)])
    emb = np.array(engine.target.embed(block)[0])
    h = d2.reference_hidden(W, cfg, np.array(context), emb)[1:]
    E = np.array(engine.target.embed_tokens.weight, dtype=np.float64)  # tied head
    return d2.reference_select(W, cfg, h, h @ E.T, anchor, pairwise), h


def _ours(engine, ids_list, split=0):
    """Drafts of every prompt in one ragged batch (row b brings its own context rows), and the
    drafter's hidden states; ``split``: the first rows of each context added beforehand."""
    drafter, target = engine.drafter, engine.target
    rows = [_context(engine, ids) for ids in ids_list]
    n = [c.shape[1] for c, _ in rows]
    lengths = Lengths([0] * len(rows))
    cache = drafter.make_cache(lengths)
    if split:
        drafter.add_context(mx.concatenate([c[:, :split] for c, _ in rows], axis=0), cache)
        lengths.advance([split] * len(rows))
    width = max(n) - split
    ctx = mx.concatenate(
        [mx.pad(c[:, split:], [(0, 0), (0, width - (c.shape[1] - split)), (0, 0)]) for c, _ in rows]
    )
    counts = mx.array([k - split for k in n], dtype=mx.int32) if len(set(n)) > 1 else None
    last = mx.array([[a] for _, a in rows], dtype=mx.int32)
    bs = drafter.args.block_size
    drafts = decode.draft_block(drafter, target, last, ctx, counts, cache, bs - 1)
    return drafts.tolist(), rows


@pytest.mark.parametrize("fixture,split", [("q3", 0), ("q3", 3), ("q35", 0), ("q35", 2)])
def test_drafts_equal_the_reference_forward_pass(request, fixture, split):
    """Row by row in a ragged batch (full layers; sliding layers whose window the prompts
    outgrow), the context given at once or partly from the cache."""
    target, draft, _ = request.getfixturevalue(fixture)
    engine = load_engine(target, draft)
    ids_list = [engine.encode(p) for p in PROMPTS]
    drafts, rows = _ours(engine, ids_list, split)
    for b, (context, anchor) in enumerate(rows):
        want, _ = _reference(engine, draft, context[0], anchor)
        assert drafts[b] == want, b


def test_negative_control_convolution_across_the_block_boundary(q3, monkeypatch):
    """Taps that wrap around (position 0 reads the block's last row, as a convolution carried
    over from the previous block would read what came before) change the drafts: the pin fails."""
    target, draft, _ = q3
    engine = load_engine(target, draft)
    ids_list = [engine.encode(p) for p in PROMPTS]

    def wrapped(self, v, dynamic, which):
        taps = self.base_kernel[which].astype(v.dtype) + mx.repeat(dynamic, self.group, axis=-1)
        return sum(taps[:, :, t] * mx.roll(v, t, axis=1) for t in range(self.kernel))

    monkeypatch.setattr(dflash2.DynamicConv, "_convolve", wrapped)
    drafts, rows = _ours(engine, ids_list)
    wants = [_reference(engine, draft, c[0], a)[0] for c, a in rows]
    assert drafts != wants


def test_negative_control_selector_without_pairwise_scores(q3, monkeypatch):
    """A selector that takes the best unary logit (the pairwise scores ignored) drafts otherwise:
    the pin fails; and the reference run without its pairwise term agrees with it (the two
    walks differ by that term alone)."""
    target, draft, _ = q3
    engine = load_engine(target, draft)
    ids_list = [engine.encode(p) for p in PROMPTS]
    right, rows = _ours(engine, ids_list)
    monkeypatch.setattr(
        dflash2.CandidateSelector,
        "__call__",
        lambda self, h, logits, first: mx.argmax(logits, axis=-1),
    )
    drafts, _ = _ours(engine, ids_list)
    wants = [_reference(engine, draft, c[0], a)[0] for c, a in rows]
    assert right == wants and drafts != wants
    assert drafts == [_reference(engine, draft, c[0], a, pairwise=False)[0] for c, a in rows]


# -- lossless decoding ----------------------------------------------------------------------


def _bigram(engine, refs, ids):
    """The token that most often follows each token in the target's greedy outputs."""
    V = engine.target.vocab_size
    follows = {}
    for i, r in zip(ids, refs):
        seq = i[-1:] + r
        for a, b in zip(seq[:-1], seq[1:]):
            follows.setdefault(a, Counter())[b] += 1
    return np.array([follows[a].most_common(1)[0][0] if a in follows else 0 for a in range(V)])


BUDGETS = [7, 40, 23, 33, 50]


@pytest.mark.parametrize("fixture", ["q3", "q35"])
@pytest.mark.parametrize("agreeing", [False, True])
def test_greedy_equals_the_targets_own_greedy(request, fixture, agreeing):
    """Batch 1 and batched (ragged acceptance: rows accept differently), against mlx-lm's greedy
    decoding; ``agreeing``: the selector made to propose the target's most frequent successors,
    so that many drafts are accepted."""
    target, draft, _ = request.getfixturevalue(fixture)
    engine = load_engine(target, draft, cost_model=fixed_costs(), prefill_chunk=256)
    eos = engine.tokenizer.eos_token_ids
    ids = [engine.encode(p) for p in PROMPTS]
    refs = [greedy_reference(target, i, m, eos) for i, m in zip(ids, BUDGETS)]
    if agreeing:
        d2.bigram_selector(engine.drafter, engine.target, _bigram(engine, refs, ids))
    alone = [engine.generate(i, max_tokens=m) for i, m in zip(ids, BUDGETS)]
    assert [c.token_ids for c in alone] == refs
    batched = engine.generate_batch(ids, max_tokens=BUDGETS, batch_size=3)
    assert [c.token_ids for c in batched] == refs
    drafted = sum(c.stats.drafted_tokens for c in batched)
    accepted = [c.stats.accepted_tokens for c in batched]
    assert drafted > 0
    if agreeing:
        assert sum(accepted) > drafted // 4 and len(set(accepted)) > 1, accepted


@pytest.mark.parametrize("fixture", ["q3", "q35"])
def test_eos_and_budget_cut_inside_a_block(request, fixture):
    """Whole blocks (no adaptive width) accepted often: an EOS and a budget that fall inside a
    block end the row there, alone and batched."""
    target, draft, _ = request.getfixturevalue(fixture)
    engine = load_engine(target, draft, adaptive_block=False, block_size=8, prefill_chunk=256)
    ids = [engine.encode(p) for p in PROMPTS[:3]]
    refs = [
        greedy_reference(target, i, 40) for i in ids
    ]  # no EOS: the one below is chosen from them
    d2.bigram_selector(engine.drafter, engine.target, _bigram(engine, refs, ids))
    budgets = [13, 40, 29]  # not multiples of the block: the budget ends inside one
    # an EOS that row 1 meets first at position k >= 9, and row 0 not before its budget ends
    k = next(
        i for i in range(9, len(refs[1])) if refs[1][i] not in refs[1][:i] + refs[0][: budgets[0]]
    )
    engine.tokenizer.eos_token_ids = {refs[1][k]}
    cut = [r[: r.index(refs[1][k])] if refs[1][k] in r else r for r in refs]
    want = [c[:m] for c, m in zip(cut, budgets)]
    batched = engine.generate_batch(ids, max_tokens=budgets, batch_size=3)
    alone = [engine.generate(i, max_tokens=m) for i, m in zip(ids, budgets)]
    assert [c.token_ids for c in batched] == want == [c.token_ids for c in alone]
    assert batched[1].stop_reason == "eos" and batched[0].finish_reason == "length"
    assert (
        max(max(i for i, n in enumerate(c.stats.acceptance_histogram) if n) for c in batched) >= 3
    )


def test_cycles_verify_chains_with_a_selecting_drafter(q3, monkeypatch):
    """The selector proposes one path per row: no draft tree is grown from it, whatever the mode."""
    target, draft, _ = q3
    engine = load_engine(target, draft, cost_model=fixed_costs(), drafts="tree")
    assert engine.description["drafts"] == "chain"
    monkeypatch.setattr(
        BatchDecoder, "_draft_tree", lambda *a, **k: pytest.fail("a tree cycle ran")
    )
    assert engine.generate(PROMPTS[1], max_tokens=20).stats.drafted_tokens > 0


# -- sampling -------------------------------------------------------------------------------


def test_sampling_through_a_dflash2_drafter_keeps_the_target_distribution(
    q3, tmp_path, monkeypatch
):
    """The chi-square test of tests/test_sampling.py with the drafts proposed by the DFlash 2
    drafter itself (its selector holding the Markov chain's most likely successor of each
    token; whole blocks of 8), and its negative control: a decoder that keeps every draft fails it."""
    target, _, cfg = q3
    draft = d2.save_dflash2(
        tmp_path / "d", d2.dflash2_config(cfg, block_size=8, runtime_block_size=8), seed=13
    )
    engine, probs = markov_engine(target, draft)
    d2.bigram_selector(engine.drafter, engine.target, probs.argmax(axis=1))
    pairs, accepted = transitions(engine)
    stat, dof = chi_square(pairs, probs)
    assert dof >= 12
    assert accepted > len(pairs) // 4  # the drafter's proposals were accepted often
    assert stat < chi_square_critical(dof), (stat, dof)
    monkeypatch.setattr(decode, "accept_lengths", lambda d, t, limits: [L - 1 for L in limits])
    biased, _ = transitions(engine)
    stat_biased, dof_biased = chi_square(biased, probs)
    assert stat_biased > 3 * chi_square_critical(dof_biased), (stat_biased, dof_biased)


def test_compiled_draft_passes_equal_eager_ones(q35, monkeypatch):
    """The drafter's pass replayed from a trace (engine/ops/compiled.py, the default on CUDA),
    convolutions and bidirectional sliding layers included: every cycle's drafts and the output
    are the eager pass's, rows joining and leaving."""
    target, draft, _ = q35
    engine = load_engine(target, draft, prefill_chunk=64, adaptive_block=False)
    budgets = [20, 33, 9, 40, 27]
    runs = eager_and_compiled_drafts(engine, monkeypatch, PROMPTS, budgets)
    assert runs["compiled"] == runs["eager"] and len(runs["eager"][1]) > 10
    assert engine.drafter.passes.calls["compiled"] > engine.drafter.passes.traced


def test_the_pass_benchmark_runs_its_smoke_mode(tmp_path, capsys):
    """benchmarks/dflash2_pass.py (the GPU command is in its doc) end to end on tiny shapes; no
    figure is checked, only that each batch size has both drafters' passes."""
    from benchmarks import dflash2_pass

    out = tmp_path / "pass.json"
    assert dflash2_pass.main(["--smoke", "--reps", "2", "--batch", "1,2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 2]
    assert all(r["v1_ms"] > 0 and r["v2_ms"] > 0 for r in result["rows"])
    assert result["command"].startswith("python -m benchmarks.dflash2_pass --smoke")


def test_warm_up_times_dflash2_passes(q3, monkeypatch):
    """No cost model given: the engine's warm-up runs the DFlash 2 drafter's passes (as a cycle
    runs them: the selector's walk included) before the job; the output does not depend on what
    it measured."""
    target, draft, _ = q3
    engine = load_engine(target, draft)
    walks = []
    real = dflash2.CandidateSelector.__call__
    monkeypatch.setattr(
        dflash2.CandidateSelector, "__call__", lambda *a: walks.append(1) or real(*a)
    )
    engine.warm_up(2)
    assert walks  # the drafter's passes were timed with their selector
    ids = [engine.encode(p) for p in PROMPTS[:2]]
    refs = [greedy_reference(target, i, 24, engine.tokenizer.eos_token_ids) for i in ids]
    assert [c.token_ids for c in engine.generate_batch(ids, max_tokens=24, batch_size=2)] == refs
