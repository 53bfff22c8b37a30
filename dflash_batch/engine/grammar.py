"""Grammar-constrained decoding (llguidance): per-row matchers and the masks of a verify pass.

A row with a grammar (dflash_batch/constraints.py turns a ``response_format`` into one) holds an
``llguidance.LLMatcher`` at its committed output. For a verify pass over [last, d_1..d_(T-1)]
the mask of position i is the set of tokens the grammar allows after the committed output and
d_1..d_i: llguidance walks the matcher along the drafts and rolls it back
(``fill_next_token_bitmask_par_with_draft_tokens``). A draft the grammar forbids stops the walk;
the target's choice at that position is masked, so it differs from the forbidden draft and
acceptance ends there. After acceptance the matcher consumes the committed tokens.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import mlx.core as mx
import numpy as np


class Grammars:
    """The engine's grammar tools, built on first use: the tokenizer as llguidance sees it (about a
    second to build) and a thread pool for the masks."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf

        hf = getattr(tokenizer, "_tokenizer", tokenizer)
        eos = sorted(tokenizer.eos_token_ids) or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf, eos_token=eos)
        self.vocab_size = vocab_size  # of the logits (may exceed the tokenizer's)
        self.words = (
            max(vocab_size, self.tokenizer.vocab_size) + 31
        ) // 32  # 32-bit words per mask
        self.executor = llguidance.LLExecutor()
        self._llguidance = llguidance

    def matcher(self, grammar: str):
        m = self._llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise ValueError(f"response_format: {_first_line(m.get_error())}")
        return m

    def masks(self, walks: Sequence[Tuple[int, object, List[int]]], B: int, T: int) -> mx.array:
        """Allowed tokens, packed: [B, T, words] uint32, bit v % 32 of word v // 32 set where token
        v is allowed (engine/sampling.py: ``masked`` applies them). ``walks``: (row, matcher, the
        row's drafts d_1..d_(T-1)) for the constrained rows; the other rows allow everything, and
        so do positions past a draft the grammar forbids (llguidance stops the walk there)."""
        from llguidance.numpy import (
            fill_next_token_bitmask_par,
            fill_next_token_bitmask_par_with_draft_tokens,
        )

        bits = np.full((B * T, self.words), -1, np.int32)
        along = [(m, b * T, list(d)) for b, m, d in walks if len(d)]
        if along:
            fill_next_token_bitmask_par_with_draft_tokens(self.executor, along, bits)
        here = [(m, b * T) for b, m, d in walks if not len(d)]
        if here:
            fill_next_token_bitmask_par(self.executor, here, bits)
        # kept packed: unpacked inside the one fused op that applies them, no [B, T, V] bool in memory
        return mx.array(bits.view(np.uint32).reshape(B, T, self.words))

    def draft(self, matchers: list, ids: List[List[int]], logits: mx.array) -> List[List[int]]:
        """Drafts of constrained rows: at each position the drafter's likeliest token the grammar
        allows after the drafts before it. ``ids`` [C][rows]: the drafter's argmax, kept where the
        grammar allows it (a bit test); elsewhere the argmax of that position's logits (``logits``
        [C, rows, V], read only there) under the mask. The matchers are walked along the drafts,
        then rolled back. A row whose grammar is done stops early; its remaining drafts stay the
        drafter's own."""
        from llguidance.numpy import fill_next_token_bitmask

        bits = np.zeros((1, self.words), np.int32)
        out: List[List[int]] = []
        host = None  # the logits on the host, fetched once when a position first needs them
        for c, matcher in enumerate(matchers):
            walked: List[int] = []
            for i, tok in enumerate(ids[c]):
                if matcher.is_stopped():
                    break
                fill_next_token_bitmask(matcher, bits, 0)
                words = bits[0].view(np.uint32)
                if not (words[tok >> 5] >> (tok & 31)) & 1:
                    if not words.any():
                        break
                    allowed = np.flatnonzero(
                        np.unpackbits(bits[0].view(np.uint8), bitorder="little")[: self.vocab_size]
                    )
                    if host is None:
                        host = np.array(logits.astype(mx.float32))
                    # ties: the lowest id, as mx.argmax
                    tok = int(allowed[np.argmax(host[c, i, allowed])])
                if not matcher.consume_token(tok):
                    break
                walked.append(tok)
            if walked:
                matcher.rollback(len(walked))
            out.append(walked)
        return out

    @staticmethod
    def commit(matcher, tokens: List[int]) -> None:
        """Advance a row's matcher over the tokens it committed (each allowed by its mask); raises
        where the grammar library cannot follow (that row's error: engine/batch.py)."""
        if not matcher.consume_tokens(tokens) or matcher.is_error():
            why = _first_line(matcher.get_error())
            raise RuntimeError(
                f"response_format: the grammar library refused tokens {tokens}: {why}"
            )


def _first_line(error: str) -> str:
    """llguidance's message without the parser state dump that follows it."""
    return error.strip().splitlines()[0] if error.strip() else "no reason given"
