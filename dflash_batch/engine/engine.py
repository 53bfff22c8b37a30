"""``Engine``: a resident target (+ optional DFlash drafter) that turns prompts into completions."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence, Union

import mlx.core as mx

from ..completion import (
    Completion,
    EmptyPromptError,
    GenerationError,
    GenerationStats,
    ModelMismatchError,
    Piece,
    PromptTooLongError,
)
from . import attention, loading, registry
from .decode import ar_steps, dflash_steps, make_chooser
from .stopping import StopText
from .target import Target

Prompt = Union[str, List[Dict[str, Any]], List[int]]
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class Engine:
    """Generate with DFlash speculative decoding, or plain AR decoding when there is no drafter."""

    def __init__(
        self,
        model,
        tokenizer,
        drafter=None,
        *,
        config: Optional[dict] = None,
        block_size: Optional[int] = None,
        adaptive_block: Optional[bool] = None,
        prefill_chunk: int = 2048,
        max_context: Optional[int] = None,
        description: Optional[dict] = None,
    ):
        self.tokenizer = tokenizer
        self.drafter = drafter
        self.target = Target(model)
        attention.install(model)  # verify passes: multi-row attention routed per backend
        self.config = config or {}
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context or self.config.get("max_position_embeddings")
        self.block_size = 0
        if drafter is not None:
            self._attach(drafter, block_size)
        # Fewer verify rows while acceptance is low: worth it where a row costs (CPU), not on a GPU.
        self.adaptive_block = mx.default_device() == mx.cpu if adaptive_block is None else adaptive_block
        self.description = dict(description or {}, block_size=self.block_size, adaptive_block=self.adaptive_block)

    def _attach(self, drafter, block_size: Optional[int]) -> None:
        args = drafter.args
        if drafter.target_hidden_size != self.target.hidden_size:
            raise ModelMismatchError(
                f"drafter expects target hidden size {drafter.target_hidden_size}, "
                f"target has {self.target.hidden_size}"
            )
        if max(args.target_layer_ids) >= self.target.num_layers:
            raise ModelMismatchError(
                f"drafter taps target layers {args.target_layer_ids}, target has {self.target.num_layers} layers"
            )
        if not 0 <= args.mask_token_id < self.target.vocab_size:
            raise ModelMismatchError(
                f"drafter mask token id {args.mask_token_id} is outside the target vocabulary ({self.target.vocab_size})"
            )
        self.target.check_rollback()
        self.target.set_taps(args.target_layer_ids)
        self.block_size = min(block_size or args.block_size, args.block_size)
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")

    # -- prompts -------------------------------------------------------------------------
    def encode(
        self,
        prompt: Prompt,
        *,
        system: Optional[str] = None,
        chat_template: Optional[bool] = None,
        chat_template_kwargs: Optional[dict] = None,
    ) -> List[int]:
        """Token ids for a prompt: text (chat-templated when the tokenizer has a template),
        chat messages, or ids as they are."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EmptyPromptError("prompt is empty")
            use_template = tok.has_chat_template if chat_template is None else chat_template
            if not use_template:
                return tok.encode(prompt if system is None else f"{system}\n\n{prompt}")
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list):
            raise GenerationError(
                f"prompt must be a string, a list of chat messages or a list of token ids, not {type(prompt).__name__}"
            )
        if not prompt:
            raise EmptyPromptError("prompt is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
            if bad:
                raise GenerationError(f"token id {bad[0]} is outside the vocabulary (size {self.target.vocab_size})")
            return list(prompt)
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise GenerationError(f"message {i} must be an object with string 'role' and 'content'")
        if system is not None and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system}] + prompt
        if not tok.has_chat_template:
            raise GenerationError("chat messages given, but the target tokenizer has no chat template")
        return tok.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
        )

    # -- generation ----------------------------------------------------------------------
    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        **prompt_options,
    ) -> Iterator[Piece]:
        """Yield text as it is committed (one Piece per target pass); the last carries stats."""
        ids = self.encode(prompt, **prompt_options)
        if not ids:
            raise EmptyPromptError("prompt encodes to no tokens")
        if max_tokens < 1:
            raise GenerationError(f"max_tokens must be at least 1, got {max_tokens}")
        if self.max_context and len(ids) >= self.max_context:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the target's context is {self.max_context}"
            )
        if self.max_context:
            max_tokens = min(max_tokens, self.max_context - len(ids))
        yield from self._decode(ids, max_tokens, temperature, stop or (), seed)

    def _decode(self, ids, max_tokens, temperature, stops, seed) -> Iterator[Piece]:
        B = self.block_size
        stats = GenerationStats(prompt_tokens=len(ids), block_size=B, acceptance_histogram=[0] * (max(B, 1) + 1))
        choose = make_chooser(temperature, seed)
        if self.drafter is not None:
            steps = dflash_steps(
                self.target, self.drafter, ids, max_tokens, choose, self.prefill_chunk, B, self.adaptive_block
            )
        else:
            steps = ar_steps(self.target, ids, max_tokens, choose, self.prefill_chunk)
        eos = self.tokenizer.eos_token_ids
        detok = self.tokenizer.detokenizer
        text = StopText(stops)
        out: List[int] = []
        finish, stop_reason = None, None
        mx.reset_peak_memory()
        start = decode_start = time.perf_counter()
        try:
            for step in steps:
                now = time.perf_counter()
                if step.verify:
                    stats.cycles += 1
                    stats.drafted_tokens += step.drafted
                    stats.acceptance_histogram[len(step.tokens)] += 1
                else:
                    stats.prefill_s, decode_start = now - start, now
                new_ids: List[int] = []
                new_text = ""
                for i, tok in enumerate(step.tokens):
                    stats.generated_tokens += 1
                    stats.accepted_tokens += i < step.from_draft
                    if tok in eos:
                        finish, stop_reason = "stop", "eos"
                        break
                    new_ids.append(tok)
                    detok.add_token(tok)
                    emitted, hit = text.feed(detok.last_segment)
                    new_text += emitted
                    if hit is not None:
                        finish, stop_reason = "stop", hit
                        break
                    if stats.generated_tokens >= max_tokens:
                        finish = "length"
                        break
                out.extend(new_ids)
                if finish is None:
                    yield Piece(text=new_text, token_ids=new_ids)
                    continue
                if stop_reason is None or stop_reason == "eos":
                    detok.finalize()
                    new_text += text.feed(detok.last_segment)[0]
                stats.decode_s = time.perf_counter() - decode_start
                stats.peak_memory_gb = mx.get_peak_memory() / 1e9
                yield Piece(new_text + text.flush(), new_ids, finish, stats, stop_reason)
                return
        finally:
            steps.close()

    def generate(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        **prompt_options,
    ) -> Completion:
        """Run one prompt to the end: text, token ids, finish reason and statistics."""
        pieces = list(self.stream(prompt, max_tokens, temperature, stop, seed, **prompt_options))
        last = pieces[-1]
        return Completion(
            text="".join(p.text for p in pieces),
            token_ids=[t for p in pieces for t in p.token_ids],
            finish_reason=last.finish_reason,
            stats=last.stats,
            stop_reason=last.stop_reason,
        )


def _pick_dtype(dtype: Optional[str]) -> Optional[mx.Dtype]:
    """fp32 on CPU (bf16 and quantized matmuls are slow there); as stored on a GPU."""
    if dtype is None or dtype == "auto":
        return mx.float32 if mx.default_device() == mx.cpu else None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


AUTO = "auto"


def load_engine(
    target: Optional[Union[str, Path]] = None,
    draft: Optional[Union[str, Path]] = AUTO,
    *,
    target_revision: Optional[str] = None,
    draft_revision: Optional[str] = None,
    dtype: Optional[str] = "auto",
    block_size: Optional[int] = None,
    adaptive_block: Optional[bool] = None,
    prefill_chunk: int = 2048,
    max_context: Optional[int] = None,
) -> Engine:
    """Load a target and its DFlash drafter.

    Args:
        target: a local model folder or a Hugging Face repo id; None for the embedded default.
        draft: a drafter folder or repo id; ``"auto"`` for the drafter registered for the
            target (none: plain AR decoding); None for plain AR decoding.
        target_revision, draft_revision: pin a branch, tag or commit on the hub.
        dtype: "auto" (fp32 on CPU, as stored on GPU), "float32", "bfloat16" or "float16".
        block_size: verify at most this many tokens per cycle (at most the drafter's own).
        adaptive_block: verify fewer rows while drafts keep failing (default: on CPU only).
        prefill_chunk: prompt tokens per prefill pass.
        max_context: refuse prompts this long or longer (default: the target config's limit).
    """
    mx_dtype = _pick_dtype(dtype)
    if target is None:
        target, default_draft = registry.default_pair()
        if draft == AUTO:
            draft = default_draft
    elif draft == AUTO:
        found = registry.registered_drafter(str(target))
        draft, draft_revision = found if found else (None, None)
    model, tokenizer, config = registry.load_any_target(target, target_revision, mx_dtype)
    drafter = loading.load_drafter(draft, draft_revision, mx_dtype) if draft is not None else None
    description = {
        "target": str(target),
        "target_revision": target_revision,
        "draft": None if draft is None else str(draft),
        "draft_revision": draft_revision,
        "dtype": str(mx_dtype or "as-stored"),
    }
    return Engine(
        model,
        tokenizer,
        drafter,
        config=config,
        block_size=block_size,
        adaptive_block=adaptive_block,
        prefill_chunk=prefill_chunk,
        max_context=max_context,
        description=description,
    )
