"""The HTTP layer: Starlette routes over ``FileStore`` and ``Batches``, run by uvicorn.

Every ``/v1`` answer, refusals included, is in OpenAI's shapes, so OpenAI's own clients work
unchanged. An API key, when set, is required (``Authorization: Bearer KEY``) on every path.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from ..runner.spec import DEFAULT_TARGET_NAME, MODEL_KEYS, JobSpec, recorded_model
from .batches import EXTENSION, Batches
from .errors import ApiError, bad_request
from .files import FileStore, Limits
from .interactive import Interactive
from .page import figures, html_page
from .resident import Resident

log = logging.getLogger("dflash_batch.serve")
MAX_PAGE = 100  # the most a list request may ask for, as OpenAI's
MAX_FILES_PAGE = 10_000
FORM_SLACK = 2**16  # multipart framing around the file's own bytes


def create_app(
    home: Path,
    *,
    submit: Callable[..., Any],
    api_key: Optional[str] = None,
    limits: Limits = Limits(),
    overrides: Optional[Dict[str, Any]] = None,
    clock: Callable[[], float] = time.time,
    resident: Optional[Resident] = None,
) -> Starlette:
    """The app over ``home``: batches become jobs queued by ``submit`` (``api.submit``, passed
    in: this package never imports the engine's side of api) with ``overrides`` (flat spec
    names: target, draft, max_tokens, chunk_size...). ``resident``: the engine that answers
    ``/v1/chat/completions`` and ``/v1/completions`` (``serving``); without it they are 404."""
    files = FileStore(home, clock)
    batches = Batches(home, files, submit, overrides, clock)
    routes = Routes(home, files, batches, limits, dict(overrides or {}))
    if resident is not None:
        routes.interactive = Interactive(resident, served_spec(overrides or {}),
                                         model_list(overrides or {})[0]["id"])  # fmt: skip
    app = Starlette(
        routes=routes.table(),
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _server_error,
        },
    )
    if api_key:
        app.add_middleware(KeyCheck, api_key=api_key)
    app.state.batches = batches
    return app


class Routes:
    def __init__(
        self,
        home: Path,
        files: FileStore,
        batches: Batches,
        limits: Limits,
        overrides: Dict[str, Any],
    ):
        self.home, self.files, self.batches = home, files, batches
        self.limits, self.overrides = limits, overrides
        self.interactive: Optional[Interactive] = None

    def table(self):
        answer = self.interactive
        interactive = (
            [
                Route("/v1/chat/completions", answer.chat, methods=["POST"]),
                Route("/v1/completions", answer.completions, methods=["POST"]),
            ]
            if answer is not None
            else []
        )
        return interactive + [
            Route("/", self.page),
            Route("/status.json", self.status),
            Route("/v1/models", self.models),
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create_batch, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"]),
        ]

    # -- the status page -------------------------------------------------------------------
    def _figures(self) -> Dict[str, Any]:
        by_job = {b[EXTENSION]["job_id"]: b for b in self.batches.refreshed()}
        out = figures(self.home, by_job)
        if self.interactive is not None:
            out["interactive"] = dict(
                self.interactive.counts, waiting=len(self.interactive.resident.inbox)
            )
        return out

    def page(self, request: Request) -> Response:
        return HTMLResponse(html_page(self._figures()))

    def status(self, request: Request) -> Response:
        return JSONResponse(self._figures())

    def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": model_list(self.overrides)})

    # -- files -----------------------------------------------------------------------------
    async def upload(self, request: Request) -> Response:
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > self.limits.max_bytes + FORM_SLACK:
            raise bad_request(f"the file is larger than {self.limits.max_bytes} bytes, the most a "
                              "batch input file may hold", "file", "file_too_large")  # fmt: skip
        form = await request.form(max_files=1, max_fields=8)
        try:
            upload = form.get("file")
            if not isinstance(upload, UploadFile):
                raise bad_request("a multipart field 'file' with the JSONL file is required",
                                  "file", "missing_required_parameter")  # fmt: skip
            purpose = form.get("purpose")
            obj = await run_in_threadpool(self.files.upload, upload.file, upload.filename,
                                          purpose if isinstance(purpose, str) else None,
                                          self.limits)  # fmt: skip
        finally:
            await form.close()
        return JSONResponse(obj)

    def list_files(self, request: Request) -> Response:
        q = request.query_params
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', not {order!r}", "order")
        found = self.files.list(q.get("purpose"))
        if order == "desc":
            found.reverse()
        return JSONResponse(_page(found, q.get("after"), _limit(q, 10_000, MAX_FILES_PAGE)))

    def get_file(self, request: Request) -> Response:
        return JSONResponse(self.files.get(request.path_params["file_id"]))

    def delete_file(self, request: Request) -> Response:
        return JSONResponse(self.files.delete(request.path_params["file_id"]))

    def file_content(self, request: Request) -> Response:
        path = self.files.content(request.path_params["file_id"])
        return FileResponse(path, media_type="application/jsonl")

    # -- batches ---------------------------------------------------------------------------
    async def create_batch(self, request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError:
            raise bad_request("the request body is not valid JSON") from None
        return JSONResponse(await run_in_threadpool(self.batches.create, body))

    def list_batches(self, request: Request) -> Response:
        q = request.query_params
        page, more = self.batches.list(q.get("after"), _limit(q, 20, MAX_PAGE))
        return JSONResponse({"object": "list", "data": page, "has_more": more,
                             "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None})  # fmt: skip

    def get_batch(self, request: Request) -> Response:
        return JSONResponse(self.batches.get(request.path_params["batch_id"]))

    def cancel_batch(self, request: Request) -> Response:
        return JSONResponse(self.batches.cancel(request.path_params["batch_id"]))


def _limit(query, default: int, most: int) -> int:
    text = query.get("limit")
    if text is None:
        return default
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise bad_request(f"limit must be an integer from 1 to {most}, not {text!r}", "limit")
    return int(text)


def _page(items, after: Optional[str], limit: int) -> Dict[str, Any]:
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise bad_request(f"after: no such id {after!r}", "after", "invalid_cursor")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
    return {"object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None}  # fmt: skip


def served_spec(overrides: Dict[str, Any]) -> JobSpec:
    """The job settings interactive requests are answered with: the served model and
    ``--max-tokens``, else the defaults (a job of the same flags loads the same model)."""
    given = {
        k: overrides[k]
        for k in ("target", "draft", "max_tokens", "max_tokens_cap")
        if k in overrides
    }
    spec = JobSpec(**given)
    # the model named as a job of these flags records it (``--draft none``: no drafter), so the
    # in-process worker's jobs of this model share its engine
    return dataclasses.replace(spec, **recorded_model({k: getattr(spec, k) for k in MODEL_KEYS}))


def model_list(overrides: Dict[str, Any]) -> list:
    """The served target (and its drafter, where one is named), as OpenAI model objects."""
    target = overrides.get("target")
    name = DEFAULT_TARGET_NAME if target is None else Path(target).name if Path(
        target).is_absolute() else target  # fmt: skip
    draft = overrides.get("draft", "auto")
    out = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "dflash-batch",
            EXTENSION: {"role": "target", "draft": draft},
        }
    ]
    if draft not in (None, "auto", "none"):
        drafter = Path(draft).name if Path(draft).is_absolute() else draft
        out.append(
            {
                "id": drafter,
                "object": "model",
                "created": 0,
                "owned_by": "dflash-batch",
                EXTENSION: {"role": "drafter", "target": name},
            }
        )
    return out


class KeyCheck:
    """Refuse (401) a request without ``Authorization: Bearer <the key>``."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = ApiError(
                    401,
                    "a valid API key is required: Authorization: Bearer KEY",
                    code="invalid_api_key",
                )
                response = await _api_error(None, error)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _api_error(request, e: ApiError) -> Response:
    return JSONResponse(e.body(), status_code=e.status)


async def _http_error(request, e: HTTPException) -> Response:
    kind = "not_found" if e.status_code == 404 else None
    error = ApiError(e.status_code, f"{e.detail}: {request.method} {request.url.path}", code=kind)
    return JSONResponse(error.body(), status_code=e.status_code)


async def _server_error(request, e: Exception) -> Response:
    log.exception("%s %s failed", request.method, request.url.path)
    error = ApiError(500, f"the server failed: {type(e).__name__}: {e}", code="server_error",
                     kind="server_error")  # fmt: skip
    return JSONResponse(error.body(), status_code=500)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; ``OSError`` (port taken, no such address) before
    anything else starts."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def serve(
    home: Path,
    *,
    submit: Callable[..., Any],
    sock: socket.socket,
    api_key: Optional[str] = None,
    limits: Limits = Limits(),
    overrides: Optional[Dict[str, Any]] = None,
    worker: Optional[Callable[[], None]] = None,
    resident: Optional[Resident] = None,
) -> None:
    """Serve on ``sock`` (from ``bind``) until stopped. ``worker``: a queue worker loop to run in
    this process's main thread (where its signal handling works), the server then running
    beside it until it returns; ``resident``: the engine of interactive requests."""
    import uvicorn

    app = create_app(home, submit=submit, api_key=api_key, limits=limits, overrides=overrides,
                     resident=resident)  # fmt: skip
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    host, port = sock.getsockname()[:2]
    log.info("serving the OpenAI Files and Batches API on http://%s:%d (home %s)",
             host, port, home)  # fmt: skip
    if worker is None:
        server.run(sockets=[sock])
        return
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="serve",
                              daemon=True)  # fmt: skip
    thread.start()
    try:
        worker()
    finally:
        server.should_exit = True
        thread.join(timeout=10)
