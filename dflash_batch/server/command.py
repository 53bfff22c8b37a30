"""The ``serve`` command's flags and what it runs (cli.py registers both, lazily)."""

from __future__ import annotations

import argparse
import ipaddress
import os
from typing import Any, Dict

from .. import environment
from ..errors import CliError
from .files import Limits

API_KEY_ENV = "DFLASH_BATCH_API_KEY"
EXIT_REFUSED = 2


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve OpenAI's Files, Batches and (chat) completions API and a status page",
        description="Serve OpenAI's Files and Batches API (/v1/files, /v1/batches, "
        "/v1/models) and a status page (/) on this home's queue: each batch is a "
        "job that `dflash-batch worker` (or --worker) runs. /v1/chat/completions "
        "and /v1/completions answer at once on the served model, joining the "
        "running batch with --worker. See docs/serve.md.",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1; any other needs --api-key)",
    )
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every request (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--worker",
        action="store_true",
        help="also run a queue worker in this process, so one command serves",
    )
    g = p.add_argument_group("job settings of every batch")
    g.add_argument(
        "--target",
        "--model",
        dest="target",
        help="target model (default: the embedded default pair)",
    )
    g.add_argument("--draft", help="DFlash drafter: folder, hub repo id, 'auto' or 'none'")
    g.add_argument(
        "--max-tokens",
        type=_positive,
        help="completion tokens for requests without their own max_tokens",
    )
    g.add_argument(
        "--max-tokens-cap",
        type=_positive,
        help="no request (batch line or interactive) generates more, whatever it asks",
    )
    g.add_argument("--chunk-size", type=_positive, help="requests per queue task (default 64)")
    g = p.add_argument_group("interactive requests (/v1/chat/completions, /v1/completions)")
    g.add_argument(
        "--interactive-slots",
        type=_positive,
        help="rows decoded together when no "
        "batch job is running (default: the engine's batch size)",
    )
    g.add_argument(
        "--max-waiting",
        type=_positive,
        default=256,
        help="interactive requests waiting at once; more are refused with 429 (default 256)",
    )
    g = p.add_argument_group("input file limits (OpenAI's by default)")
    g.add_argument("--max-requests-per-file", type=_positive, default=Limits.max_requests)
    g.add_argument("--max-file-bytes", type=_positive, default=Limits.max_bytes)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 0 to 65535, got {text!r}")
    return int(text)


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args) -> int:
    from ..runner.jobs import home_dir

    api_key = args.api_key or environment.get(API_KEY_ENV)
    if not is_loopback(args.host) and not api_key:
        raise CliError(f"--host {args.host} is not a loopback address: give --api-key (or set "
                       f"${API_KEY_ENV}) so that only clients with the key are served",
                       EXIT_REFUSED)  # fmt: skip
    try:
        from .app import bind, serve
    except ImportError as e:
        from ..extras import install_hint

        raise CliError(f"serve needs {e.name}: {install_hint('serve')}", EXIT_REFUSED) from None
    overrides: Dict[str, Any] = {k: getattr(args, k) for k in ("target", "draft", "max_tokens",
                                                               "max_tokens_cap", "chunk_size")}  # fmt: skip
    overrides = {k: v for k, v in overrides.items() if v is not None}
    home = home_dir()
    limits = Limits(args.max_requests_per_file, args.max_file_bytes)
    from ..api import check_engine_settings, load_model
    from ..inbox import Inbox
    from .app import served_spec
    from .resident import Resident

    check_engine_settings()
    # one engine for interactive requests and the in-process worker's jobs of the served model
    resident = Resident(load_model, served_spec(overrides).model, slots=args.interactive_slots,
                        inbox=Inbox(args.max_waiting))  # fmt: skip
    worker = None
    if args.worker:
        from ..runner.worker import run_worker

        def worker():
            run_worker(home, resident.worker_factory)

    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise CliError(
            f"--host {args.host} --port {args.port}: cannot listen there ({e.strerror or e})",
            EXIT_REFUSED,
        ) from None
    from ..api import submit

    serve(
        home,
        submit=submit,
        sock=sock,
        api_key=api_key,
        limits=limits,
        overrides=overrides,
        worker=worker,
        resident=resident,
    )
    if worker is not None:  # as `dflash-batch worker` ends: past MLX's teardown, which can abort
        import logging
        import sys

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
