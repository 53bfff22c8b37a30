"""Sampling (temperature > 0) keeps the target's distribution: a statistical test.

The target is made a Markov chain: with every layer's output projections zeroed, the residual
stream is the current token's embedding, so the next-token distribution depends on the current
token alone, P[a] = softmax(logits(a) / T), known exactly. Its (tied) embeddings are set to
clusters of 8 tokens (a shared center plus a little noise), so that from each token the chain
moves within its cluster, mostly to one or two tokens (top probability 0.65 on average, about 2.3
effective successors at T = 0.5). The drafter proposes the chain's most likely path (the argmax
of P from the last token on), so many drafts are accepted, and a decoder that kept drafts without
checking them against the target's samples would emit that path far too often. Chi-square goodness of fit of the emitted transitions against P, per source token with
enough visits; seeds are fixed, so the test is deterministic. The same statistic computed for a
decoder that accepts every draft shows that the test can fail.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from dflash_batch.engine import decode, load_engine, tree
from dflash_batch.engine.batch import BatchDecoder

TEMPERATURE = 0.5
CLUSTER, NOISE = 8, 0.1
SEEDS = range(12)  # run n starts in cluster n % 4
TOKENS_PER_RUN = 200


def markov_engine(target_dir, drafter_dir):
    engine = load_engine(target_dir, draft=drafter_dir, adaptive_block=False)  # whole blocks: many drafts checked
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
    logits = model(mx.arange(vocab)[:, None])[:, 0, :].astype(mx.float32)  # row a: next-token logits after a
    probs = np.array(mx.softmax(logits / TEMPERATURE, axis=-1))
    return engine, probs


def propose_argmax_path(monkeypatch, probs):
    """Drafts = the chain's most likely path from each row's last committed token (the real
    drafter still runs, so its cache advances as usual)."""
    real = BatchDecoder.draft
    best = probs.argmax(axis=1)
    order = np.argsort(-probs, axis=1)

    def draft(decoder, last, rows, candidates=0):
        real(decoder, last, rows, **({"candidates": candidates} if candidates else {}))
        out, top = [], []
        for tok in last[:, 0].tolist():
            ids, cands = [], []
            for _ in range(rows):
                cands.append(order[tok, : max(candidates, 1)])  # a tree's: the chain's next-token law
                tok = int(best[tok])
                ids.append(tok)
            out.append(ids)
            top.append(cands)
        if not candidates:
            return mx.array(out, dtype=mx.int32)
        top = np.array(top)
        prev = np.concatenate([last.tolist(), np.array(out)[:, :-1]], axis=1)  # each position's conditioning token
        logprobs = np.log(np.take_along_axis(probs[prev], top, axis=2) + 1e-30)
        return mx.array(top, dtype=mx.int32), mx.array(logprobs.astype(np.float32))

    monkeypatch.setattr(BatchDecoder, "draft", draft)


def transitions(engine):
    """(from, to) pairs of every emitted token, and how many tokens came from drafts."""
    pairs, drafted = [], 0
    for seed in SEEDS:
        prompt = [1, 2, 3, CLUSTER * (seed % 4) + 3]
        c = engine.generate(prompt, max_tokens=TOKENS_PER_RUN, temperature=TEMPERATURE, seed=seed)
        seq = [prompt[-1]] + c.token_ids
        drafted += c.stats.accepted_tokens
        pairs += list(zip(seq[:-1], seq[1:]))
    return pairs, drafted


def chi_square(pairs, probs, min_visits=30):
    """Sum over source tokens with at least min_visits of the chi-square statistic of the next
    token's counts against probs[source] (bins with expected count < 5 pooled); its dof."""
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


def _first_children(parents):
    path = [0]
    for i, p in enumerate(parents):
        if i and p == path[-1]:
            path.append(i)
    return path


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_sampling_keeps_the_target_distribution(tiny_pair, monkeypatch, drafts):
    monkeypatch.setenv("DFLASH_BATCH_DRAFTS", drafts)  # engine/tree.py: a tree's nodes sample as a chain's positions do
    _keeps_the_target_distribution(tiny_pair, monkeypatch)


def _keeps_the_target_distribution(tiny_pair, monkeypatch):
    engine, probs = markov_engine(*tiny_pair)
    assert 0.4 < probs.max(axis=1).mean() < 0.9  # peaked, not deterministic
    propose_argmax_path(monkeypatch, probs)

    pairs, drafted = transitions(engine)
    stat, dof = chi_square(pairs, probs)
    assert dof >= 12
    assert drafted > len(pairs) // 4  # drafts were accepted: the acceptance rule was exercised
    assert stat < chi_square_critical(dof), (stat, dof)

    # Power: a decoder that keeps every draft (no check against the target's samples): a chain's
    # every draft, a tree's first children (engine/tree.py)
    monkeypatch.setattr(decode, "accept_lengths", lambda d, t, limits: [L - 1 for L in limits])
    monkeypatch.setattr(tree, "walk", lambda trees, chosen: [_first_children(parents) for parents in trees.parents])
    biased, _ = transitions(engine)
    stat_biased, dof_biased = chi_square(biased, probs)
    assert stat_biased > 3 * chi_square_critical(dof_biased), (stat_biased, dof_biased)


def test_sampled_output_equals_plain_sampled_decoding(tiny_pair):
    """A sampled token depends on its prefix and on noise keyed by (seed, position) alone, so with
    the same seed DFlash emits exactly what plain decoding samples, whatever drafts and widths."""
    spec = load_engine(str(tiny_pair[0]), str(tiny_pair[1]))
    plain = load_engine(str(tiny_pair[0]), draft=None)
    for seed in range(4):
        for prompt in ("Hi", "Tell me a story about the sea."):
            a = spec.generate(prompt, max_tokens=40, temperature=0.8, seed=seed).token_ids
            assert a == plain.generate(prompt, max_tokens=40, temperature=0.8, seed=seed).token_ids
            assert a != plain.generate(prompt, max_tokens=40, temperature=0.8, seed=seed + 100).token_ids
