"""The engine's settings in one object, checked once when it is made: ``load_engine(**kw)`` and
``Engine(..., **kw)`` build it from their keywords, so a bad value is refused before any model
is loaded. None means the default, resolved by the engine where it depends on the device."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from .ops import switch
from .widths import CostModel

PREFIX_CACHE_MB = 1024  # memory for shared prompt prefixes, by default


@dataclass(slots=True)
class EngineConfig:
    """Args:
    block_size: verify at most this many tokens per cycle (at most the drafter's own).
    adaptive_block: choose each cycle's verify width from measured pass costs and each row's
        acceptance, down to plain decoding (default on); False: the whole block.
    prefill_chunk: prompt tokens per prefill pass of one prompt (and per engine step and free
        slot for joining prompts); default 512 on a CPU, 2048 on a GPU
        (``memory.default_prefill``).
    prefill_tokens: most tokens in one packed prefill pass (joining prompts x tokens each);
        default 4096 on a CPU, 8192 on a GPU.
    prefill_rows: most prompts prefilled together (None: as many as there are free slots;
        1: one prompt per pass).
    prefix_cache_mb: memory for prompt prefixes prefilled once and reused by the prompts that
        share them (least recently used dropped; default 1024); 0: every prompt prefilled alone.
    prefix_granularity: shared prefixes are kept at multiples of this many tokens (and at whole
        prompts, for the samples of one prompt).
    max_context: refuse prompts this long or longer (default: the target config's limit).
    batch_size: most sequences decoded together (default: 32 on a GPU, 16 on CPU; fewer when
        memory holds fewer).
    cost_model: the pass costs the adaptive width is chosen from, in place of timing passes at
        warm-up (engine/widths.py); with ``window=0`` no timing steers the widths, so runs
        choose the same widths on any machine under any load (tests). Its ``route`` is the
        ragged attention route the engine's runs take (None: "block").
    attention, matmul, passes, drafts, cpu_ops: the routing modes (engine/ops/switch.py,
        ``SWITCHES``); None: the environment variable, else the backend's default. This
        engine's steps run under them, whatever another engine in the process chose; they are
        read at each run, so ``dataclasses.replace`` on ``Engine.settings`` switches them.
    """

    block_size: Optional[int] = None
    adaptive_block: Optional[bool] = None
    prefill_chunk: Optional[int] = None
    prefill_tokens: Optional[int] = None
    prefill_rows: Optional[int] = None
    prefix_cache_mb: Optional[float] = None
    prefix_granularity: int = 64
    max_context: Optional[int] = None
    batch_size: Optional[int] = None
    cost_model: Optional[CostModel] = None
    attention: Optional[str] = None
    matmul: Optional[str] = None
    passes: Optional[str] = None
    drafts: Optional[str] = None
    cpu_ops: Optional[str] = None

    def __post_init__(self):
        for route in switch.SWITCHES:
            setattr(self, route.field, route.resolve(getattr(self, route.field)))
        if self.prefill_chunk is not None and self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {self.prefill_chunk}")
        if self.prefill_tokens is not None and self.prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be at least 1, got {self.prefill_tokens}")
        if self.prefix_cache_mb is not None and self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0, got {self.prefix_cache_mb}")

    @property
    def prefix_mb(self) -> float:
        """Memory for shared prompt prefixes, the default resolved; 0: none kept."""
        return PREFIX_CACHE_MB if self.prefix_cache_mb is None else self.prefix_cache_mb

    def routes(self, costs: Optional[CostModel] = None) -> switch.Routes:
        """The routing modes, with the ragged route and the few-row matmul that ``costs`` (else
        the given cost model) were measured under, where they chose one (else "block" and this
        config's matmul)."""
        costs = costs if costs is not None else self.cost_model
        ragged = (costs.route if costs is not None else None) or "block"
        modes = {route.field: getattr(self, route.field) for route in switch.SWITCHES}
        if costs is not None and costs.matmul is not None:
            modes["matmul"] = costs.matmul
        return switch.Routes(**modes, ragged=ragged)


FIELDS = tuple(f.name for f in fields(EngineConfig))

__all__ = ["EngineConfig", "FIELDS", "PREFIX_CACHE_MB"]
