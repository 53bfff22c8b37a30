"""Scripted drafts for tests: the drafter's proposals replaced by a known continuation,
corrupted at random positions, so that every acceptance length goes through verify, accept and
rollback. The real drafter still runs every cycle (its cache advances as usual); only the
proposed ids change."""

from __future__ import annotations

import random
from typing import List, Tuple

from dflash_batch.engine.batch import BatchDecoder

import mlx.core as mx


class ScriptedDrafts:
    """``script(reference, p_wrong, seed)`` registers a row's reference: its prompt ids followed
    by the target's own continuation. Each batch row finds the reference that starts with its
    prompt (the latest registered wins), and drafts ``reference[pos + 1 ..]`` from the position
    ``pos`` of its newest token, each id replaced by a wrong one with probability ``p_wrong``."""

    def __init__(self, monkeypatch):
        self.references: List[Tuple[List[int], float, random.Random]] = []
        real = BatchDecoder.draft
        script = self

        def draft(decoder: BatchDecoder, last: mx.array, rows: int, candidates: int = 0):
            real(decoder, last, rows, **({"candidates": candidates} if candidates else {}))
            block = decoder.drafter.args.block_size
            out, truth = [], []
            for b, row in enumerate(decoder.rows):
                if row is None:
                    out.append([0] * rows)
                    truth.append([0] * rows)
                    continue
                ref, p_wrong, rng = script.find(row.request.ids)
                pos = decoder.lengths.host[b]  # the position of the row's newest token
                ids, true_ids = [], []
                for i in range(1, block):
                    true = ref[pos + i] if pos + i < len(ref) else 0
                    ids.append((true + 1) % 100 if rng.random() < p_wrong else true)
                    true_ids.append(true)
                out.append(ids[:rows])
                truth.append(true_ids[:rows])
            if not candidates:
                return mx.array(out, dtype=mx.int32)
            return scripted_candidates(out, truth, candidates)

        monkeypatch.setattr(BatchDecoder, "draft", draft)

    def __call__(self, reference: List[int], p_wrong: float, seed: int = 0) -> None:
        self.references.append((list(reference), p_wrong, random.Random(seed)))

    def find(self, prompt: List[int]):
        for ref in reversed(self.references):
            if ref[0][: len(prompt)] == list(prompt):
                return ref
        raise KeyError(f"no scripted reference starts with prompt {prompt[:8]}...")


def scripted_candidates(drafts: List[List[int]], truth: List[List[int]], count: int):
    """A draft tree's candidates [B, P, count] for scripted drafts: the scripted token first, then
    the true one where the script corrupted it (a tree that branches finds it), then other wrong
    ids; log-probabilities -0.2, -1, -3, -4, ... (engine/tree.py)."""
    ids = []
    for row_d, row_t in zip(drafts, truth):
        ids.append([])
        for d, t in zip(row_d, row_t):
            second = t if d != t else (t + 2) % 100
            ids[-1].append([d, second] + [(t + 3 + j) % 100 for j in range(count - 2)])
    logprobs = [-0.2, -1.0] + [-3.0 - j for j in range(count - 2)]
    B, P = len(ids), len(ids[0])
    return mx.array(ids, dtype=mx.int32), mx.broadcast_to(mx.array(logprobs), (B, P, count))
