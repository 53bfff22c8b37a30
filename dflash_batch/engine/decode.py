"""The DFlash decode loop, one short function per step.

Per cycle, with B = block size and ``last`` the newest committed token (not yet in the cache):

    draft:   d_1..d_{B-1} = argmax lm_head(drafter([last, MASK x (B-1)], new context rows))
    verify:  t_0..t_{L-1} = choose(target([last, d_1..d_{L-1}]))        L = min(B, budget)
    accept:  a = longest prefix with d_{i+1} == t_i;  commit d_1..d_a, then the bonus t_a
    rollback: the target cache keeps last, d_1..d_a (a+1 rows); the bonus becomes ``last``
    context: the a+1 verify rows of tapped hidden state feed the next draft

Every committed token is the target's own choice given the committed prefix, so greedy
output equals plain greedy decoding of the target.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, List, Optional

import mlx.core as mx

from .target import Target

Chooser = Callable[[mx.array], mx.array]  # logits [1, L, V] -> token ids [1, L]


@dataclass
class Step:
    """Tokens committed by one target pass (prefill, verify cycle or AR step)."""

    tokens: List[int]
    from_draft: int = 0  # leading tokens that were the drafter's proposals
    drafted: int = 0  # draft tokens put up for verification in this pass
    verify: bool = False  # a verify cycle (or an AR step), not the prefill


def make_chooser(temperature: float = 0.0, seed: Optional[int] = None) -> Chooser:
    """Greedy argmax at temperature 0, else a categorical sample per position.

    With sampling, a draft token is kept only if it equals the target's own sample at its
    position, so every emitted token is still distributed as the target's sample.
    """
    if temperature <= 0:
        return lambda logits: mx.argmax(logits, axis=-1)
    key = mx.random.key(seed if seed is not None else int.from_bytes(os.urandom(4), "little"))

    def sample(logits: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        return mx.random.categorical(logits.astype(mx.float32) / temperature, key=sub)

    return sample


def prefill(target: Target, prompt: List[int], cache: list, chunk: int):
    """Run the prompt in chunks; return the last logits and the tapped hidden state of every row."""
    hidden = []
    logits = None
    for i in range(0, len(prompt), chunk):
        logits, h = target(mx.array([prompt[i : i + chunk]]), cache)
        if h is not None:
            hidden.append(h)
        mx.eval(logits, hidden[-1:])
    context = mx.concatenate(hidden, axis=1) if len(hidden) > 1 else (hidden[0] if hidden else None)
    return logits[:, -1:, :], context


def draft_block(
    drafter, target: Target, last: mx.array, context: mx.array, cache: list, rows: Optional[int] = None
) -> mx.array:
    """Propose tokens in one drafter pass: ids [1, rows] (default B-1; position 0's output is unused).

    The drafter always runs the whole block; only the LM head is cut to the rows to be verified.
    """
    B = drafter.args.block_size
    block = mx.concatenate([last, mx.full((1, B - 1), drafter.args.mask_token_id, dtype=last.dtype)], axis=1)
    h = drafter(target.embed(block), context, cache)
    n = B - 1 if rows is None else rows
    return mx.argmax(target.lm_head(h[:, 1 : 1 + n, :]), axis=-1).astype(last.dtype)


class VerifyLength:
    """How many rows to verify next cycle: the whole block, or fewer while drafts keep failing.

    A verify row costs little on a GPU but a few percent of a pass on a CPU, and rows past the
    first wrong draft are wasted. Adaptive mode aims at twice the recent mean committed length
    (at least ``floor``) and doubles after a fully accepted block to look further ahead.
    """

    def __init__(self, block: int, adaptive: bool, floor: int = 4, window: int = 8):
        self.block, self.adaptive, self.floor = block, adaptive, min(floor, block)
        self.cap, self.recent, self.window = block, [], window

    def update(self, committed: int, verified: int) -> None:
        if not self.adaptive:
            return
        self.recent = (self.recent + [committed])[-self.window :]
        if committed == verified:
            self.cap = min(self.block, 2 * self.cap)
        else:
            mean = sum(self.recent) / len(self.recent)
            self.cap = min(self.block, max(self.floor, math.ceil(2 * mean)))


def accept_length(drafted: List[int], chosen: List[int]) -> int:
    """a = number of leading draft tokens equal to the target's choice one position earlier."""
    a = 0
    while a < len(drafted) and drafted[a] == chosen[a]:
        a += 1
    return a


def dflash_steps(
    target: Target,
    drafter,
    prompt: List[int],
    max_tokens: int,
    choose: Chooser,
    prefill_chunk: int = 2048,
    block_size: Optional[int] = None,
    adaptive: bool = False,
) -> Iterator[Step]:
    """Yield committed tokens, one Step per target pass, until ``max_tokens`` are committed.

    ``block_size`` caps the verified rows per cycle; the drafter always runs at its own size.
    ``adaptive`` verifies fewer rows while acceptance is low (see VerifyLength).
    """
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    logits, context = prefill(target, prompt, cache, prefill_chunk)
    first = choose(logits)
    yield Step(tokens=first.tolist()[0])
    last, produced = first.astype(mx.int32), 1
    B = min(block_size or drafter.args.block_size, drafter.args.block_size)
    length = VerifyLength(B, adaptive)
    while produced < max_tokens:
        L = min(length.cap, max_tokens - produced)  # never verify more than the budget can commit
        if L > 1:
            drafted = draft_block(drafter, target, last, context, draft_cache, L - 1)
        else:  # the budget's last token: the target alone picks it
            drafted = mx.zeros((1, 0), dtype=mx.int32)
        logits, hidden = target.verify(mx.concatenate([last, drafted], axis=1), cache)
        chosen = choose(logits)
        d, t = drafted.tolist()[0], chosen.tolist()[0]  # the cycle's one host sync
        a = accept_length(d, t)
        target.rollback(cache, keep=a + 1, verified=L)
        context = hidden[:, : a + 1, :]
        last = chosen[:, a : a + 1].astype(mx.int32)
        produced += a + 1
        length.update(a + 1, L)
        yield Step(tokens=d[:a] + [t[a]], from_draft=a, drafted=L - 1, verify=True)


def ar_steps(
    target: Target, prompt: List[int], max_tokens: int, choose: Chooser, prefill_chunk: int = 2048
) -> Iterator[Step]:
    """Plain autoregressive decoding with the same interface (used when there is no drafter).

    Step n+1 is queued on the device before step n's token is read back, as mlx-lm does.
    """
    cache = target.make_cache()
    logits, _ = prefill(target, prompt, cache, prefill_chunk)
    token = choose(logits).astype(mx.int32)
    mx.async_eval(token)
    for n in range(max_tokens):
        if n + 1 < max_tokens:
            logits, _ = target(token, cache)
            queued = choose(logits[:, -1:, :]).astype(mx.int32)
            mx.async_eval(queued)
        yield Step(tokens=token.tolist()[0], verify=n > 0)
        token = queued
