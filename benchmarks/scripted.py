"""Scripted acceptance: a benchmark-only drafter wrapper whose proposals follow a chosen rate.

Random weights make a drafter propose noise (about one token per cycle), so on its own a
random-weight benchmark can only show the worst case. ``ScriptedDrafter`` wraps the real
drafter and, every cycle:

1. runs the real drafter forward on the real block and context (real compute, every cycle);
2. replaces its output rows with rows that make the target's LM head pick scripted ids: the
   target's known greedy continuation, corrupted at positions drawn independently with
   probability 1 - q. The drafted token at block position i is accepted while no earlier
   position was corrupted, so the accepted length a per cycle is truncated-geometric:
   E[a] = q + q^2 + ... + q^(B-1).

The engine's draft step is ``argmax(target.lm_head(drafter(...)[:, 1:]))``. For id ``s`` the
wrapper returns the LM head's own row ``W[s]``; the logits are then ``W @ W[s]``, largest at
``s`` for random weights (``|W[s]|^2`` against cross terms of relative size ``1/sqrt(hidden)``).
The replacement is ``where(True, W[s], real output)``, so the real output is still computed
and the LM head still runs on every proposed row: only the ids are scripted. No engine code
changes.

Where the continuation comes from: benchmarks zero the target's final-norm scale, so every
target logit is exactly 0 and its greedy choice is token 0 at every position whatever the
numerics (bf16 verify vs decode kernels cannot flip it). Any other known continuation (e.g.
the target's own greedy output recorded in fp32) works the same way.
"""

from __future__ import annotations

import random
from typing import Any, Callable, List, Optional, Sequence

import mlx.core as mx


def per_token_rate(mean_accepted: float, drafted: int) -> float:
    """The q whose truncated geometric gives E[a] = q + ... + q^drafted = mean_accepted (bisection)."""
    if not 0 <= mean_accepted <= drafted:
        raise ValueError(f"mean accepted length must lie in [0, {drafted}], got {mean_accepted}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        q = (lo + hi) / 2
        if sum(q**k for k in range(1, drafted + 1)) < mean_accepted:
            lo = q
        else:
            hi = q
    return (lo + hi) / 2


class AcceptanceScript:
    """Draws which drafted positions are corrupted, cycle by cycle, from a seeded stream.

    Make one with ``of_drafted(rate, B)`` (share of drafted tokens accepted, e.g. 0.89) or
    ``of_tokens_per_cycle(tau, B)`` (mean committed tokens per cycle, bonus included).
    """

    def __init__(self, q: float, block_size: int, seed: int = 0, label: str = ""):
        self.q, self.block_size, self.seed = q, block_size, seed
        self.label = label or f"q={q:.4f}"
        self.reset()

    @classmethod
    def of_drafted(cls, rate: float, block_size: int, seed: int = 0) -> "AcceptanceScript":
        n = block_size - 1
        return cls(per_token_rate(rate * n, n), block_size, seed, f"{rate:.0%} of drafted tokens")

    @classmethod
    def of_tokens_per_cycle(cls, tau: float, block_size: int, seed: int = 0) -> "AcceptanceScript":
        n = block_size - 1
        return cls(per_token_rate(tau - 1, n), block_size, seed, f"{tau:g} tokens per cycle")

    @property
    def expected_accepted(self) -> float:
        return sum(self.q**k for k in range(1, self.block_size))

    def reset(self) -> None:
        self._rng = random.Random(self.seed)
        self.drawn: List[int] = []  # accepted length a of each cycle, as scripted

    def corrupted(self) -> List[bool]:
        """One cycle: corrupted[i] for block positions 1..B-1 (i = 0 is position 1)."""
        flags = [self._rng.random() >= self.q for _ in range(self.block_size - 1)]
        self.drawn.append(flags.index(True) if True in flags else len(flags))
        return flags


class ScriptedDrafter:
    """Wraps a DFlash drafter; same interface (``args``, ``make_cache``, ``add_context``,
    ``__call__``, ``draft_pass``, ``target_hidden_size``), real forward, scripted proposals (each
    batch row draws its own corruptions).

    ``head_rows(ids [n]) -> [n, hidden]`` gives the target LM head's rows. ``reference[j]`` is the
    target's known greedy token j of the generation (at least max_tokens + block_size long);
    None means token 0 everywhere, the choice of a target whose final norm is zeroed.
    """

    def __init__(
        self,
        drafter: Any,
        head_rows: Callable[[mx.array], mx.array],
        script: AcceptanceScript,
        vocab_size: int,
        reference: Optional[Sequence[int]] = None,
    ):
        self.drafter = drafter
        self.head_rows = head_rows
        self.script = script
        self.vocab_size = vocab_size
        self.reference = reference  # None: token 0 at every position (a zeroed final norm)
        self.prompt_len: Optional[int] = None
        self.rows_seen = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["drafter"], name)

    @property
    def args(self):
        return self.drafter.args

    @property
    def target_hidden_size(self) -> int:
        return self.drafter.target_hidden_size

    def start(self, reference: Optional[Sequence[int]]) -> None:
        """Set the known greedy continuation of the next generation's prompt."""
        self.reference = reference

    def make_cache(self, lengths, capacity: int = 0) -> list:
        # A new generation's batch makes a draft cache with its slots; its prompt's context rows
        # come through add_context, which gives the prompt length. The joining group's empty
        # cache (made afresh each time the group empties, engine/prefill.py) starts nothing.
        if lengths is None or len(lengths.host) > 0:
            self.rows_seen, self.prompt_len = 0, None
        return self.drafter.make_cache(lengths, capacity)

    def add_context(self, context: mx.array, cache: list) -> None:
        if self.prompt_len is None:
            self.prompt_len = context.shape[1]
        self.rows_seen += context.shape[1]
        self.drafter.add_context(context, cache)

    def proposals(self) -> List[int]:
        """Scripted ids for block positions 1..B-1 of the coming cycle (one row)."""
        j = self.rows_seen - self.prompt_len  # generated index of the block's first token (last)
        ref = self.reference
        if ref is not None and j + self.args.block_size > len(ref):
            raise IndexError(
                f"reference continuation too short: need {j + self.args.block_size}, have {len(ref)}"
            )
        out = []
        for i, bad in enumerate(self.script.corrupted(), start=1):
            good = 0 if ref is None else ref[j + i]
            out.append((good + 1) % self.vocab_size if bad else good)
        return out

    def __call__(
        self, x: mx.array, context: mx.array, cache: list, counts: Optional[mx.array] = None
    ) -> mx.array:
        real = self.drafter(x, context, cache, counts)  # the real forward: [B, block, H]
        rows = x.shape[0]
        if self.reference is not None and rows > 1:
            raise ValueError(
                "a recorded reference continuation scripts one sequence; batches use token 0"
            )
        self.rows_seen += context.shape[1]
        # Each row draws its own corruptions (position 0's output is not used by the engine).
        ids = mx.array([[0] + self.proposals() for _ in range(rows)])
        return mx.where(mx.array(True), self.head_rows(ids).astype(real.dtype), real)

    def draft_pass(
        self, x: mx.array, context: mx.array, cache: list, counts: Optional[mx.array] = None
    ) -> mx.array:
        # the scripted forward, eager: a replayed trace would not repeat the script's draws (host state)
        return self(x, context, cache, counts)


def head_rows_of(target_model) -> Callable[[mx.array], mx.array]:
    """The LM head's weight rows of an mlx-lm model (the tied embedding when there is no lm_head),
    dequantized where the head is quantized (a quantized row still scores highest against itself)."""
    outer = getattr(target_model, "language_model", target_model)
    head: Optional[Any] = getattr(outer, "lm_head", None)
    if head is None:
        return outer.model.embed_tokens  # a lookup is the row, dequantized by a QuantizedEmbedding
    if "scales" in head:
        biases = head.get("biases")

        def rows(ids: mx.array) -> mx.array:
            return mx.dequantize(
                head["weight"][ids],
                head["scales"][ids],
                None if biases is None else biases[ids],
                group_size=head.group_size,
                bits=head.bits,
                mode=head.mode,
            )

        return rows
    return lambda ids: head.weight[ids]
