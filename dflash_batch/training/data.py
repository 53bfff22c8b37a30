"""Self-distillation data: the target answers the prompts, and its own tokens become the labels.

A sample is ``{"id", "kind", "prompt": [ids], "answer": [ids]}``; an answer that ended on its
own carries the EOS token last, so the drafter also learns to propose the end. Files are JSON
lines. Generation needs only the model (prompt ids come pre-encoded), so it runs where no
tokenizer can be loaded. ``train-drafter`` now generates through the batched engine into a
token-id store (generate.py, store.py); ``generate_answers`` (mlx-lm's BatchGenerator) stays as
the reference that benchmarks/answer_generation.py compares against.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Iterable, List, Optional, Sequence

import mlx.core as mx

from ..files import write_atomic


def encode_prompts(tokenizer, prompts: Iterable[dict]) -> List[dict]:
    """Prompts with their chat-templated token ids (``prompt``), ready for generation."""
    out = []
    for p in prompts:
        ids = tokenizer.apply_chat_template(
            p["messages"], add_generation_prompt=True, tokenize=True
        )
        out.append({"id": p["id"], "kind": p["kind"], "prompt": [int(t) for t in ids]})
    return out


def generate_answers(
    model,
    prompts: Sequence[dict],
    eos_ids: Sequence[int],
    max_tokens: int = 256,
    batch_size: int = 64,
    log: Optional[Callable[[str], None]] = None,
) -> List[dict]:
    """Greedy answers of ``model`` to pre-encoded prompts, batched with mlx-lm's BatchGenerator."""
    from mlx_lm.generate import BatchGenerator

    eos = set(int(e) for e in eos_ids)
    samples: List[dict] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        chunk = prompts[first : first + batch_size]
        gen = BatchGenerator(
            model,
            max_tokens=max_tokens,
            stop_tokens=[[e] for e in sorted(eos)],
            completion_batch_size=batch_size,
            prefill_batch_size=min(batch_size, 32),
        )
        uids = gen.insert([p["prompt"] for p in chunk], [max_tokens] * len(chunk))
        answers = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                answers[r.uid].append(int(r.token))  # the stop token too: it is a label
        gen.close()
        for uid, p in zip(uids, chunk):
            samples.append(dict(p, answer=answers[uid]))
        if log:
            done = first + len(chunk)
            tokens = sum(len(s["answer"]) for s in samples)
            log(
                f"generated {done}/{len(prompts)} answers, {tokens} tokens, {time.perf_counter() - start:.1f}s"
            )
        mx.clear_cache()
    return samples


def save_samples(path: str | Path, samples: Iterable[dict]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(s) + "\n" for s in samples))


def load_samples(path: str | Path) -> List[dict]:
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]
