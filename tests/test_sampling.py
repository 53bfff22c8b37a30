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

from dflash_batch.engine import decode, load_engine, tree
from dflash_batch.engine.batch import BatchDecoder

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers import chi_square, chi_square_critical, markov_engine, transitions


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
                cands.append(
                    order[tok, : max(candidates, 1)]
                )  # a tree's: the chain's next-token law
                tok = int(best[tok])
                ids.append(tok)
            out.append(ids)
            top.append(cands)
        if not candidates:
            return mx.array(out, dtype=mx.int32)
        top = np.array(top)
        prev = np.concatenate(
            [last.tolist(), np.array(out)[:, :-1]], axis=1
        )  # each position's conditioning token
        logprobs = np.log(np.take_along_axis(probs[prev], top, axis=2) + 1e-30)
        return mx.array(top, dtype=mx.int32), mx.array(logprobs.astype(np.float32))

    monkeypatch.setattr(BatchDecoder, "draft", draft)


def _first_children(parents):
    path = [0]
    for i, p in enumerate(parents):
        if i and p == path[-1]:
            path.append(i)
    return path


@pytest.mark.parametrize("drafts", ["chain", "tree"])
def test_sampling_keeps_the_target_distribution(tiny_pair, monkeypatch, drafts):
    monkeypatch.setenv(
        "DFLASH_BATCH_DRAFTS", drafts
    )  # engine/tree.py: a tree's nodes sample as a chain's positions do
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
    monkeypatch.setattr(
        tree, "walk", lambda trees, chosen: [_first_children(parents) for parents in trees.parents]
    )
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
            assert (
                a
                != plain.generate(prompt, max_tokens=40, temperature=0.8, seed=seed + 100).token_ids
            )
