"""Job specs: YAML files (or a bare input file) plus overrides, validated, with a config hash.

Precedence: keyword/CLI overrides > YAML > defaults; a row's own sampling settings win over all
three, and ``max_tokens_cap`` bounds every row (``request.resolve_options``). The YAML groups
model and sampling keys::

    name: summaries
    input: ../examples/prompts.jsonl     # relative paths are relative to the YAML file
    model: {target: ./models/t, draft: auto, target_revision: null, dtype: auto, block_size: null}
    sampling: {max_tokens: 256, temperature: 0.0, seed: 0, stop: ["\\n\\n"]}
    schedule: "0 2 * * *"                # cron, UTC
    catch_up: true                       # a missed run is submitted once when a worker starts

Everything else is a top-level key (see ``TOP_KEYS``). Unknown keys are errors.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import hashlib
import re
import string
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

import orjson

from .. import checks
from ..errors import SpecError
from ..request import CONTROLS, Options, SamplingControls, resolve_options, samples, stops
from .items import Fields, _template_keys

MODEL_KEYS = ("target", "target_revision", "draft", "draft_revision", "dtype", "block_size", "max_context",
              "prefix_cache_mb")  # fmt: skip
SAMPLING_KEYS = ("max_tokens", "max_tokens_cap", "temperature", "seed", "stop", "n") + tuple(
    CONTROLS
)
OUTPUT_DIR_FIELDS = ("home", "name", "date", "time")
# The name OpenAI-format output gives the embedded default target (engine/models/default_model.py).
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
TOP_KEYS = (
    "name", "input", "input_format", "id_field", "prompt_field", "messages_field", "output_dir",
    "system_prompt", "prompt_template", "chat_template", "chat_template_kwargs", "model", "sampling",
    "chunk_size", "batch_size", "schedule", "catch_up", "retries", "export_openai", "force", "adapt", "control",
)  # fmt: skip
# ``adapt:``: train the job's drafter on its own finished rows once ``after_rows`` are done
# (runner/drafters.py, training/adapt.py); changes the speed only, so it is not in the hash.
ADAPT_KEYS = {"after_rows": 1, "time_budget": 1, "steps": 0, "min_rows": 1}  # key -> least value
SPEC_FILE_BYTES = 4 * 2**20  # the most a YAML job spec may hold
# The most nodes a spec may hold with its aliases expanded: far above any real spec, far below
# what "billion laughs" (nested aliases, each repeating the one before) expands to.
YAML_EXPANDED_NODES = 100_000
CRON_ALIASES = {"@hourly": "0 * * * *", "@daily": "0 0 * * *", "@midnight": "0 0 * * *",
                "@weekly": "0 0 * * 0", "@monthly": "0 0 1 * *"}  # fmt: skip


# -- each field's check ----------------------------------------------------------------------
# A check takes a field's value and returns it as the job keeps it, or raises ``checks.BadValue``
# with a message that does not name the key (``validate`` names it).


def _string(value):
    if value is not None and not isinstance(value, str):
        raise checks.BadValue(f"must be a string, got {type(value).__name__} {value!r}")
    return value


def _filled(value):
    """A string, not empty: "" would mean the current folder."""
    if _string(value) is not None and not value.strip():
        raise checks.BadValue("is empty")
    return value


def _input(value):
    return str(Path(_filled(value)).expanduser().resolve())


def _name(value):
    return checks.plain_name(value) if _string(value) is not None else None


def _revision(value):
    return checks.revision(value) if _string(value) is not None else None


def _one_of(*choices: str):
    def check(value):
        if value not in choices:
            raise checks.BadValue(
                f"must be {', '.join(choices[:-1])} or {choices[-1]}, got {value!r}"
            )
        return value

    return check


def _dtype(value):
    return _one_of("auto", "float32", "bfloat16", "float16")(_string(value))


def _integer(low: int, null: Optional[str] = None):
    """An integer >= ``low``; None too where ``null`` says what it means."""

    def check(value):
        if value is None and null is not None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            says = f" (or null: {null})" if null is not None else ""
            raise checks.BadValue(f"must be an integer >= {low}{says}, got {checks.show(value)}")
        return value

    return check


def _count(value):
    """None, or an integer >= 0."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise checks.BadValue(f"must be a non-negative integer, got {checks.show(value)}")
    return value


def _megabytes(value):
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value < float("inf")
    ):
        raise checks.BadValue(
            f"must be a number >= 0 (0: no prefix sharing; null: the default), got {checks.show(value)}"
        )
    return value


def _stop(value):
    return [] if value is None else stops(value)


def _flag(value):
    if not isinstance(value, bool):
        raise checks.BadValue(f"must be true or false, got {value!r}")
    return value


def _chat_template(value):
    if value not in (None, True, False):
        raise checks.BadValue(f"must be true, false or null (auto), got {value!r}")
    return value


def _json(value):
    """Values the job record can hold as JSON."""
    try:
        orjson.dumps(value)
    except TypeError as e:
        raise checks.BadValue(f"must hold only JSON values (mappings with string keys, lists, strings, "
                              f"numbers, booleans, null): {e}") from None  # fmt: skip
    return value


def _template_kwargs(value):
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise checks.BadValue(f"must be a mapping, got {value!r}")
    checks.nesting(value)  # before a deep copy or the hash walks it
    return _json(value)


def _prompt_template(value):
    if _string(value) is None:
        return None
    try:
        string.Template(value).substitute({k: "" for k in _template_keys(value)})
    except (ValueError, KeyError) as e:
        raise checks.BadValue(
            f"is malformed ({e}); use $field or ${{field}}, and $$ for a dollar sign"
        ) from None
    if not _template_keys(value):
        raise checks.BadValue("uses no $field: every row would get the same prompt")
    return value


def _output_dir(value):
    if _filled(value) is None:
        return None
    try:
        placeholders = [
            (f, s, c) for _, f, s, c in string.Formatter().parse(value) if f is not None
        ]
    except ValueError:  # an unmatched brace
        placeholders = [(None, "", None)]
    if any(f not in OUTPUT_DIR_FIELDS or s or c for f, s, c in placeholders):
        raise checks.BadValue("may use only the placeholders {home}, {name}, {date} and {time}, as they are "
                              f"({{{{ and }}}} for literal braces), got {checks.show(value)}")  # fmt: skip
    return value


def _schedule(value):
    if value is not None:
        try:
            cron_fields(value)
        except ValueError as e:
            raise checks.BadValue(str(e)) from None
    return value


def _control(name: str):
    """A sampling control of the job: None is the control's off value."""
    off = CONTROLS[name]

    def check(value):
        value = off if value is None else SamplingControls.check(name, value)
        return _json(value) if name == "response_format" else value

    return check


def _share(value):
    """``control``: a share of the rows from 0 to 1."""
    try:
        share = 0.0 if value is None else checks.finite_number(value)
    except checks.BadValue:
        share = -1.0
    if not 0 <= share <= 1:
        raise checks.BadValue(
            "must be a number from 0 to 1 (the share of rows decoded plainly as a check of "
            f"what speculation saved, e.g. 0.1), got {checks.show(value)}"
        )
    return share


def _adapt(plan):
    """``adapt:``: a mapping with ``after_rows`` and optionally the other ``ADAPT_KEYS``."""
    if plan is None:
        return None
    if not isinstance(plan, dict) or "after_rows" not in plan:
        raise checks.BadValue(f"must be a mapping with after_rows (and time_budget, steps, min_rows), "
                              f"got {checks.show(plan)}")  # fmt: skip
    for key, value in plan.items():
        if key not in ADAPT_KEYS:
            raise checks.BadValue(f"has an unknown key {key!r}{_suggest(key, ADAPT_KEYS)}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (
            not number
            or value < ADAPT_KEYS[key]
            or (key != "time_budget" and not isinstance(value, int))
        ):
            kind = "a number of seconds" if key == "time_budget" else "an integer"
            raise checks.BadValue(
                f"{key} must be {kind} >= {ADAPT_KEYS[key]}, got {checks.show(value)}"
            )
    return plan


def _option(default, check: Callable[[Any], Any]):
    """A field with its default and its check, side by side."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"check": check})
    return field(default=default, metadata={"check": check})


@dataclass
class JobSpec(SamplingControls):
    """A fully resolved job: what to read, which model, how to sample, where to write. The
    sampling controls (``request.SamplingControls``: top_k ... response_format, for rows without
    their own) are inherited fields, keys of the YAML ``sampling`` section. Each field is written
    with its default and its check (``validate``)."""

    input: Optional[str] = _option(None, _input)  # required: a JSONL or Parquet file
    name: Optional[str] = _option(None, _name)
    input_format: str = _option("auto", _one_of("auto", "jsonl", "openai", "parquet"))
    id_field: Optional[str] = _option(None, _filled)  # None: "id", then "custom_id", then derived
    prompt_field: str = _option("prompt", _filled)
    messages_field: str = _option("messages", _filled)
    # default: {home}/results/{name}; may use {home} {name} {date} {time}
    output_dir: Optional[str] = _option(None, _output_dir)
    system_prompt: Optional[str] = _option(None, _string)
    # string.Template over row fields: "Summarize:\n\n$text"
    prompt_template: Optional[str] = _option(None, _prompt_template)
    # None: the tokenizer's, if it has one
    chat_template: Optional[bool] = _option(None, _chat_template)
    chat_template_kwargs: Dict[str, Any] = _option({}, _template_kwargs)
    # model
    target: Optional[str] = _option(None, _filled)  # None: the embedded default pair
    target_revision: Optional[str] = _option(None, _revision)
    # "auto": the registered drafter; None: plain AR
    draft: Optional[str] = _option("auto", _string)
    draft_revision: Optional[str] = _option(None, _revision)
    dtype: str = _option("auto", _dtype)
    block_size: Optional[int] = _option(None, _count)
    max_context: Optional[int] = _option(None, _count)
    # shared prompt prefixes kept (None: the engine's default; 0: off; not in the hash)
    prefix_cache_mb: Optional[float] = _option(None, _megabytes)
    # sampling
    max_tokens: int = _option(256, _integer(1))  # for rows without their own max_tokens
    # no row generates more, whatever it asks for
    max_tokens_cap: Optional[int] = _option(None, _integer(1, "no cap"))
    temperature: float = _option(0.0, checks.temperature)
    seed: Optional[int] = _option(None, _count)
    stop: List[str] = _option([], _stop)
    # samples per row (each its own result row, ``sample_index``), for rows without their own n
    n: int = _option(1, samples)
    # running
    chunk_size: int = _option(64, _integer(1))
    # rows decoded together; None: what memory allows (not in the hash)
    batch_size: Optional[int] = _option(None, _integer(1, "what memory allows"))
    # the share of rows decoded plainly in the drafting batch, as a check of what speculation saved
    # (``request.control_row`` picks them; docs/runner.md); their output is the same: not in the hash
    control: float = _option(0.0, _share)
    schedule: Optional[str] = _option(None, _schedule)  # cron expression (UTC)
    # a run missed while no worker was up: submitted at start-up
    catch_up: bool = _option(True, _flag)
    retries: int = _option(0, _integer(0))
    # also write _openai_output.jsonl as a job completes
    export_openai: bool = _option(False, _flag)
    force: bool = _option(False, _flag)  # accept an output dir written with another config hash
    # {after_rows, time_budget, steps, min_rows}: ADAPT_KEYS
    adapt: Optional[Dict[str, Any]] = _option(None, _adapt)

    # -- derived ---------------------------------------------------------------------------
    @property
    def fields(self) -> Fields:
        return Fields(self.id_field, self.prompt_field, self.messages_field, self.prompt_template)

    @property
    def model(self) -> Dict[str, Any]:
        """Keyword arguments for ``load_engine``."""
        return {k: getattr(self, k) for k in MODEL_KEYS}

    @property
    def sampling(self) -> Dict[str, Any]:
        return {k: getattr(self, k) for k in SAMPLING_KEYS}

    @property
    def model_name(self) -> str:
        """The target as a name (OpenAI ``model``): a hub id as given, a local folder or file by
        its own name, the embedded default pair by its model's name."""
        if self.target is None:
            return DEFAULT_TARGET_NAME
        if Path(self.target).is_absolute():
            return Path(self.target).name
        return self.target

    def options(self, row: Dict[str, Any]) -> Options:
        """One row's options by the one rule (``request.resolve_options``): a row's own
        ``max_tokens``, ``temperature``, ``stop`` and ``system`` win over the job's (the flag,
        else the YAML, else the default); ``max_tokens_cap`` bounds ``max_tokens``."""
        return resolve_options(self, row)

    def generation_options(self, row: Dict[str, Any]) -> Dict[str, Any]:
        """``options(row)`` as ``Engine.request`` keyword arguments."""
        return self.options(row).as_kwargs()

    def config_hash(self) -> str:
        """Hash of everything that changes what is generated for a row: model, sampling, prompt
        building. Resuming into an output dir written under another hash is refused."""
        model = dict(self.model)
        del model["prefix_cache_mb"]  # where prefixes are prefilled changes no output
        for key in ("target", "draft"):
            if model[key] not in (None, "auto") and Path(model[key]).expanduser().exists():
                model[key] = str(Path(model[key]).expanduser().resolve())
        sampling = self.sampling
        if sampling["max_tokens_cap"] is None:  # hashes from before the cap existed stay valid
            del sampling["max_tokens_cap"]
        if sampling["n"] == 1:  # and from before n existed
            del sampling["n"]
        for key, off in CONTROLS.items():  # and from before the sampling controls
            if sampling[key] == off:
                del sampling[key]
        payload = {
            "model": model,
            "sampling": sampling,
            "prompt": {
                "system_prompt": self.system_prompt,
                "prompt_template": self.prompt_template,
                "chat_template": self.chat_template,
                "chat_template_kwargs": self.chat_template_kwargs,
            },
        }
        return hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def resolved_output_dir(self, home: Path, now: Optional[float] = None) -> Path:
        """``output_dir`` with its placeholders filled; by default ``home/results/<name>``, which
        must stay inside ``home/results`` (a symlink there to elsewhere is refused)."""
        name = self.name or default_name(self.input)
        if self.output_dir is None:
            try:
                return checks.path_under(Path(home) / "results", name).resolve()
            except checks.BadValue as e:
                raise SpecError(f"job {name!r}: {e}; set output_dir to write elsewhere") from None
        stamp = time.gmtime(now if now is not None else time.time())
        text = self.output_dir.format(
            name=name,
            home=home,
            date=time.strftime("%Y-%m-%d", stamp),
            time=time.strftime("%H%M%S", stamp),
        )
        return Path(text).expanduser().resolve()

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "JobSpec":
        return cls(**data)


def recorded_model(model: Dict[str, Any]) -> Dict[str, Any]:
    """Model keys as jobs record them (and the worker keys its resident engine): a draft of
    none/off/'' is None (plain autoregressive decoding), a local model folder or file is an
    absolute path. The worker's --target/--draft go through here too, so the same model named
    the same way loads once."""
    out = dict(model)
    if isinstance(out.get("draft"), str) and out["draft"].lower() in ("none", "off", ""):
        out["draft"] = None
    for key in ("target", "draft"):
        value = out.get(key)
        if isinstance(value, str) and value != "auto" and Path(value).expanduser().exists():
            out[key] = str(Path(value).expanduser().resolve())
    return out


def default_name(input_path: Optional[str]) -> str:
    """``<input file stem>-<8 hex of its path>``, a plain name (an odd stem is slugged)."""
    if not input_path:
        return "job"
    path = Path(input_path).expanduser().resolve()
    try:
        stem = (
            checks.plain_name(path.stem)
            if len(path.stem.encode()) <= 100
            else checks.slug(path.stem, 60)
        )
    except checks.BadValue:
        stem = checks.slug(path.stem, 60)
    return f"{stem or 'input'}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


# -- loading ---------------------------------------------------------------------------------
def load_spec(source: Union[str, Path, Dict[str, Any], None] = None, **overrides) -> JobSpec:
    """A validated ``JobSpec`` from a YAML file, an input file (JSONL/Parquet), or a dict in the
    YAML layout; ``overrides`` are flat field names (``max_tokens=``, ``target=``...) and win.
    An override of None means "not given"."""
    data: Dict[str, Any] = {}
    where = "overrides"
    if isinstance(source, dict):
        data = _flatten(source, "spec")
    elif source is not None:
        path = Path(source).expanduser()
        if path.suffix.lower() in (".yaml", ".yml"):
            data = _read_yaml(path)
            where = str(path)
        else:
            data = {"input": str(path)}
    known = {f.name for f in dataclasses.fields(JobSpec)}
    for key, value in overrides.items():
        if key not in known:
            raise SpecError(f"unknown option {key!r}{_suggest(key, known)}")
        if value is not None:
            data[key] = value
    return validate(JobSpec(**data), where)


def _read_yaml(path: Path) -> Dict[str, Any]:
    import yaml

    try:
        text = checks.small_file_text(path, SPEC_FILE_BYTES)
    except checks.BadValue as e:
        raise SpecError(str(e)) from None
    try:
        raw = safe_yaml(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: invalid YAML: {e}") from e
    except RecursionError:  # PyYAML builds nested values recursively
        raise SpecError(f"{path}: invalid YAML: nests too deeply to read") from None
    if not isinstance(raw, dict):
        raise SpecError(f"{path}: a job spec must be a YAML mapping, got {type(raw).__name__}")
    data = _flatten(raw, str(path))
    # Relative file paths are relative to the YAML file, so a spec works from any directory.
    base = path.resolve().parent
    for key in ("input", "output_dir", "target", "draft"):
        value = data.get(key)
        if not isinstance(value, str) or value == "auto":
            continue
        local = Path(value).expanduser()
        if local.is_absolute() or value.startswith("{home}"):
            continue
        # A model may be a hub repo id ("org/name"): only paths that look local or exist move.
        if key in ("input", "output_dir") or value.startswith(".") or (base / local).exists():
            data[key] = str(base / local)
    return data


def safe_yaml(text: str):
    """``yaml.safe_load``, refusing a document whose aliases expand past ``YAML_EXPANDED_NODES``
    nodes or refer to themselves: either would make a spec that copying or hashing never ends."""
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_size(node, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _expanded_size(node, sizes: Dict[int, int], open_nodes: set) -> int:
    """How many nodes ``node`` stands for with every alias written out (memoized per node)."""
    import yaml

    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        line = node.start_mark.line + 1
        raise yaml.YAMLError(f"an alias on line {line} refers to the value that holds it")
    open_nodes.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, open_nodes)
        if size > YAML_EXPANDED_NODES:
            raise yaml.YAMLError(
                f"more than {YAML_EXPANDED_NODES} values with its aliases expanded (line "
                f"{node.start_mark.line + 1}); write the values out or use fewer aliases"
            )
    open_nodes.discard(key)
    sizes[key] = size
    return size


def _flatten(raw: Dict[str, Any], where: str) -> Dict[str, Any]:
    data: Dict[str, Any] = {}
    for key, value in raw.items():
        if key not in TOP_KEYS:
            raise SpecError(
                f"{where}: unknown key {key!r}{_suggest(key, TOP_KEYS + MODEL_KEYS + SAMPLING_KEYS)}"
            )
        if key == "model":
            if isinstance(value, str):
                value = {"target": value}
            _section(value, "model", MODEL_KEYS, where, data)
        elif key == "sampling":
            _section(value, "sampling", SAMPLING_KEYS, where, data)
        else:
            data[key] = value
    return data


def _section(value, name: str, keys, where: str, data: Dict[str, Any]) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise SpecError(f"{where}: {name!r} must be a mapping with keys {', '.join(keys)}")
    for key, item in value.items():
        if key not in keys:
            raise SpecError(f"{where}: unknown key '{name}.{key}'{_suggest(key, keys)}")
        data[key] = item


def _suggest(key, choices) -> str:
    close = difflib.get_close_matches(str(key), list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(choices)})"


# -- validation ------------------------------------------------------------------------------
def validate(spec: JobSpec, where: str = "spec") -> JobSpec:
    """``spec`` checked, field by field (each field's check, written beside it), as the job
    keeps it: a copy with paths resolved, the model named as jobs record it (``recorded_model``),
    ``stop`` a list, controls of None off. ``spec`` itself is not changed. Raises ``SpecError``
    naming the first bad key."""
    if spec.input is None:
        raise SpecError(f"{where}: 'input' is required (a JSONL or Parquet file)")
    fields = dataclasses.fields(spec)
    for f in fields:  # job records and hashes store integers in 64 bits
        value = getattr(spec, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > checks.MAX_SEED:
            raise SpecError(
                f"{where}: {f.name!r} must be at most 2**64 - 1, got {checks.show(value)}"
            )
    checked = {}
    for f in fields:
        try:
            checked[f.name] = _CHECKS[f.name](getattr(spec, f.name))
        except checks.BadValue as e:
            raise SpecError(f"{where}: {f.name!r} {e}") from None
    checked.update(recorded_model({key: checked[key] for key in MODEL_KEYS}))
    if checked["control"] > 0 and checked["draft"] is None:
        raise SpecError(
            f"{where}: 'control' needs a drafter: with no draft every row is decoded plainly already"
        )
    return dataclasses.replace(spec, **checked)


_CHECKS: Dict[str, Callable[[Any], Any]] = {
    **{f.name: f.metadata["check"] for f in dataclasses.fields(JobSpec)},
    **{name: _control(name) for name in CONTROLS},
}


def cron_fields(expression) -> Dict[str, str]:
    """``"0 2 * * *"`` -> crontab keyword arguments, checked with huey's strict parser."""
    from huey import crontab

    if not isinstance(expression, str):
        raise ValueError(f"must be a cron string like '0 2 * * *', got {expression!r}")
    text = CRON_ALIASES.get(expression.strip(), expression)
    parts = text.split()
    names = ("minute", "hour", "day", "month", "day_of_week")
    if len(parts) != 5:
        raise ValueError(
            f"{expression!r} is not a cron expression: need 5 fields (minute hour day month day_of_week), got {len(parts)}"
        )
    kwargs = dict(zip(names, parts))
    for name, value in kwargs.items():
        try:
            _check_cron_pieces(value)
            crontab(strict=True, **{name: value})
        except ValueError as e:
            raise ValueError(f"{expression!r}: bad {name} field {value!r} ({e})") from None
    if not _day_exists(kwargs["day"], kwargs["month"]):
        day, month = kwargs["day"], kwargs["month"]
        raise ValueError(f"{expression!r}: day {day!r} never occurs in month {month!r}")
    return kwargs


_CRON_PIECE = re.compile(r"(\*|\d+)(?:-(\d+))?(?:/(\d+))?")


def _check_cron_pieces(value: str) -> None:
    """What cron(8) refuses and huey's parser lets through or words obscurely: a reversed range
    (huey wraps it around), a step of 0."""
    for piece in value.split(","):
        if not piece:
            raise ValueError("has an empty list item")
        match = _CRON_PIECE.fullmatch(piece)
        if match is None:
            continue  # huey's strict parser words the refusal
        low, high, step = match.groups()
        if high is not None and low != "*" and int(low) > int(high):
            raise ValueError(f"range {piece!r} is reversed: write the low end first")
        if step is not None and int(step) == 0:
            raise ValueError(f"step {piece!r} is 0: a step must be at least 1")


def _day_exists(day: str, month: str) -> bool:
    """Whether a day of month the schedule names occurs in a month it names (``31 2`` never
    does). Huey fires only where the day of week matches too, and any date that exists falls on
    each weekday in some year."""
    from huey import crontab

    due = crontab(day=day, month=month)
    start = datetime.datetime(2024, 1, 1)  # a leap year: 29 February counts
    return any(due(start + datetime.timedelta(days=d)) for d in range(366))
