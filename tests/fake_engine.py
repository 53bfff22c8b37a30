"""A fake engine for the runner's tests: implements ``dflash_batch.request.CompletionEngine``
without MLX.

Deterministic text from each prompt, statistics that obey the same identities as the real
engine's (tokens per cycle x cycles = committed tokens...), outcomes yielded out of input order
within each batch (as a batch finishes rows), and failures on demand:

* an empty prompt is refused (``EmptyPromptError``), a prompt of more words than ``max_context``
  is too long (``PromptTooLongError``), as the engine refuses them;
* a prompt in ``fail`` fails alone (a ``RuntimeError`` outcome);
* ``crash_after=n``: the call itself raises after n outcomes (a batch-level failure);
* ``delay``: seconds per batch step, so worker tests can stop or kill it mid-job;
* ``hold``: a path; while that file exists, each batch step waits (and a file ``hold.PID`` says
  so), so a test can look at a job that cannot end meanwhile.

A request marked ``control`` is decoded as a control row (one token a cycle, none drafted), and
each row's share of the cycles and plain-decoding estimate follow from ``CYCLE_S`` and ``PLAIN_S``.

A worker or ``dflash-batch run`` uses it when ``DFLASH_BATCH_ENGINE=tests.fake_engine:from_env``
(the factory reads ``FAKE_ENGINE_DELAY``, ``FAKE_ENGINE_FAIL``, ``FAKE_ENGINE_BATCH``,
``FAKE_ENGINE_HOLD``).
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Tuple

from dflash_batch.completion import (
    Completion,
    EmptyPromptError,
    GenerationStats,
    Piece,
    PromptTooLongError,
)
from dflash_batch.errors import Cancelled
from dflash_batch.inbox import Ticket
from dflash_batch.request import Request

BLOCK = 8
CYCLE_S, PLAIN_S = 0.004, 0.003  # seconds per row of a (drafting) cycle and of a plain one


def text_of(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(m["content"] for m in prompt)


def words_for(prompt, n: int) -> List[str]:
    """``n`` deterministic words from the prompt."""
    seed = hashlib.sha256(text_of(prompt).encode()).hexdigest()
    return [f"w{seed[(2 * i) % 64 : (2 * i) % 64 + 2]}" for i in range(n)]


class FakeEngine:
    def __init__(self, *, fail=(), max_context: Optional[int] = None, delay: float = 0.0, batch: int = 4,
                 crash_after: Optional[int] = None, description: Optional[dict] = None,
                 hold: Optional[str] = None):  # fmt: skip
        self.fail = set(fail)
        self.hold = Path(hold) if hold else None
        self.max_context = max_context
        self.delay = delay
        self.batch = batch
        self.crash_after = crash_after
        self.calls: List[str] = []  # prompts in the order they were handed over
        self.requests: List[Request] = []
        self.interactive: list = []  # prompts of interactive requests answered, in order
        self.batch_sizes: List[Optional[int]] = []
        self.description = description or {"fake": True}

    def complete(self, request: Request):
        prompt_words = text_of(request.prompt).split()
        if not prompt_words:
            return EmptyPromptError("prompt is empty")
        if self.max_context and len(prompt_words) >= self.max_context:
            return PromptTooLongError(
                f"prompt has {len(prompt_words)} tokens; the target's context is {self.max_context}"
            )
        if text_of(request.prompt) in self.fail:
            return RuntimeError("simulated failure")
        opts = request.options
        words = words_for(request.prompt, opts.max_tokens)
        text, finish, stop_reason = " ".join(words), "length", None
        for s in opts.stop or ():
            if s in text:
                text, finish, stop_reason = text[: text.index(s)], "stop", s
        n = len(text.split()) if finish == "stop" else opts.max_tokens
        n = max(n, 1)
        rest = (
            n - 1
        )  # the first token comes from prefill; cycles commit 2 (one accepted + bonus), the last maybe 1
        two = (
            0 if request.control else rest // 2
        )  # a control row commits one token a cycle, drafting none
        cycles = rest - two
        histogram = [0] * (BLOCK + 1)
        histogram[2], histogram[1] = two, rest - 2 * two
        stats = GenerationStats(
            prompt_tokens=len(prompt_words), generated_tokens=n, prefill_s=0.001, decode_s=0.001 * rest, cycles=cycles,
            drafted_tokens=0 if request.control else cycles * (BLOCK - 1), accepted_tokens=two, block_size=BLOCK,
            acceptance_histogram=histogram, peak_memory_gb=0.01,
            # a cycle's share CYCLE_S, a plain one's PLAIN_S: what speculation saved, known in advance
            decode_share_s=CYCLE_S * cycles, plain_seconds_est=PLAIN_S * rest, control=request.control,
        )  # fmt: skip
        return Completion(text, list(range(n)), finish, stats, stop_reason)

    def answer(self, ticket: Ticket) -> None:
        """An interactive request (dflash_batch/inbox.py): its words streamed one piece each."""
        self.interactive.append(ticket.request.prompt)
        for k in range(ticket.samples):
            done = self.complete(ticket.request)
            if isinstance(done, Exception) or ticket.cancelled.is_set():
                ticket.finish(
                    k, done if isinstance(done, Exception) else Cancelled("the client went away")
                )
                continue
            words = done.text.split(" ")
            for i, word in enumerate(words):
                last = i == len(words) - 1
                ticket.on_piece(
                    k,
                    Piece(
                        word if i == 0 else " " + word,
                        [i],
                        done.finish_reason if last else None,
                        done.stats if last else None,
                    ),
                )
            ticket.finish(k, done)

    def generate_requests(
        self, requests: Iterable[Request], batch_size: Optional[int] = None, inbox=None
    ) -> Iterator[Tuple[Request, object]]:
        self.batch_sizes.append(batch_size)
        size = batch_size or self.batch
        window: List[Request] = []
        yielded = 0

        def flush():
            nonlocal yielded
            for ticket in inbox.take() if inbox is not None else ():  # they join at the next step
                self.answer(ticket)
            if window:  # a step of rows: one whose chunk is held
                self._wait_while_held(inbox)
            if self.delay:
                time.sleep(self.delay)
            for request in reversed(window):  # a batch finishes rows in its own order
                if self.crash_after is not None and yielded >= self.crash_after:
                    raise RuntimeError("simulated batch failure")
                yielded += 1
                yield request, self.complete(request)
            window.clear()

        for request in requests:
            self.calls.append(request.prompt)
            self.requests.append(request)
            window.append(request)
            if len(window) >= size:
                yield from flush()
        yield from flush()

    def _wait_while_held(self, inbox=None) -> None:
        if self.hold is None or not self.hold.exists():
            return
        held = self.hold.with_name(f"{self.hold.name}.{os.getpid()}")
        held.touch()
        while self.hold.exists():
            for ticket in inbox.take() if inbox is not None else ():  # the batch's cycles go on
                self.answer(ticket)
            time.sleep(0.01)
        held.unlink(missing_ok=True)


def from_env(target=None, draft=None, **model) -> FakeEngine:
    """The engine factory a worker or ``dflash-batch run`` gets from ``DFLASH_BATCH_ENGINE``. A
    ``target`` that names a missing local path fails to load, as the real factory does."""
    if (
        target is not None
        and ("/" in target or target.startswith("."))
        and not Path(target).exists()
    ):
        raise FileNotFoundError(f"no model at {target}")
    fail = [p for p in os.environ.get("FAKE_ENGINE_FAIL", "").split("|") if p]
    return FakeEngine(
        fail=fail, delay=float(os.environ.get("FAKE_ENGINE_DELAY", "0")), batch=int(os.environ.get("FAKE_ENGINE_BATCH", "4")),
        max_context=model.get("max_context"), description={"fake": True, "target": target, "draft": draft},
        hold=os.environ.get("FAKE_ENGINE_HOLD"),
    )  # fmt: skip
