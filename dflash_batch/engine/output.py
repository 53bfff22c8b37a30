"""One sequence's output: committed tokens -> text, cut by EOS, stop strings or its budget, with its
own statistics. Batch-independent: a row's text and counts are the same whatever rows share its
passes."""

from __future__ import annotations

import time
from typing import List, Optional, Sequence

import mlx.core as mx

from ..completion import GenerationStats, Piece
from .decode import Step
from .stopping import StopText


class RowOutput:
    """Feeds one row's Steps through EOS, stop strings and ``max_tokens``; ``feed`` returns the
    Piece to emit (``finish_reason`` set on the last one)."""

    def __init__(
        self,
        tokenizer,
        prompt_tokens: int,
        max_tokens: int,
        stops: Sequence[str],
        block_size: int,
        control: bool = False,
    ):
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer
        self.eos = frozenset(tokenizer.eos_token_ids)
        self.detok = tokenizer.detokenizer
        self.text = StopText(stops)
        self.stats = GenerationStats(
            prompt_tokens=prompt_tokens,
            block_size=block_size,
            acceptance_histogram=[0] * (max(block_size, 1) + 1),
            plain_seconds_est=0.0,
            control=control,
        )
        self.started = self.decode_started = time.perf_counter()
        self.done = False
        self.cycle_share: float = 0.0  # the current cycle's seconds per row in flight (``timed``)
        # and a plain cycle's, per row: one token's plain cost
        self.plain_token: Optional[float] = None

    def timed(self, share: float, plain_token: Optional[float]) -> None:
        """The cycle whose step comes next took ``share`` seconds per row in flight; a plain cycle
        at that batch size costs ``plain_token`` per row (None: not measured)."""
        self.cycle_share, self.plain_token = share, plain_token

    def start(self) -> None:
        """The row's prefill begins now (it may have waited for a slot)."""
        self.started = self.decode_started = time.perf_counter()

    def feed(self, step: Step) -> Piece:
        stats = self.stats
        now = time.perf_counter()
        if step.decoded:
            stats.cycles += 1
            stats.drafted_tokens += step.drafted
            stats.acceptance_histogram[len(step.tokens)] += 1
        else:
            stats.prefill_s, self.decode_started = now - self.started, now
        before = stats.generated_tokens
        if not self.text.stops and step.logprobs is None:
            finish, stop_reason, ids, text, scores = self._feed_plain(step.tokens, step.from_draft)
        else:
            finish, stop_reason, ids, text, scores = self._feed_each(step)
        if step.decoded:
            self._saved(stats.generated_tokens - before)
        if finish is None:
            return Piece(text=text, token_ids=ids, logprobs=scores)
        if stop_reason is None or stop_reason == "eos":
            self.detok.finalize()
            text += self.text.feed(self.detok.last_segment)[0]
        stats.decode_s = time.perf_counter() - self.decode_started
        stats.peak_memory_gb = mx.get_peak_memory() / 1e9
        self.done = True
        return Piece(text + self.text.flush(), ids, finish, stats, stop_reason, scores)

    def _saved(self, used: int) -> None:
        """Count a cycle's share, and what its ``used`` tokens (not those past an EOS or the
        budget) cost plain: a plain cycle's share each. One cycle of no measured plain cost
        leaves the row without an estimate."""
        stats = self.stats
        stats.decode_share_s += self.cycle_share
        if self.plain_token is None or stats.plain_seconds_est is None:
            stats.plain_seconds_est = None
        else:
            stats.plain_seconds_est += used * self.plain_token

    def _feed_plain(self, tokens: List[int], from_draft: int):
        """``_feed_each`` for a row without stop strings or logprobs, the text read once per step
        (the detokenizer's segments of one token at a time join to the same text): the step ends
        at its first EOS (counted, not emitted) or at the token that spends the budget."""
        stats = self.stats
        eos = (
            None
            if self.eos.isdisjoint(tokens)
            else next(i for i, t in enumerate(tokens) if t in self.eos)
        )
        # index of the budget's last token
        last = max(self.max_tokens - stats.generated_tokens - 1, 0)
        finish = stop_reason = None
        if eos is not None and eos <= last:
            used, ids, finish, stop_reason = eos + 1, tokens[:eos], "stop", "eos"
        elif last < len(tokens):
            used, ids, finish = last + 1, tokens[: last + 1], "length"
        else:
            used, ids = len(tokens), list(tokens)
        stats.generated_tokens += used
        stats.accepted_tokens += min(used, from_draft)
        add = self.detok.add_token
        for tok in ids:
            add(tok)
        return finish, stop_reason, ids, self.text.feed(self.detok.last_segment)[0], None

    def _feed_each(self, step: Step):
        """Token by token: EOS, logprobs, stop strings in the text so far, the budget."""
        stats = self.stats
        finish: Optional[str] = None
        stop_reason: Optional[str] = None
        ids, text = [], ""
        scores = [] if step.logprobs is not None else None
        for i, tok in enumerate(step.tokens):
            stats.generated_tokens += 1
            stats.accepted_tokens += i < step.from_draft
            if tok in self.eos:
                finish, stop_reason = "stop", "eos"
                break
            ids.append(tok)
            if scores is not None:
                scores.append(self._logprob(tok, *step.logprobs[i]))
            self.detok.add_token(tok)
            emitted, hit = self.text.feed(self.detok.last_segment)
            text += emitted
            if hit is not None:
                finish, stop_reason = "stop", hit
                break
            if stats.generated_tokens >= self.max_tokens:
                finish = "length"
                break
        return finish, stop_reason, ids, text, scores

    def _logprob(self, token: int, logprob: float, top) -> dict:
        """One token's entry of ``Completion.logprobs``."""
        entry = {"token": self.tokenizer.decode([token]), "token_id": token, "logprob": logprob}
        entry["top_logprobs"] = [
            {"token": self.tokenizer.decode([t]), "token_id": t, "logprob": v} for t, v in top
        ]
        return entry
