"""Scripted drafts for tests: the drafter's proposals replaced by a known continuation,
corrupted at random positions, so that every acceptance length goes through verify, accept and
rollback. The real drafter still runs every cycle (its cache advances as usual); only the
proposed ids change."""

from __future__ import annotations

import random
from typing import List, Tuple

import mlx.core as mx

from dflash_batch.engine.batch import BatchDecoder


class ScriptedDrafts:
    """``script(reference, p_wrong, seed)`` registers a row's reference: its prompt ids followed
    by the target's own continuation. Each batch row finds the reference that starts with its
    prompt (the latest registered wins), and drafts ``reference[pos + 1 ..]`` from the position
    ``pos`` of its newest token, each id replaced by a wrong one with probability ``p_wrong``."""

    def __init__(self, monkeypatch):
        self.references: List[Tuple[List[int], float, random.Random]] = []
        real = BatchDecoder.draft
        script = self

        def draft(decoder: BatchDecoder, last: mx.array, rows: int) -> mx.array:
            real(decoder, last, rows)
            block = decoder.drafter.args.block_size
            out = []
            for b, row in enumerate(decoder.rows):
                if row is None:
                    out.append([0] * rows)
                    continue
                ref, p_wrong, rng = script.find(row.request.ids)
                pos = decoder.lengths.host[b]  # the position of the row's newest token
                ids = []
                for i in range(1, block):
                    true = ref[pos + i] if pos + i < len(ref) else 0
                    ids.append((true + 1) % 100 if rng.random() < p_wrong else true)
                out.append(ids[:rows])
            return mx.array(out, dtype=mx.int32)

        monkeypatch.setattr(BatchDecoder, "draft", draft)

    def __call__(self, reference: List[int], p_wrong: float, seed: int = 0) -> None:
        self.references.append((list(reference), p_wrong, random.Random(seed)))

    def find(self, prompt: List[int]):
        for ref in reversed(self.references):
            if ref[0][: len(prompt)] == list(prompt):
                return ref
        raise KeyError(f"no scripted reference starts with prompt {prompt[:8]}...")

