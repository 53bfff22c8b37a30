"""Logprobs: each emitted token's log-probability and its top alternatives come from the target's
own raw distribution (log_softmax of its logits, before temperature, penalties, filters or a
grammar), at the token's real prefix, also for tokens that were the drafter's proposals."""

from __future__ import annotations

from dflash_batch.engine import load_engine

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_load

from tests.scripting import ScriptedDrafts


def reference_logprobs(folder, ids, out):
    """log_softmax of the target's logits at the positions that predicted ``out`` (mlx-lm, one pass)."""
    model, _ = mlx_load(str(folder))
    logits = model(mx.array([ids + out]))[0].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return lp[len(ids) - 1 : len(ids) - 1 + len(out)]


@pytest.mark.parametrize(
    "options",
    [
        dict(temperature=0.0),
        dict(temperature=0.8, repetition_penalty=1.3, top_k=20, seed=3),
        dict(temperature=0.0, response_format={"type": "regex", "regex": "[a-z ]{5,40}"}),
    ],
)
def test_logprobs_are_the_targets_raw_ones(tiny_pair, monkeypatch, options):
    spec = load_engine(str(tiny_pair[0]), str(tiny_pair[1]), adaptive_block=False)
    plain = load_engine(str(tiny_pair[0]), draft=None)
    scripted = ScriptedDrafts(monkeypatch)
    ids = spec.encode("Tell me a story about the sea.")
    ref = plain.generate(ids, max_tokens=40, **options)
    scripted(ids + ref.token_ids + [0] * 16, p_wrong=0.2, seed=1)
    c = spec.generate(ids, max_tokens=40, logprobs=True, top_logprobs=5, **options)
    assert c.token_ids == ref.token_ids and c.stats.accepted_tokens > 2
    assert ref.logprobs is None  # not asked: none
    assert [e["token_id"] for e in c.logprobs] == c.token_ids
    lp = reference_logprobs(tiny_pair[0], ids, c.token_ids)
    for j, entry in enumerate(c.logprobs):
        assert entry["logprob"] == pytest.approx(lp[j, entry["token_id"]], abs=1e-4)
        best = np.argsort(-lp[j])[:5]
        assert [t["token_id"] for t in entry["top_logprobs"]] == best.tolist()
        assert [t["logprob"] for t in entry["top_logprobs"]] == pytest.approx(
            lp[j, best].tolist(), abs=1e-4
        )
        assert entry["token"] == spec.tokenizer.decode([entry["token_id"]])


def test_logprobs_without_alternatives(tiny_pair):
    spec = load_engine(str(tiny_pair[0]), str(tiny_pair[1]))
    c = spec.generate("Hi", max_tokens=8, logprobs=True)
    assert len(c.logprobs) == len(c.token_ids) and all(e["top_logprobs"] == [] for e in c.logprobs)
    assert all(e["logprob"] <= 0 for e in c.logprobs)
