"""Sampling controls (top-k, top-p, min-p, repetition / presence / frequency penalties) keep the
distribution plain sampling with the same controls has, under speculation: a statistical test.

The target is the known Markov chain of tests/test_sampling.py (next-token logits depend on the
current token alone, known exactly) and the drafter proposes the chain's most likely path, so
many drafts are checked and kept. For every emitted token the expected distribution is computed
here, in numpy, from its actual prefix (the controls' definition, written out independently of
the engine); a chi-square of the emitted tokens against the summed expected counts, per source
token, must pass. Negative controls, which must fail: the engine with the control switched off,
and (penalties) the engine counting only committed tokens at every verify position, not the
drafts before it.
"""

from __future__ import annotations

from dflash_batch.engine import load_engine, sampling
from dflash_batch.engine.batch import BatchDecoder

import mlx.core as mx
import numpy as np
import pytest

from tests.helpers import CLUSTER, chi_square_critical, markov_engine, set_modes

TEMPERATURE = 0.7
SEEDS = range(80)
TOKENS_PER_RUN = 24
PROMPT_HEAD = [1, 2, 3]

CONTROLS = {
    "top_k": {"top_k": 2},
    "top_p": {"top_p": 0.9},
    "min_p": {"min_p": 0.3},
    "repetition_penalty": {"repetition_penalty": 2.0},
    "presence_penalty": {"presence_penalty": 2.0},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "all": {
        "top_k": 4,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.05,
    },
}


def reference_probs(logits, controls, counts, prompt_seen):
    """The distribution plain sampling with ``controls`` draws from after a prefix whose output
    token counts are ``counts`` (numpy, float64): penalties, temperature, top-k, top-p, min-p."""
    x = logits.astype(np.float64)
    rep = controls.get("repetition_penalty", 1.0)
    seen = (counts > 0) | prompt_seen
    x = np.where(seen, np.where(x > 0, x / rep, x * rep), x)
    x = (
        x
        - controls.get("presence_penalty", 0.0) * (counts > 0)
        - controls.get("frequency_penalty", 0.0) * counts
    )
    s = x / TEMPERATURE
    keep = np.ones_like(s, bool)
    k = controls.get("top_k", 0)
    if k:
        keep &= s >= np.sort(s)[::-1][k - 1]
    p = controls.get("top_p", 1.0)
    if p < 1.0:
        q = _softmax(np.where(keep, s, -np.inf))
        order = np.argsort(-q, kind="stable")
        before = np.cumsum(q[order]) - q[order]
        n = max(int(np.sum(before < p)), 1)
        keep &= s >= s[order[n - 1]]
    m = controls.get("min_p", 0.0)
    if m > 0:
        q = _softmax(s)
        keep &= q >= m * q.max()
    return _softmax(np.where(keep, s, -np.inf))


def propose_likeliest_path(monkeypatch, logits, controls):
    """Drafts = the likeliest path of the controlled chain from each row's committed output (its
    penalties advanced along the path), so that most drafts are kept, penalties included. The real
    drafter still runs (its cache advances as usual)."""
    real = BatchDecoder.draft

    def draft(decoder, last, rows):
        real(decoder, last, rows)
        out = []
        for b, row in enumerate(decoder.rows):
            if row is None:
                out.append([0] * rows)
                continue
            counts = np.bincount(row.history, minlength=logits.shape[0]).astype(float)
            seen = np.zeros(logits.shape[0], bool)
            seen[row.request.ids] = True
            tok, ids = row.last, []
            for _ in range(rows):
                tok = int(np.argmax(reference_probs(logits[tok], controls, counts, seen)))
                counts[tok] += 1
                ids.append(tok)
            out.append(ids)
        return mx.array(out, dtype=mx.int32)

    monkeypatch.setattr(BatchDecoder, "draft", draft)


def _softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def run(engine, controls, logits):
    """Observed and expected next-token counts per source token, and how many tokens were drafts."""
    V = logits.shape[0]
    observed, expected, drafted = {}, {}, 0
    for seed in SEEDS:
        prompt = PROMPT_HEAD + [CLUSTER * (seed % 4) + seed % CLUSTER]
        c = engine.generate(
            prompt, max_tokens=TOKENS_PER_RUN, temperature=TEMPERATURE, seed=seed, **controls
        )
        drafted += c.stats.accepted_tokens
        prompt_seen = np.zeros(V, bool)
        prompt_seen[prompt] = True
        counts = np.zeros(V)
        source = prompt[-1]
        for tok in c.token_ids:
            p = reference_probs(logits[source], controls, counts, prompt_seen)
            expected[source] = expected.get(source, 0) + p
            observed.setdefault(source, np.zeros(V))[tok] += 1
            counts[tok] += 1
            source = tok
    return observed, expected, drafted


def chi_square(observed, expected, min_visits=30):
    """Pearson's statistic per source token with enough visits (bins expected < 5 pooled; a token
    emitted where it was impossible counts as a huge deviation), and its degrees of freedom."""
    stat, dof = 0.0, 0
    for a, obs in observed.items():
        if obs.sum() < min_visits:
            continue
        exp = expected[a]
        big = exp >= 5
        o = list(obs[big]) + [obs[~big].sum()]
        e = list(exp[big]) + [exp[~big].sum()]
        stat += sum((oi - ei) ** 2 / max(ei, 1e-6) for oi, ei in zip(o, e))
        dof += len(o) - 1
    return stat, dof


@pytest.fixture(scope="module")
def chain(tiny_pair):
    engine, _ = markov_engine(*tiny_pair)
    model = engine.target.model
    vocab = model.args.vocab_size
    logits = np.array(model(mx.arange(vocab)[:, None])[:, 0, :].astype(mx.float32))
    return engine, logits


@pytest.mark.parametrize("name", list(CONTROLS))
def test_control_keeps_plain_sampling_distribution(chain, monkeypatch, name):
    # chains: rows with controls verify chains; negative control 1 switches the controls
    # off, which would make its rows verify trees, and the scripted drafts here are chains
    engine, logits = chain
    set_modes(monkeypatch, engine, drafts="chain")
    controls = CONTROLS[name]
    propose_likeliest_path(monkeypatch, logits, controls)

    observed, expected, drafted = run(engine, controls, logits)
    stat, dof = chi_square(observed, expected)
    total = sum(o.sum() for o in observed.values())
    assert dof >= 4, dof
    assert drafted > total // 5, (
        drafted,
        total,
    )  # drafts were kept: the verify positions were exercised
    assert stat < chi_square_critical(dof), (stat, dof)

    # Negative control 1: the control switched off in the engine; the same test must fail.
    with monkeypatch.context() as m:
        m.setattr(sampling, "penalized", lambda r: False)
        m.setattr(sampling, "filtered", lambda r: False)
        off_stat, off_dof = chi_square(*run(engine, controls, logits)[:2])
    assert off_stat > 3 * chi_square_critical(off_dof), (name, off_stat, off_dof)

    # Negative control 2 (penalties): counting only committed tokens at every verify position, not
    # the drafts before it (the bug this guards against); rejected at p < 1e-6. not
    # the drafts before it (the bug this guards against); rejected at p < 1e-6.
    if any(k.endswith("penalty") for k in controls):
        real = sampling._penalize
        with monkeypatch.context() as m:
            m.setattr(
                sampling, "_penalize", lambda lg, req, hist, drafted: real(lg, req, hist, None)
            )
            bad_stat, bad_dof = chi_square(*run(engine, controls, logits)[:2])
        assert bad_stat > chi_square_critical(bad_dof, z=4.75), (
            name,
            bad_stat,
            bad_dof,
        )  # p < 1e-6


def test_controls_per_row_in_one_batch_equal_plain_decoding(tiny_pair):
    """Rows with different controls (greedy and sampled) decoded together, with DFlash, emit
    exactly what plain decoding of each prompt alone emits with the same seed and controls."""
    spec = load_engine(str(tiny_pair[0]), str(tiny_pair[1]))
    plain = load_engine(str(tiny_pair[0]), draft=None)
    rows = [
        ("Hi", dict(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.4)),
        ("Tell me a story about the sea.", dict(temperature=0.9, top_k=3)),
        ("Hi", dict(temperature=0.9, top_p=0.5, presence_penalty=1.0)),
        ("Write a list.", dict(temperature=1.2, min_p=0.2, repetition_penalty=0.8)),
        ("Write a list.", dict(temperature=0.6)),
    ]
    for i, (prompt, kw) in enumerate(rows):
        alone = plain.generate(prompt, max_tokens=30, seed=7 + i, **kw).token_ids
        assert (
            spec.generate_batch([prompt], max_tokens=30, seed=7 + i, **kw)[0].token_ids == alone
        ), (i, kw)
    # all rows in one batch: per-row options go through Engine.run
    requests = [spec.request(p, 30, seed=7 + i, index=i, **kw) for i, (p, kw) in enumerate(rows)]
    together = dict(spec.run(requests, batch_size=len(rows)))
    for i, (prompt, kw) in enumerate(rows):
        assert (
            together[i].token_ids
            == plain.generate(prompt, max_tokens=30, seed=7 + i, **kw).token_ids
        ), (i, kw)
