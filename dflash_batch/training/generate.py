"""The target's answers (and its own user turns) at scale, through the batched engine, into a store.

Prompts come as token ids, so generation needs the model and its EOS ids only (``IdsTokenizer``),
not the tokenizer: it runs where no tokenizer loads. Every answer is appended to an
``AnswerStore`` as it finishes; a run stopped by its time budget, or killed, resumes with the
(prompt, sample) pairs not yet stored. Sample 0 of a prompt is the greedy answer; samples
1..k are sampled at ``temperature``, each with a seed fixed by (seed, prompt key, k), so a
resumed or repeated run draws the same answer.
"""

from __future__ import annotations

import hashlib
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ..completion import GenerationError
from .corpus import is_held_out
from .store import AnswerStore, prompt_key


class _NoText:
    """A detokenizer that makes no text: ids-only generation has no use for it."""

    last_segment = ""

    def add_token(self, token: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class IdsTokenizer:
    """What the engine needs of a tokenizer for prompts given as ids: the EOS ids."""

    has_chat_template = False

    def __init__(self, eos_token_ids: Iterable[int]):
        self.eos_token_ids = set(int(e) for e in eos_token_ids)

    @property
    def detokenizer(self) -> _NoText:
        return _NoText()


def sample_seed(seed: int, key: int, sample: int) -> int:
    """The seed of sample ``sample`` of the prompt ``key`` (31 bits)."""
    digest = hashlib.blake2b(f"{seed}/{key}/{sample}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


def pending_jobs(
    prompts: Sequence[dict], samples: Sequence[int], done: set
) -> List[Tuple[dict, int]]:
    """(prompt, sample) pairs not in the store yet, prompt by prompt in the given order."""
    return [(p, k) for p in prompts for k in samples if (p["key"], k) not in done]


def generate_to_store(
    engine,
    prompts: Sequence[dict],
    store: AnswerStore,
    samples: Sequence[int] = (0,),
    temperature: float = 0.7,
    max_tokens: int = 256,
    seed: int = 0,
    batch_size: Optional[int] = None,
    deadline: Optional[float] = None,
    window: int = 2048,
    log: Optional[Callable[[str], None]] = None,
) -> Dict[str, int]:
    """Generate the missing (prompt, sample) answers of ``prompts`` (``{"key", "prompt": ids}``)
    into ``store``, ``window`` requests per engine run, until done or ``deadline``
    (``time.perf_counter()`` value). A prompt the engine refuses (too long) is skipped and
    logged. Returns counts: written, tokens, left, skipped."""
    jobs = pending_jobs(prompts, samples, store.done())
    written = tokens = skipped = 0
    start = time.perf_counter()
    with store.open_writer() as writer:
        for first in range(0, len(jobs), window):
            if deadline is not None and time.perf_counter() >= deadline:
                break
            chunk = jobs[first : first + window]
            requests = []
            for i, (p, k) in enumerate(chunk):
                temp = 0.0 if k == 0 else temperature
                try:
                    requests.append(
                        engine.request(
                            p["prompt"],
                            max_tokens=max_tokens,
                            temperature=temp,
                            seed=None if k == 0 else sample_seed(seed, p["key"], k),
                            index=i,
                        )
                    )
                except GenerationError as e:  # too long for the target, say: skipped, named
                    skipped += 1
                    if log:
                        log(f"skipped prompt {p.get('id', p['key'])}: {e}")
            for i, completion in engine.run(requests, batch_size):
                p, k = chunk[i]
                ended = completion.finish_reason == "stop"
                writer.append(
                    p["key"], k, completion.token_ids, ended, 0.0 if k == 0 else temperature
                )
                written += 1
                tokens += len(completion.token_ids)
                if deadline is not None and time.perf_counter() >= deadline:
                    break  # the rows in flight are dropped; a resumed run generates them again
            writer.sync()
            if log:
                log(
                    f"stored {written}/{len(jobs)} answers, {tokens} tokens, {time.perf_counter() - start:.1f}s"
                )
    return {
        "written": written,
        "tokens": tokens,
        "left": len(jobs) - written - skipped,
        "skipped": skipped,
    }


# -- the target's own user turns -------------------------------------------------------------
def turn_prompt(chat: dict, turn: Sequence[int]) -> List[int]:
    """Chat-templated ids of a one-turn conversation whose user turn is ``turn`` (ids): the
    template's text before the user's content, the turn, and the text after it (end of turn,
    assistant header)."""
    return list(chat["user_header"]) + list(turn) + list(chat["turn_suffix"])


def keep_turn(
    turn: Sequence[int], ended: bool, special_ids: set, min_tokens: int, min_distinct: float
) -> bool:
    """A usable user turn: ended on its own, long enough, no special tokens, not a loop."""
    if not ended or len(turn) < min_tokens:
        return False
    if any(t in special_ids for t in turn):
        return False
    return len(set(turn)) >= min_distinct * len(turn)  # a repeated phrase has few distinct ids


def self_prompts(
    store: AnswerStore,
    chat: dict,
    special_ids: Iterable[int],
    count: Optional[int] = None,
    eval_percent: int = 3,
    min_tokens: int = 4,
    min_distinct: float = 0.4,
) -> List[dict]:
    """Prompts from the user turns in ``store`` (samples of the header prompt in sample order),
    filtered and deduplicated by their ids; source: the turn itself, held out by its hash."""
    special = set(int(s) for s in special_ids)
    header_key = prompt_key(chat["user_header"])
    turns = sorted((r for r in store.records() if r.key == header_key), key=lambda r: r.sample)
    seen, out = set(), []
    for r in turns:
        ids = tuple(r.tokens)
        if ids in seen or not keep_turn(ids, r.ended, special, min_tokens, min_distinct):
            continue
        seen.add(ids)
        source = f"self:{prompt_key(ids):016x}"
        prompt = turn_prompt(chat, ids)
        split = "eval" if is_held_out(source, eval_percent) else "train"
        out.append({"id": f"self-{len(out)}", "kind": "self", "source": source, "split": split, "prompt": prompt,
                    "key": prompt_key(prompt)})  # fmt: skip
        if count is not None and len(out) >= count:
            break
    return out


def sample_user_turns(
    engine,
    chat: dict,
    store: AnswerStore,
    count: int,
    temperature: float = 1.0,
    max_tokens: int = 96,
    seed: int = 0,
    batch_size: Optional[int] = None,
    deadline: Optional[float] = None,
    log: Optional[Callable[[str], None]] = None,
) -> Dict[str, int]:
    """``count`` sampled continuations of the template's user header (samples 1..count), each
    ending at the end of its turn (the template's end-of-turn id is an EOS of ``engine``)."""
    header = {"key": prompt_key(chat["user_header"]), "prompt": list(chat["user_header"])}
    return generate_to_store(
        engine,
        [header],
        store,
        range(1, count + 1),
        temperature,
        max_tokens,
        seed,
        batch_size,
        deadline,
        log=log,
    )
