"""``dflash-batch``: run batches of prompts through DFlash speculative decoding.

Exit codes (``EXIT_*``): 0 success (``run``: every row ok), 1 the job failed or stopped
(``run``: a model that does not load, a cancelled job), 2 refused: bad usage, spec or input,
nothing done, 3 output dir busy (another process holds its lock), 4 no such job or schedule,
5 ``run`` finished but some rows are error rows, 130 interrupted, 141 the reader of stdout went
away (``| head``), as for a command that SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from . import environment
from .errors import CliError
from .request import CONTROLS

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_REFUSED = 2
EXIT_BUSY = 3
EXIT_NOT_FOUND = 4
EXIT_ROWS_FAILED = 5
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141

EXAMPLES = """\
examples:
  dflash-batch run examples/prompts.jsonl --target ./my-model --max-tokens 64
  dflash-batch submit jobs/dataset.yaml          # prints the job id
  dflash-batch worker                            # in another terminal: runs queued jobs
  dflash-batch status JOB_ID
  dflash-batch results JOB_ID --format openai --out batch_output.jsonl

exit codes: 0 ok (run: every row ok), 1 job failed or stopped, 2 refused (bad usage, spec or
input), 3 output dir busy, 4 no such job or schedule, 5 run finished with error rows,
130 interrupted, 141 stdout closed early.

Results are Parquet part files in the job's output dir: pandas.read_parquet(output_dir).
Queue, job records and default output dirs live in $DFLASH_BATCH_HOME (see --home).
"""


DRY_RUN_HELP = (
    "read the input and spec, count rows and error rows, print the settings and output dir; "
    "load no model, create no job (exit 5 when some rows are error rows)"
)


def _overrides(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job settings (override the YAML spec)")
    g.add_argument("--name", help="job name (default: input file name + path hash)")
    g.add_argument(
        "-o",
        "--output-dir",
        help="folder for the Parquet parts (may use {home} {name} {date} {time})",
    )
    g.add_argument(
        "--input-format",
        choices=["auto", "jsonl", "openai", "parquet"],
        help="default: from the suffix",
    )
    g.add_argument("--id-field", help="column/key holding the row id (default: id, then custom_id)")
    g.add_argument("--prompt-field", help="column/key holding the prompt text (default: prompt)")
    g.add_argument("--messages-field", help="column/key holding chat messages (default: messages)")
    g.add_argument(
        "--prompt-template", help="build prompts from row fields, e.g. 'Summarize:\\n\\n$text'"
    )
    g.add_argument(
        "--system", dest="system_prompt", help="system prompt for every row without its own"
    )
    g.add_argument("--no-chat-template", dest="chat_template", action="store_const", const=False,
                   help="feed prompt text to the model as it is")  # fmt: skip
    g.add_argument(
        "--target", "--model", dest="target", help="target model: folder, hub repo id or .gguf"
    )
    g.add_argument("--target-revision", help="hub revision (branch, tag, commit) of the target")
    g.add_argument(
        "--draft", help="DFlash drafter: folder, hub repo id, or 'auto' (registered one)"
    )
    g.add_argument(
        "--no-draft",
        dest="draft",
        action="store_const",
        const="none",
        help="plain autoregressive decoding",
    )
    g.add_argument("--draft-revision", help="hub revision of the drafter")
    g.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, help="verify at most this many tokens per cycle")
    g.add_argument("--prefix-cache-mb", type=float,
                   help="memory for prompt prefixes that items share, prefilled once (default 1024; 0: off)")  # fmt: skip
    g.add_argument("--max-tokens", type=int,
                   help="completion tokens for rows without their own max_tokens (default 256)")  # fmt: skip
    g.add_argument("--max-tokens-cap", type=int,
                   help="no row generates more than this, whatever its own max_tokens says")  # fmt: skip
    g.add_argument(
        "--temperature",
        type=float,
        help="for rows without their own temperature; 0 = greedy (default)",
    )
    g.add_argument("--seed", type=int)
    g.add_argument(
        "--n",
        type=int,
        help="samples per row for rows without their own n, each its own result row (default 1)",
    )
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    # sampling controls, logprobs, structured output: defaults for rows without their own (docs/sampling.md)
    g.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (0: off)")
    g.add_argument(
        "--top-p",
        type=float,
        help="nucleus sampling: the likeliest tokens up to this mass (1: off)",
    )
    g.add_argument(
        "--min-p",
        type=float,
        help="drop tokens below min_p times the top token's probability (0: off)",
    )
    g.add_argument(
        "--repetition-penalty",
        type=float,
        help="divide logits of tokens seen in prompt or output (1: off)",
    )
    g.add_argument(
        "--presence-penalty",
        type=float,
        help="subtract from logits of tokens in the output (-2..2)",
    )
    g.add_argument(
        "--frequency-penalty",
        type=float,
        help="subtract this times the token's output count (-2..2)",
    )
    g.add_argument(
        "--logprobs", action="store_const", const=True, help="record each output token's logprob"
    )
    g.add_argument(
        "--top-logprobs", type=int, help="and the logprobs of this many best alternatives (0..20)"
    )
    g.add_argument(
        "--response-format",
        type=_json_value,
        metavar="JSON|@FILE",
        help='constrain output, e.g. \'{"type": "json_schema", "json_schema": {"schema": {...}}}\'',
    )
    g.add_argument(
        "--chunk-size", type=int, help="rows per queue task and per committed part (default 64)"
    )
    g.add_argument("--batch-size", type=int,
                   help="most rows decoded together (default: what memory allows, at most 16 on CPU, 32 on a GPU)")  # fmt: skip
    g.add_argument("--control", type=_share, metavar="FRACTION",
                   help="decode this share of rows plainly in the same batch, as a measured check of what "
                   "speculation saved (0..1, default 0; docs/runner.md)")  # fmt: skip
    g.add_argument("--retries", type=int, help="task retries after a job-level failure")
    g.add_argument("--export-openai", action="store_const", const=True,
                   help="also write _openai_output.jsonl when the job completes")  # fmt: skip
    g.add_argument("--force", action="store_const", const=True,
                   help="write into an output dir made with another model/sampling config")  # fmt: skip


OVERRIDE_KEYS = (
    "name", "output_dir", "input_format", "id_field", "prompt_field", "messages_field", "prompt_template",
    "system_prompt", "chat_template", "target", "target_revision", "draft", "draft_revision", "dtype",
    "block_size", "max_tokens", "max_tokens_cap", "temperature", "seed", "stop", "chunk_size", "batch_size", "retries",
    "export_openai", "force", "n", "prefix_cache_mb", "control",
) + tuple(CONTROLS)  # fmt: skip


JSON_FILE_BYTES = 16 * 2**20  # the most a flag's @FILE may hold


def _json_value(text: str):
    """A flag's JSON value, given inline or as @file (a regular file, bounded in size)."""
    import json

    from . import checks

    if text.startswith("@"):
        try:
            text = checks.small_file_text(text[1:], JSON_FILE_BYTES)
        except checks.BadValue as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    except RecursionError:  # json reads nested values recursively
        raise argparse.ArgumentTypeError("nests too deeply to read") from None


def _override_values(args) -> Dict[str, Any]:
    return {k: getattr(args, k, None) for k in OVERRIDE_KEYS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash-batch",
        description="Run large batches of prompts through an MLX model with DFlash speculative decoding.",
        epilog=f"{EXAMPLES}\n\n{environment.epilog()}",  # the variables from their one table
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(parser, None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("submit", help="queue a job for a worker; prints the job id",
                       description="Queue FILE (JSONL/Parquet) or JOB.yaml for `dflash-batch worker`. "
                       "A YAML job with a `schedule` is registered for the workers' cron instead "
                       "(use --now to also run it once now).")  # fmt: skip
    p.add_argument("source", metavar="FILE|JOB.yaml")
    p.add_argument("--now", action="store_true", help="for a scheduled YAML job: also queue it now")
    p.add_argument("--json", action="store_true", help="print the job as JSON")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    _overrides(p)

    p = sub.add_parser("run", help="run a job here in the foreground (no queue), with a progress bar",
                       description="Run FILE or JOB.yaml to the end in this process. Rerunning resumes: "
                       "rows already in the output dir are skipped.")  # fmt: skip
    p.add_argument("source", metavar="FILE|JOB.yaml")
    p.add_argument(
        "-q",
        "--quiet",
        "--no-progress",
        dest="quiet",
        action="store_true",
        help="no progress bar (items done, output tok/s, ETA) and no INFO logs",
    )
    p.add_argument("--json", action="store_true", help="print the final status as JSON")
    p.add_argument("--dry-run", action="store_true", help=DRY_RUN_HELP)
    _overrides(p)

    p = sub.add_parser("worker", help="run the queue consumer (one resident engine)",
                       description="Process queued jobs with one engine kept in memory, each job's pending "
                       "chunks as one stream through the batched engine. SIGINT/SIGTERM stop gracefully: "
                       "finished rows are committed, the current chunk is requeued (rows in flight are "
                       "generated again).")  # fmt: skip
    p.add_argument(
        "--target",
        "--model",
        dest="target",
        help="load this target at start (else on the first job)",
    )
    p.add_argument("--draft", default="auto", help="drafter for --target (default: auto)")
    p.add_argument("--target-revision")
    p.add_argument("--draft-revision")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--block-size", type=int)
    p.add_argument(
        "--preload-default", action="store_true", help="load the embedded default pair at start"
    )
    p.add_argument("--schedules", action="append", default=[], metavar="PATH",
                   help="YAML job file or folder whose `schedule` to run (repeatable; "
                   "$DFLASH_BATCH_HOME/schedules is always read)")  # fmt: skip
    p.add_argument(
        "--no-periodic", action="store_true", help="do not run cron schedules (other workers do)"
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_seconds,
        default=30.0,
        help="seconds to finish the current item on stop",
    )
    p.add_argument("--device", type=int, metavar="N", help="pin this worker to GPU N (sets CUDA_VISIBLE_DEVICES; "
                   "one worker per GPU, each with its own engine)")  # fmt: skip

    p = sub.add_parser("status", help="counts, mean tok/s and acceptance of one job or all")
    p.add_argument("job", nargs="?", metavar="JOB")
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--watch",
        nargs="?",
        const=2.0,
        type=_seconds,
        metavar="SECONDS",
        help="follow JOB until it ends: items done, tok/s and ETA on stderr, polled every "
        "SECONDS (default 2); exits as `run` would",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="with --watch: no progress bar and no INFO logs, only the final status",
    )

    p = sub.add_parser("adapt", help="train a job's drafter on its finished rows; kept if it drafts better",
                       description="Warm-start from the drafter the job drafts with now, train on the "
                       "job's finished rows (a held-out share of its prompts aside) within a time budget, "
                       "and keep the result as the job's next drafter revision only if its held-out "
                       "acceptance beats the current one's. Workers draft with it from their next batch; "
                       "the output does not change.")  # fmt: skip
    p.add_argument("job", metavar="JOB")
    p.add_argument(
        "--time-budget", type=_seconds, default=300.0, help="seconds of training (default 300)"
    )
    p.add_argument("--steps", type=int, help="training steps (default: fill the time budget)")
    p.add_argument("--min-rows", type=int, help="fewer finished rows are refused (default 64)")
    p.add_argument(
        "--min-gain",
        type=float,
        help="kept only above (1 + this) x the held-out acceptance now (default 0)",
    )
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("cancel", help="stop a job between items")
    p.add_argument("job", metavar="JOB")

    p = sub.add_parser("retry", help="queue a job again (error rows and unfinished items)")
    p.add_argument("job", metavar="JOB")
    p.add_argument(
        "--failed-only", action="store_true", help="only the error rows, not unfinished items"
    )

    p = sub.add_parser("rm", help="remove finished jobs' records (with --files, their results too)")
    p.add_argument("jobs", nargs="+", metavar="JOB")
    p.add_argument(
        "--files",
        action="store_true",
        help="also delete the result files in each job's output dir (not a dir another "
        "job's record still uses, nor files in it that are not results)",
    )

    p = sub.add_parser("prune", help="remove the records of finished jobs older than an age")
    p.add_argument(
        "--older-than",
        required=True,
        type=_age,
        metavar="AGE",
        help="created more than AGE ago: seconds, or a number with s, m, h or d (7d)",
    )
    p.add_argument(
        "--files", action="store_true", help="also delete their result files (as rm --files)"
    )

    p = sub.add_parser("schedules", help="list the cron schedules registered in the home")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser(
        "unschedule", help="remove a registered cron schedule (restart workers to drop it)"
    )
    p.add_argument("schedule", metavar="NAME", help="as `dflash-batch schedules` lists it")

    p = sub.add_parser(
        "results", help="export a job's rows (Parquet folder, JSON lines, OpenAI batch output)"
    )
    p.add_argument("job", metavar="JOB")
    p.add_argument("--format", choices=["parquet", "jsonl", "openai"], default="parquet")
    p.add_argument(
        "--out", help="file to write (default: parquet prints the output dir, others go to stdout)"
    )
    shown = p.add_mutually_exclusive_group()
    shown.add_argument(
        "--text", action="store_true", help="print each row's id and output, in input order"
    )
    shown.add_argument(
        "--columns", metavar="A,B", help="print these columns as JSON lines, in input order"
    )

    p = sub.add_parser("drafters", help="list the registered target/drafter pairs (--draft auto) and the published ones",
                       description="The DFlash drafters registered for target names, then the other "
                       "published pairings, with generation and recommended block (no model is "
                       "loaded or downloaded). A target without one decodes plainly under "
                       "--draft auto.")  # fmt: skip
    p.add_argument("--json", action="store_true")

    from .server.command import add_parser as add_serve_parser  # its flags only: no server yet

    add_serve_parser(sub)

    for p in sub.choices.values():  # after the command too: `run x.jsonl --home DIR`
        _common(p, argparse.SUPPRESS)  # not given there: the value before the command stands
    sub.add_parser(
        "train-drafter",
        help="train a DFlash drafter (see `dflash-batch train-drafter --help`)",
        add_help=False,
    )
    return parser


def _common(p: argparse.ArgumentParser, default) -> None:
    """The options of every command, before or after its name."""
    p.add_argument(
        "--home",
        default=default,
        help="state folder (default: $DFLASH_BATCH_HOME or the user data dir)",
    )
    p.add_argument("--redis", metavar="URL", default=default,
                   help="queue on a Redis server, e.g. redis://host:6379/0, instead of SQLite in "
                   "the home (default: $DFLASH_BATCH_REDIS_URL)")  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true", default=default or False,
                   help="debug logging")  # fmt: skip


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    from . import checks

    try:
        return checks.finite_number(float(text), 0)
    except (ValueError, checks.BadValue) as e:
        raise argparse.ArgumentTypeError(
            f"must be a finite number of seconds >= 0, got {text!r}"
        ) from e


def _share(text: str) -> float:
    """An argparse type: a number (its range is the spec's to check, with the YAML's)."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text!r}") from None


def _age(text: str) -> float:
    """An argparse type: an age such as 90, 90s, 30m, 12h or 7d, in seconds."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
    try:
        return _seconds(number) * unit
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be an age such as 3600, 30m, 12h or 7d, got {text!r}"
        ) from None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "train-drafter":
        return _train_drafter(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_REFUSED
    if args.home:
        environment.export(DFLASH_BATCH_HOME=str(Path(args.home).expanduser().resolve()))
    if args.redis:
        environment.export(DFLASH_BATCH_REDIS_URL=args.redis)
    quiet = getattr(args, "quiet", False)  # -q: warnings and errors only, no bar, no INFO lines
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s [%(threadName)s] %(name)s: %(message)s",
    )
    from .checks import BadValue
    from .runner.cron import ScheduleNotFound
    from .runner.items import InputError
    from .runner.jobs import AmbiguousJob, JobNotFound
    from .runner.lock import Locked
    from .runner.spec import SpecError

    try:
        _check_setup(args)
        return COMMANDS[args.command](args)
    except (InputError, SpecError, BadValue) as e:
        # the message in the command line's terms (flags, not keyword arguments) where it has one
        return _fail(getattr(e, "cli_message", str(e)), EXIT_REFUSED)
    except Locked as e:
        return _fail(f"{e}; wait for it, or cancel that job", EXIT_BUSY)
    except AmbiguousJob as e:
        return _fail(str(e), EXIT_REFUSED)
    except (JobNotFound, ScheduleNotFound) as e:
        return _fail(str(e), EXIT_NOT_FOUND)
    except CliError as e:
        return _fail(str(e), e.code)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly. Later writes, and the final flush at
        # exit, go to /dev/null instead of raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt:
        return _fail("interrupted (finished items are saved; rerun to resume)", EXIT_INTERRUPTED)


WRITING_COMMANDS = ("submit", "run", "worker", "cancel", "retry", "unschedule", "serve", "adapt")


def _check_setup(args) -> None:
    """Refuse, before any work, a home that cannot serve the command and settings that
    cannot be used; each message names the flag or variable."""
    from .runner.jobs import check_home, home_dir
    from .runner.lease import lease_ttl
    from .runner.spec import SpecError

    where = "--home" if args.home else "home"
    if not args.home and environment.get("DFLASH_BATCH_HOME"):
        where = "$DFLASH_BATCH_HOME"
    try:
        check_home(
            home_dir(),
            write=args.command in WRITING_COMMANDS and not getattr(args, "dry_run", False),
        )
    except SpecError as e:
        raise SpecError(f"{where} {e}") from None
    lease_ttl()
    if args.command == "worker":
        from .api import check_engine_settings

        check_engine_settings()


def _fail(message: str, code: int) -> int:
    print(f"dflash-batch: error: {message}", file=sys.stderr)
    return code


def _print_json(data) -> None:
    import orjson

    sys.stdout.write(orjson.dumps(data, option=orjson.OPT_INDENT_2, default=str).decode() + "\n")


def _load(args):
    from .runner.spec import load_spec

    return load_spec(args.source, **_override_values(args))


# -- commands --------------------------------------------------------------------------------
def cmd_submit(args) -> int:
    from . import api
    from .runner.jobs import home_dir

    if args.dry_run:
        return _dry_run(args)
    spec = _load(args)
    home = home_dir()
    if spec.schedule:
        path = api.add_schedule(args.source, home=home, **_override_values(args))
        if args.json and not args.now:
            _print_json(next(s for s in api.schedules(home) if s["file"] == str(path)))
            return EXIT_OK
        said = sys.stderr if args.json else sys.stdout  # --json --now: stdout is the job's JSON
        print(f"scheduled {path.stem!r} at {spec.schedule!r} (UTC): {path}", file=said)
        print("workers read schedules at start: restart running workers to pick it up", file=said)
        if not args.now:
            return EXIT_OK
    job = api.submit(spec, home=home)
    status = job.status()
    if args.json:
        _print_json(status)
    else:
        print(job.id)
        print(_queued_line(status, len(job.record.pending_chunks())), file=sys.stderr)
    return EXIT_OK


def _queued_line(s: Dict[str, Any], chunks: int) -> str:
    """What submit did: items already done in the output dir (from earlier jobs), with their
    result rows, and items queued."""
    where = f"output: {s['output_dir']}"
    if s["done"] == 0:
        return f"{s['total']} items in {chunks} chunk(s) queued; {where}"
    failed = (
        f"; `dflash-batch retry {s['id']} --failed-only` runs the {s['failed']} error rows again"
        if s["failed"]
        else ""
    )
    rows = f"{s['ok'] + s['failed']} rows: {s['ok']} ok, {s['failed']} failed"
    if s["remaining"] == 0:
        done = f"all {s['total']} items already done ({rows}): nothing queued{failed}; {where}"
        again = "a job of another --name (or -o) gets a folder of its own and generates them again"
        return f"{done}; {again}"
    return (f"{s['total']} items: {s['done']} already done ({rows}), {s['remaining']} queued "
            f"in {chunks} chunk(s); {where}")  # fmt: skip


def cmd_run(args) -> int:
    from . import api

    if args.dry_run:
        return _dry_run(args)
    try:
        job = api.run(_load(args), progress=not args.quiet)
    except api.JobFailed as e:
        return _fail(str(e), EXIT_FAILED)
    status = job.status()
    if args.json:
        _print_json(status)
    else:
        print(_status_line(status))
        print(f"results: {status['output_dir']}")
    code = run_exit_code(status)
    if code == EXIT_ROWS_FAILED:
        rows = status["ok"] + status["failed"]  # result rows, one per sample
        print(f"dflash-batch: {status['failed']} of {rows} rows failed: their `error` column says "
              f"why (`dflash-batch results {status['id']} --format jsonl`)",
              file=sys.stderr)  # fmt: skip
    return code


def _dry_run(args) -> int:
    """What the job would be, from its input and spec alone: no model, no job record."""
    from . import api

    plan = api.dry_run(args.source, **_override_values(args))
    if args.json:
        _print_json(plan)
        return EXIT_ROWS_FAILED if plan["errors"] else EXIT_OK
    print(f"input: {plan['input']}: {plan['rows']} rows, {plan['errors']} of them error rows")
    print(f"output: {plan['output_dir']} ({plan['done']} rows there already)")
    print(f"model: {plan['model']}, drafter {plan['settings']['draft']}")
    print("settings:")
    for key, value in plan["settings"].items():
        if value not in (None, [], {}) and key != "input":
            print(f"  {key}: {value}")
    print("dry run: no model loaded, no job created")
    return EXIT_ROWS_FAILED if plan["errors"] else EXIT_OK


def run_exit_code(status: Dict[str, Any]) -> int:
    """0: completed, every row ok; 5: completed with error rows; 1: not completed."""
    if status["state"] != "completed":
        return EXIT_FAILED
    return EXIT_ROWS_FAILED if status["failed"] else EXIT_OK


def cmd_worker(args) -> int:
    if args.device is not None:  # before anything loads the backend
        from .runner.scaleout import device_env

        environment.export(**device_env(args.device))
    from .api import load_model
    from .runner.jobs import home_dir
    from .runner.spec import recorded_model
    from .runner.worker import run_worker

    preload = None
    if args.target or args.preload_default:
        preload = recorded_model({
            "target": args.target,
            "target_revision": args.target_revision,
            "draft": args.draft,
            "draft_revision": args.draft_revision,
            "dtype": args.dtype,
            "block_size": args.block_size,
            "max_context": None,
            "prefix_cache_mb": getattr(args, "prefix_cache_mb", None),
        })  # fmt: skip
    run_worker(
        home_dir(),
        load_model,
        preload=preload,
        schedules=[Path(p) for p in args.schedules],
        periodic=not args.no_periodic,
        shutdown_timeout=args.shutdown_timeout,
        device=None if args.device is None else str(args.device),
        adapter=_adapt_job,
    )
    # Everything is committed by now. Skip interpreter teardown: MLX's C++ runtime can abort
    # ("terminate called without an active exception") destroying streams whose thread ended.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _fmt(value, spec=".1f") -> str:
    return "-" if value is None else format(value, spec)


def _status_line(s: Dict[str, Any]) -> str:
    from .runner import saved
    from .runner.jobs import counts_text
    from .runner.progress import DECODE_RATE

    speculation = saved.text(s["speculation"])
    return (
        f"{s['id']}  {s['state']:<11} {counts_text(s)}  "
        f"{DECODE_RATE} {_fmt(s['mean_decode_tps'])}  "
        f"acceptance {_fmt(s['mean_acceptance_drafted'], '.2f')} "
        f"(of drafted) {_fmt(s['mean_acceptance_generated'], '.2f')} (of generated)  "
        f"tau {_fmt(s['mean_tokens_per_cycle'], '.2f')}"
        + ("".join(f"\n  {line}" for line in speculation.splitlines()) if speculation else "")
        + (f"\n  error: {s['error']}" if s.get("error") else "")
    )


def cmd_status(args) -> int:
    from .api import activity
    from .runner.jobs import home_dir, list_jobs, load_job

    home = home_dir()
    if args.watch is not None:
        if args.job is None:
            raise CliError("status --watch follows one job: give its id", EXIT_REFUSED)
        return watch(load_job(home, args.job), args.watch, quiet=args.quiet, as_json=args.json)
    records = [load_job(home, args.job)] if args.job is not None else list_jobs(home)
    statuses = [r.status() for r in records]
    now = activity(home)
    for s in statuses:  # which worker holds which chunk of each job
        s["holders"] = [
            {k: r.get(k) for k in ("chunk", "worker", "host", "expires_in")}
            for r in now["leases"]
            if r["job"] == s["id"]
        ]
    if args.json:
        if args.job is not None:
            statuses[0]["workers"] = now["workers"]
        _print_json(statuses[0] if args.job is not None else statuses)
        return 0
    if not statuses:
        print(f"no jobs in {home}")
    from .runner.drafters import summary_lines

    for s in statuses:
        print(_status_line(s))
        for line in summary_lines(s["drafter"]):
            print(line)
        for h in s["holders"]:
            print(
                f"  chunk {h['chunk']} held by {h['worker']} (lease {h['expires_in']:.0f} s left)"
            )
    for w in now["workers"]:  # rates over the worker's last minute
        print(f"worker {w['id']}  device {w.get('device') or '-'}  {w['rows_per_s']:.2f} rows/s  "
              f"{w['tokens_per_s']:.1f} output tok/s (last minute)  {w['rows']} rows  "
              f"on {w.get('chunk') or 'nothing'}")  # fmt: skip
    return 0


def watch(record, every: float, quiet: bool = False, as_json: bool = False) -> int:
    """Poll a job's status until it is completed, failed or cancelled; a bar (items, tok/s,
    ETA) meanwhile. The exit code is `run`'s for the final status."""
    import time

    from .api import idle_note
    from .runner.progress import Progress

    status = record.status()
    bar = (
        None
        if quiet
        else Progress(
            status["total"], status["done"], record.id, tokens=status["completion_tokens"]
        )
    )
    said = None
    try:
        while status["state"] not in ("completed", "failed", "cancelled"):
            said = _say_idle(idle_note(record, status["state"]), said)
            time.sleep(every)
            status = record.status()
            if bar is not None:
                bar.counts(status["done"], status["completion_tokens"])
    finally:
        if bar is not None:
            bar.close()
    if as_json:
        _print_json(status)
    else:
        print(_status_line(status))
    return run_exit_code(status)


def _say_idle(note: Optional[str], said: Optional[str]) -> Optional[str]:
    """Print why the watched job does not move, once each time that changes (above the bar)."""
    if note and note != said:
        from tqdm import tqdm

        tqdm.write(f"dflash-batch: {note}", file=sys.stderr)
    return note


def cmd_cancel(args) -> int:
    from . import api

    job = api.cancel(args.job)
    print(
        f"cancelled {job.id}: queued chunks are dropped, a running one stops after its current item"
    )
    return 0


def cmd_retry(args) -> int:
    from . import api

    counts = api.retry(args.job, failed_only=args.failed_only)
    print(
        f"queued {counts['items']} item(s) in {counts['chunks']} chunk(s) ({counts['failed_dropped']} error rows dropped)"
    )
    return 0


def cmd_results(args) -> int:
    from .api import Job
    from .runner.export import write_lines

    job = Job(args.job)
    if args.text or args.columns:
        return _print_rows(job, args.columns)
    if args.format == "parquet":
        if not args.out:
            print(job.output_dir)
            return 0
        import pyarrow.parquet as pq

        try:
            with _open_out(args.out) as f:
                pq.write_table(job.to_arrow(), f)
        except OSError as e:
            raise CliError(f"cannot write {args.out}: {e.strerror or e}", EXIT_REFUSED) from e
        print(args.out)
        return 0
    table = job.to_arrow()
    if args.out:
        try:
            with _open_out(args.out) as f:
                n = write_lines(table, f, args.format, model=job.record.spec.model_name)
        except OSError as e:
            raise CliError(f"cannot write {args.out}: {e.strerror or e}", EXIT_REFUSED) from e
        print(f"{n} lines -> {args.out}", file=sys.stderr)
    else:
        write_lines(table, sys.stdout.buffer, args.format, model=job.record.spec.model_name)
        sys.stdout.flush()  # a closed pipe shows here, inside main, not at exit
    return 0


def _print_rows(job, columns: Optional[str]) -> int:
    """``--text``: each row's id and output (or error); ``--columns``: those columns as JSON
    lines. In input order, a row's samples in turn."""
    import orjson

    table = job.to_arrow().sort_by([("input_index", "ascending"), ("sample_index", "ascending")])
    if columns:
        names = [c.strip() for c in columns.split(",") if c.strip()]
        unknown = [c for c in names if c not in table.column_names]
        if unknown or not names:
            raise CliError(f"--columns: no column {', '.join(unknown) or columns!r}; a row has "
                           f"{', '.join(table.column_names)}", EXIT_REFUSED)  # fmt: skip
        for row in table.select(names).to_pylist():
            sys.stdout.buffer.write(orjson.dumps(row, default=str) + b"\n")
        sys.stdout.flush()
        return EXIT_OK
    for row in table.to_pylist():
        sample = f" (sample {row['sample_index']})" if row["sample_index"] else ""
        print(f"--- {row['id']}{sample}")
        print(row["output"] if row["status"] == "ok" else f"error: {row['error']}")
    return EXIT_OK


def cmd_rm(args) -> int:
    from . import api

    _print_removed(api.remove(args.jobs, files=args.files))
    return EXIT_OK


def cmd_prune(args) -> int:
    from . import api

    removed = api.prune(args.older_than, files=args.files)
    _print_removed(removed)
    if not removed:
        print("no finished job is that old: nothing removed")
    return EXIT_OK


def _print_removed(removed: Dict[str, Optional[str]]) -> None:
    for job_id, kept in removed.items():
        print(f"removed {job_id}" + (f" ({kept})" if kept else ""))


def _open_out(path: str):
    """``path`` opened for writing without waiting: a FIFO nobody reads is refused (ENXIO)
    instead of blocking; once open, writes block as usual."""
    import errno
    import fcntl

    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ENXIO:
            raise OSError(e.errno, "a FIFO that nothing reads") from None
        raise
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "wb")


def cmd_schedules(args) -> int:
    from . import api

    listed = api.schedules()
    if args.json:
        _print_json(listed)
        return EXIT_OK
    if not listed:
        print(
            "no schedules registered (`dflash-batch submit JOB.yaml` with a `schedule` key registers one)"
        )
    for s in listed:
        if s.get("error"):
            print(f"{s['name']}  unreadable: {s['error']}")
            continue
        print(f"{s['name']}  {s['schedule']!r} (UTC)  last run {s['last_run'] or 'never'}  "
              f"next {s['next_run'] or 'not within 35 days'}  input {s['input']}  "
              f"output {s['output_dir'] or 'default'}")  # fmt: skip
        if s["overrides"]:
            given = ", ".join(f"{k}={v!r}" for k, v in s["overrides"].items())
            print(f"  registered with {given}")
    return EXIT_OK


def cmd_unschedule(args) -> int:
    from . import api

    path = api.remove_schedule(args.schedule)
    print(
        f"removed schedule {args.schedule!r} ({path}); running workers keep it until they restart"
    )
    return EXIT_OK


def cmd_drafters(args) -> int:
    from .engine.models import registry  # here, not at import: the engine imports MLX

    listed = registry.pairs()
    if args.json:
        _print_json(listed)
        return EXIT_OK
    print("--draft auto takes the drafter of the longest name below that the target's name starts "
          "with (case and org ignored):")  # fmt: skip
    head = ("TARGET NAME", "BLOCK", "GENERATION", "DRAFTER")
    rows = [(p["target"], _fmt(p["block_size"], "d"), p["generation"],
             p["drafter"] + (" (the embedded default pair)" if p["default"] else "")
             + (f"  [{p['note']}]" if p["note"] and not p["default"] else "")) for p in listed]  # fmt: skip
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(3)]
    auto = [r for r, p in zip(rows, listed) if p["auto"]]
    others = [r for r, p in zip(rows, listed) if not p["auto"]]
    for i, row in enumerate([head] + auto + ([("", "", "", "")] if others else []) + others):
        if others and i == len(auto) + 1:
            print("Also published (give one with --draft REPO):")
            continue
        print("  " + "  ".join(f"{c:<{w}}" for c, w in zip(row[:3], widths)) + "  " + row[3])
    print("BLOCK: the recommended verify block; -: read from the drafter's config when it loads. "
          "A local target folder may name its own drafter in dflash_drafter.json; any other drafter: "
          "--draft FOLDER|REPO.")  # fmt: skip
    return EXIT_OK


def _adapt_job(record, **options):
    """The worker's adapter: training/adapt.py, imported (with MLX) only when a job adapts."""
    from .training.adapt import adapt_job

    return adapt_job(record, log=logging.getLogger("dflash_batch.adapt").info, **options)


def cmd_adapt(args) -> int:
    from .runner import drafters
    from .runner.jobs import home_dir, load_job
    from .training.adapt import AdaptRefused, adapt_job

    record = load_job(home_dir(), args.job)
    log = lambda msg: print(f"adapt {record.id}: {msg}", file=sys.stderr, flush=True)  # noqa: E731
    try:
        with drafters.adapt_lock(record):
            entry = adapt_job(record, log=log, time_budget=args.time_budget, steps=args.steps,
                              min_rows=args.min_rows, min_gain=args.min_gain)  # fmt: skip
    except AdaptRefused as e:
        return _fail(str(e), EXIT_REFUSED)
    if args.json:
        _print_json(entry)
        return EXIT_OK
    scores = f"held-out acceptance {entry['held_out_before']:.3f} -> {entry['held_out_after']:.3f}"
    kept = (
        f"{entry['revision']} in force"
        if entry["outcome"] == "adopted"
        else f"{entry['outcome']}: the drafter in force stays"
    )
    print(
        f"{record.id}: {entry['rows']} rows, {entry['steps']} steps in {entry['train_s']:.0f} s; {scores}; {kept}"
    )
    return EXIT_OK


def cmd_serve(args) -> int:
    from .server.command import run

    return run(args)


def _train_drafter(argv: List[str]) -> int:
    try:
        from .training.cli import main as train_main
    except ImportError as e:
        missing = getattr(e, "name", "") or ""
        if missing.startswith("dflash_batch.training"):
            print("dflash-batch: error: drafter training is not available in this install "
                  f"(module {missing} is missing)", file=sys.stderr)  # fmt: skip
            return 2
        raise
    return train_main(argv) or 0


COMMANDS = {
    "adapt": cmd_adapt,
    "submit": cmd_submit,
    "run": cmd_run,
    "worker": cmd_worker,
    "status": cmd_status,
    "cancel": cmd_cancel,
    "retry": cmd_retry,
    "results": cmd_results,
    "schedules": cmd_schedules,
    "unschedule": cmd_unschedule,
    "drafters": cmd_drafters,
    "rm": cmd_rm,
    "prune": cmd_prune,
    "serve": cmd_serve,
}


if __name__ == "__main__":
    sys.exit(main())
