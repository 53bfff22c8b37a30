"""``POST /v1/chat/completions`` and ``POST /v1/completions``: one request answered now, by the
resident engine (dflash_batch/server/resident.py), streamed as server-sent events when asked.

A request's body is read by the same rules as a Batch API line (runner/items.py: the prompt or
messages, ``max_tokens``/``max_completion_tokens``, ``temperature``, ``stop``, ``n``, sampling
controls, ``logprobs``, ``response_format``) plus ``stream``, ``stream_options.include_usage`` and
``seed``; the answer is OpenAI's, with the speculative statistics of each choice under
``dflash`` (``EXTENSION``). A client that goes away cancels its rows at the engine's next cycle.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse

from ..completion import Completion, Piece
from ..errors import BadOption, Cancelled, GenerationError, RowError
from ..inbox import InboxFull, Ticket
from ..request import Request as EngineRequest
from ..runner.export import openai_logprobs, text_logprobs
from ..runner.items import CHAT_URL, COMPLETIONS_URL, Item, _openai_row
from ..runner.spec import JobSpec
from .errors import ApiError, bad_request
from .resident import Resident

EXTENSION = "dflash"  # the key of each answer's speculative statistics
# a body's prompt or messages, at most (the engine refuses long prompts itself)
MAX_PROMPT_CHARS = 1 << 22


class Interactive:
    """The two routes over ``resident``; ``spec`` gives the defaults a body leaves out (the
    server's ``--max-tokens`` and model) and ``model_name`` the answer's ``model``."""

    def __init__(self, resident: Resident, spec: JobSpec, model_name: str):
        self.resident, self.spec, self.model_name = resident, spec, model_name
        self.counts = {"requests": 0, "streams": 0, "cancelled": 0, "refused": 0}

    async def chat(self, request: Request):
        return await self._answer(request, CHAT_URL)

    async def completions(self, request: Request):
        return await self._answer(request, COMPLETIONS_URL)

    # -- one request ----------------------------------------------------------------------
    async def _answer(self, request: Request, url: str):
        body = await _json_body(request)
        engine_request = self.parse(body, url)
        stream = body.get("stream") is True
        include_usage = (
            stream
            and isinstance(body.get("stream_options"), dict)
            and body["stream_options"].get("include_usage") is True
        )
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        ticket = Ticket(
            engine_request,
            on_piece=lambda k, piece: loop.call_soon_threadsafe(events.put_nowait, (k, piece)),
            on_done=lambda: loop.call_soon_threadsafe(events.put_nowait, None),
        )
        try:
            self.resident.submit(ticket)
        except InboxFull as e:
            self.counts["refused"] += 1
            raise ApiError(
                429, str(e), code="rate_limit_exceeded", kind="rate_limit_error"
            ) from None
        self.counts["requests"] += 1
        answer = _Answer(url, self.model_name, ticket)
        if stream:
            self.counts["streams"] += 1
            return StreamingResponse(self._events(answer, events, include_usage, request),
                                     media_type="text/event-stream")  # fmt: skip
        try:
            while not ticket.done.is_set():
                try:
                    await asyncio.wait_for(events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError
        except asyncio.CancelledError:  # the client went away: its rows stop at the next cycle
            ticket.cancel()
            self.counts["cancelled"] += 1
            raise
        return JSONResponse(answer.whole())

    async def _events(
        self, answer: "_Answer", events: asyncio.Queue, include_usage: bool, request: Request
    ) -> AsyncIterator[bytes]:
        """Server-sent events: a chunk per piece of each choice, a last one per choice with its
        finish reason, the usage when asked, then ``[DONE]``."""
        try:
            yield _event(answer.first_chunk())
            while True:
                event = await events.get()
                if event is None:
                    break
                yield _event(answer.chunk(*event))
            error = answer.error()
            if error is not None:
                yield _event(error.body())
            else:
                if include_usage:
                    yield _event(answer.usage_chunk())
            yield b"data: [DONE]\n\n"
        finally:  # the client went away mid-stream (or the stream ended): cancel what remains
            if not answer.ticket.done.is_set():
                answer.ticket.cancel()
                self.counts["cancelled"] += 1

    def parse(self, body: Dict[str, Any], url: str) -> EngineRequest:
        """The engine request of a body, refused in OpenAI's shape where it is bad."""
        # ``model`` is not checked: one model is served, and the answer names it
        for name in ("stream",):
            if body.get(name) is not None and not isinstance(body[name], bool):
                raise bad_request(f"'{name}' must be true or false", param=name)
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise bad_request("'seed' must be an integer", param="seed")
        if len(orjson.dumps(body.get("messages") or body.get("prompt"))) > MAX_PROMPT_CHARS:
            raise bad_request(
                f"the prompt is longer than {MAX_PROMPT_CHARS} bytes", param="messages"
            )
        item = Item(id=f"req-{uuid.uuid4().hex[:12]}", index=0, where="the request")
        try:
            _openai_row(item, {"custom_id": item.id, "url": url, "body": body})
            options = self.spec.options(item.options)
        except (RowError, BadOption) as e:
            raise bad_request(str(e).replace("'body.", "'"), param=_param(str(e))) from None
        if seed is not None:
            options.seed = seed
        return EngineRequest(item.id, item.prompt, options, item.metadata)


class _Answer:
    """A ticket's answer in OpenAI's shapes, whole or as stream chunks."""

    def __init__(self, url: str, model: str, ticket: Ticket):
        self.chat = url == CHAT_URL
        self.model, self.ticket = model, ticket
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def error(self) -> Optional[ApiError]:
        """The refusal or failure that ended the request, if one did."""
        failed = [o for o in self.ticket.outcomes.values() if isinstance(o, Exception)]
        if not failed:
            return None
        e = failed[0]
        if isinstance(e, Cancelled):
            return ApiError(499, str(e), code="cancelled")
        if isinstance(e, GenerationError):
            return bad_request(str(e), param="messages" if self.chat else "prompt")
        return ApiError(500, f"generation failed: {e}", kind="server_error")

    def whole(self) -> Dict[str, Any]:
        error = self.error()
        if error is not None:
            raise error
        done = [self.ticket.outcomes[k] for k in sorted(self.ticket.outcomes)]
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(k, c) for k, c in enumerate(done)],
                "usage": _usage(done), EXTENSION: [_stats(c) for c in done]}  # fmt: skip

    def _choice(self, k: int, c: Completion) -> Dict[str, Any]:
        if self.chat:
            return {
                "index": k,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": openai_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
        return {"index": k, "text": c.text, "logprobs": text_logprobs(c.logprobs),
                "finish_reason": c.finish_reason}  # fmt: skip

    # -- streaming --------------------------------------------------------------------------
    def _chunk(self, choices: List[Dict[str, Any]], **extra) -> Dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **extra}  # fmt: skip

    def first_chunk(self) -> Dict[str, Any]:
        """Chat streams open each choice with the assistant's role, as OpenAI's do."""
        if not self.chat:
            return self._chunk([])
        return self._chunk([{"index": k, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}
                            for k in range(self.ticket.samples)])  # fmt: skip

    def chunk(self, k: int, piece: Piece) -> Dict[str, Any]:
        if self.chat:
            choice = {
                "index": k,
                "delta": {"content": piece.text},
                "logprobs": openai_logprobs(piece.logprobs),
                "finish_reason": piece.finish_reason,
            }
        else:
            choice = {"index": k, "text": piece.text, "logprobs": text_logprobs(piece.logprobs),
                      "finish_reason": piece.finish_reason}  # fmt: skip
        extra = {EXTENSION: _stats_of(piece.stats)} if piece.stats is not None else {}
        return self._chunk([choice], **extra)

    def usage_chunk(self) -> Dict[str, Any]:
        done = [self.ticket.outcomes[k] for k in sorted(self.ticket.outcomes)]
        return self._chunk([], usage=_usage(done))


def _usage(done: List[Completion]) -> Dict[str, int]:
    prompt = done[0].stats.prompt_tokens if done else 0
    completion = sum(c.stats.generated_tokens for c in done)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _stats(c: Completion) -> Dict[str, Any]:
    return _stats_of(c.stats)


def _stats_of(s) -> Dict[str, Any]:
    """A choice's speculative statistics (docs/serve.md, "Interactive requests")."""
    return {"tokens_per_cycle": s.tokens_per_cycle, "cycles": s.cycles, "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens, "block_size": s.block_size,
            "prefill_s": s.prefill_s, "decode_s": s.decode_s, "decode_tps": s.decode_tps}  # fmt: skip


def _event(data: Dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _param(message: str) -> Optional[str]:
    """The field a refusal names ('body.max_tokens' ... -> max_tokens)."""
    if "'body." in message:
        return message.split("'body.", 1)[1].split("'", 1)[0]
    return None


async def _json_body(request: Request) -> Dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as e:
        raise bad_request(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body
