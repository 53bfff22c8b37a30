"""What a generation returns: plain data, no MLX, shared by the engine and the runner."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import List, Optional

# re-exported: the engine and the runner import these from here
from .errors import EmptyPromptError, GenerationError, ModelMismatchError, PromptTooLongError  # noqa: F401


@dataclass
class GenerationStats:
    """Per-item counters. Raw counts are kept so every derived rate can be recomputed.

    A verify cycle drafts ``block_size - 1`` tokens and commits ``a + 1`` of them: the ``a``
    drafted tokens that match the target's own choice, plus one bonus token from the target.
    ``acceptance_histogram[k]`` counts cycles that committed ``k`` tokens (0 only if a cycle was
    cut before committing, which does not happen; index runs 0..block_size).
    """

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cycles: int = 0  # target verify passes (or AR steps when no drafter)
    drafted_tokens: int = 0  # draft tokens put up for verification
    accepted_tokens: int = 0  # draft tokens the target agreed with, counted where they were emitted
    block_size: int = 0  # 0 means plain autoregressive decoding
    acceptance_histogram: List[int] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    # What speculation saved (docs/runner.md): the row's share of the decode cycles it rode in
    # (each cycle's seconds divided among the rows in flight), and what its committed tokens
    # would have taken with plain decoding at those batch sizes, from the measured plain-cycle
    # cost (None where none was measured: a fixed verify width).
    decode_share_s: float = 0.0
    plain_seconds_est: Optional[float] = None
    control: bool = False  # decoded plainly in a drafting batch, as a check (``--control``)

    # Rates are None where they are undefined (nothing to divide by), never a made-up 0.

    @property
    def prefill_tps(self) -> Optional[float]:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else None

    @property
    def decode_tps(self) -> Optional[float]:
        # The first token comes from prefill; decode rate counts the ones after it.
        n = self.generated_tokens - 1
        return n / self.decode_s if n > 0 and self.decode_s > 0 else None

    @property
    def tokens_per_cycle(self) -> Optional[float]:
        """Mean acceptance length tau: committed tokens per verify cycle, bonus included."""
        committed = sum(k * n for k, n in enumerate(self.acceptance_histogram))
        return committed / self.cycles if self.cycles else None

    @property
    def acceptance_drafted(self) -> Optional[float]:
        """accepted / drafted: the share of proposed draft tokens the target kept."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def acceptance_generated(self) -> Optional[float]:
        """accepted / generated: the share of output tokens that came from the drafter."""
        return self.accepted_tokens / self.generated_tokens if self.generated_tokens else None

    @property
    def speedup_vs_plain(self) -> Optional[float]:
        """plain_seconds_est / decode_share_s: how many times faster than plain decoding the
        row's tokens were committed."""
        if self.plain_seconds_est is None or self.decode_share_s <= 0:
            return None
        return self.plain_seconds_est / self.decode_share_s

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in (
            "prefill_tps",
            "decode_tps",
            "tokens_per_cycle",
            "acceptance_drafted",
            "acceptance_generated",
            "speedup_vs_plain",
        ):
            d[name] = getattr(self, name)
        return d


@dataclass
class Completion:
    text: str
    token_ids: List[int]
    finish_reason: str  # "stop" (EOS id or stop string) or "length" (max_tokens)
    stats: GenerationStats
    stop_reason: Optional[str] = None  # the stop string or "eos" that ended it, if any
    sample_index: int = 0  # which of the prompt's n samples this is
    # With logprobs asked: one entry per token id, {"token", "token_id", "logprob", "top_logprobs":
    # [{"token", "token_id", "logprob"}, ...]}, raw log-probabilities of the target (docs/sampling.md)
    logprobs: Optional[List[dict]] = None
    # the prompt as the target read it (template applied): with token_ids, what training needs
    prompt_token_ids: Optional[List[int]] = None


@dataclass
class Piece:
    """One streamed step: the text and tokens committed since the previous piece."""

    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    stats: Optional[GenerationStats] = None  # set on the last piece
    stop_reason: Optional[str] = None  # "eos" or the stop string, on the last piece
    logprobs: Optional[List[dict]] = None  # one per token id, when asked (see Completion)
