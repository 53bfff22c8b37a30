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
from typing import Any, Dict, List, Optional, Union

import orjson

from .. import checks
from ..errors import SpecError
from ..request import CONTROLS, MAX_SAMPLES, Options, SamplingControls, resolve_options
from .items import Fields, _template_keys

MODEL_KEYS = ("target", "target_revision", "draft", "draft_revision", "dtype", "block_size", "max_context",
              "prefix_cache_mb")  # fmt: skip
SAMPLING_KEYS = ("max_tokens", "max_tokens_cap", "temperature", "seed", "stop", "n") + tuple(CONTROLS)
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


@dataclass
class JobSpec(SamplingControls):
    """A fully resolved job: what to read, which model, how to sample, where to write. The
    sampling controls (``request.SamplingControls``: top_k ... response_format, for rows without
    their own) are inherited fields, keys of the YAML ``sampling`` section."""

    input: Optional[str] = None
    name: Optional[str] = None
    input_format: str = "auto"  # auto | jsonl | openai | parquet
    id_field: Optional[str] = None  # None: "id", then "custom_id", then derived
    prompt_field: str = "prompt"
    messages_field: str = "messages"
    output_dir: Optional[str] = None  # default: {home}/results/{name}; may use {home} {name} {date} {time}
    system_prompt: Optional[str] = None
    prompt_template: Optional[str] = None  # string.Template over row fields: "Summarize:\n\n$text"
    chat_template: Optional[bool] = None  # None: use the tokenizer's template when it has one
    chat_template_kwargs: Dict[str, Any] = field(default_factory=dict)
    # model
    target: Optional[str] = None  # None: the embedded default pair
    target_revision: Optional[str] = None
    draft: Optional[str] = "auto"  # "auto": the registered drafter; None: plain autoregressive
    draft_revision: Optional[str] = None
    dtype: str = "auto"
    block_size: Optional[int] = None
    max_context: Optional[int] = None
    prefix_cache_mb: Optional[float] = None  # shared prompt prefixes kept (None: the engine's default; 0: off; not in the hash)
    # sampling
    max_tokens: int = 256  # for rows without their own max_tokens
    max_tokens_cap: Optional[int] = None  # no row generates more, whatever it asks for
    temperature: float = 0.0
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    n: int = 1  # samples per row (each its own result row, ``sample_index``), for rows without their own n
    # running
    chunk_size: int = 64
    batch_size: Optional[int] = None  # rows decoded together; None: what memory allows (not in the hash)
    # the share of rows decoded plainly in the drafting batch, as a check of what speculation saved
    # (``request.control_row`` picks them; docs/runner.md); their output is the same: not in the hash
    control: float = 0.0
    schedule: Optional[str] = None  # cron expression (UTC)
    catch_up: bool = True  # a run missed while no worker was up is submitted once at start-up
    retries: int = 0
    export_openai: bool = False  # also write _openai_output.jsonl when a job completes
    force: bool = False  # accept an output dir written with another config hash
    adapt: Optional[Dict[str, Any]] = None  # {after_rows, time_budget, steps, min_rows}: see ADAPT_KEYS

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
            name=name, home=home, date=time.strftime("%Y-%m-%d", stamp), time=time.strftime("%H%M%S", stamp)
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
        stem = checks.plain_name(path.stem) if len(path.stem.encode()) <= 100 else checks.slug(path.stem, 60)
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
    spec = JobSpec(**data)
    validate(spec, where)
    return spec


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
            raise SpecError(f"{where}: unknown key {key!r}{_suggest(key, TOP_KEYS + MODEL_KEYS + SAMPLING_KEYS)}")
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
def validate(spec: JobSpec, where: str = "spec") -> None:
    def bad(key, message):
        raise SpecError(f"{where}: {key!r} {message}")

    if spec.input is None:
        bad("input", "is required (a JSONL or Parquet file)")
    for key in ("input", "name", "id_field", "prompt_field", "messages_field", "output_dir", "system_prompt",
                "prompt_template", "target", "target_revision", "draft", "draft_revision", "dtype"):  # fmt: skip
        value = getattr(spec, key)
        if value is not None and not isinstance(value, str):
            bad(key, f"must be a string, got {type(value).__name__} {value!r}")
    for key in ("input", "output_dir", "target", "id_field", "prompt_field", "messages_field"):
        if getattr(spec, key) is not None and not getattr(spec, key).strip():  # "" would mean the current folder
            bad(key, "is empty")
    spec.input = str(Path(spec.input).expanduser().resolve())
    if spec.name is not None:
        try:
            checks.plain_name(spec.name)
        except checks.BadValue as e:
            bad("name", str(e))
    for key in ("target_revision", "draft_revision"):
        if getattr(spec, key) is not None:
            try:
                checks.revision(getattr(spec, key))
            except checks.BadValue as e:
                bad(key, str(e))
    for key, value in recorded_model(spec.model).items():
        setattr(spec, key, value)
    if spec.input_format not in ("auto", "jsonl", "openai", "parquet"):
        bad("input_format", f"must be auto, jsonl, openai or parquet, got {spec.input_format!r}")
    if spec.dtype not in ("auto", "float32", "bfloat16", "float16"):
        bad("dtype", f"must be auto, float32, bfloat16 or float16, got {spec.dtype!r}")
    for f in dataclasses.fields(spec):  # job records and hashes store integers in 64 bits
        value = getattr(spec, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > checks.MAX_SEED:
            bad(f.name, f"must be at most 2**64 - 1, got {checks.show(value)}")
    for key, low in (("max_tokens", 1), ("chunk_size", 1), ("retries", 0)):
        value = getattr(spec, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            bad(key, f"must be an integer >= {low}, got {checks.show(value)}")
    if spec.batch_size is not None:
        value = spec.batch_size
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad("batch_size", f"must be an integer >= 1 (or null: what memory allows), got {checks.show(value)}")
    value = spec.prefix_cache_mb
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf")):
        bad("prefix_cache_mb", f"must be a number >= 0 (0: no prefix sharing; null: the default), got {checks.show(value)}")
    _check_control(spec, bad)
    if isinstance(spec.n, bool) or not isinstance(spec.n, int) or not 1 <= spec.n <= MAX_SAMPLES:
        bad("n", f"must be an integer from 1 to {MAX_SAMPLES}, got {checks.show(spec.n)}")
    if spec.max_tokens_cap is not None:
        value = spec.max_tokens_cap
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            bad("max_tokens_cap", f"must be an integer >= 1 (or null: no cap), got {checks.show(value)}")
    for key in ("block_size", "max_context", "seed"):
        value = getattr(spec, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            bad(key, f"must be a non-negative integer, got {checks.show(value)}")
    if spec.seed is not None and spec.seed > checks.MAX_SEED:
        bad("seed", f"must be at most 2**64 - 1, got {spec.seed}")
    try:
        spec.temperature = checks.temperature(spec.temperature)
    except checks.BadValue as e:
        bad("temperature", str(e))
    for key, off in CONTROLS.items():
        if getattr(spec, key) is None:
            setattr(spec, key, off)
        else:
            try:
                setattr(spec, key, SamplingControls.check(key, getattr(spec, key)))
            except checks.BadValue as e:
                bad(key, str(e))
    if isinstance(spec.stop, str):
        spec.stop = [spec.stop]
    if spec.stop is None:
        spec.stop = []
    if not isinstance(spec.stop, list) or not all(isinstance(s, str) and s for s in spec.stop):
        bad("stop", f"must be a string or a list of non-empty strings, got {spec.stop!r}")
    if spec.chat_template not in (None, True, False):
        bad("chat_template", f"must be true, false or null (auto), got {spec.chat_template!r}")
    if spec.chat_template_kwargs is None:
        spec.chat_template_kwargs = {}
    if not isinstance(spec.chat_template_kwargs, dict):
        bad("chat_template_kwargs", f"must be a mapping, got {spec.chat_template_kwargs!r}")
    try:
        checks.nesting(spec.chat_template_kwargs)  # before a deep copy or the hash walks it
    except checks.BadValue as e:
        bad("chat_template_kwargs", str(e))
    for key in ("chat_template_kwargs", "response_format"):  # the job record holds them as JSON
        try:
            orjson.dumps(getattr(spec, key))
        except TypeError as e:
            bad(key, f"must hold only JSON values (mappings with string keys, lists, strings, "
                f"numbers, booleans, null): {e}")  # fmt: skip
    for key in ("export_openai", "force", "catch_up"):
        if not isinstance(getattr(spec, key), bool):
            bad(key, f"must be true or false, got {getattr(spec, key)!r}")
    if spec.prompt_template is not None:
        try:
            string.Template(spec.prompt_template).substitute({k: "" for k in _template_keys(spec.prompt_template)})
        except (ValueError, KeyError) as e:
            bad("prompt_template", f"is malformed ({e}); use $field or ${{field}}, and $$ for a dollar sign")
        if not _template_keys(spec.prompt_template):
            bad("prompt_template", "uses no $field: every row would get the same prompt")
    if spec.output_dir is not None:
        try:
            placeholders = [(f, s, c) for _, f, s, c in string.Formatter().parse(spec.output_dir) if f is not None]
        except ValueError:  # an unmatched brace
            placeholders = [(None, "", None)]
        if any(f not in OUTPUT_DIR_FIELDS or s or c for f, s, c in placeholders):
            bad("output_dir", "may use only the placeholders {home}, {name}, {date} and {time}, as they are "
                f"({{{{ and }}}} for literal braces), got {checks.show(spec.output_dir)}")  # fmt: skip
    _check_adapt(spec.adapt, bad)
    if spec.schedule is not None:
        try:
            cron_fields(spec.schedule)
        except ValueError as e:
            bad("schedule", str(e))


def _check_adapt(plan, bad) -> None:
    if plan is None:
        return
    if not isinstance(plan, dict) or "after_rows" not in plan:
        bad("adapt", f"must be a mapping with after_rows (and time_budget, steps, min_rows), got {checks.show(plan)}")
    for key, value in plan.items():
        if key not in ADAPT_KEYS:
            bad("adapt", f"has an unknown key {key!r}{_suggest(key, ADAPT_KEYS)}")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or value < ADAPT_KEYS[key] or (key != "time_budget" and not isinstance(value, int)):
            kind = "a number of seconds" if key == "time_budget" else "an integer"
            bad("adapt", f"{key} must be {kind} >= {ADAPT_KEYS[key]}, got {checks.show(value)}")


def _check_control(spec: JobSpec, bad) -> None:
    """``control``: a share of the rows from 0 to 1, and a drafter to decode the others with."""
    if spec.control is None:
        spec.control = 0.0
    try:
        share = checks.finite_number(spec.control)
    except checks.BadValue:
        share = -1.0
    if not 0 <= share <= 1:
        bad("control", "must be a number from 0 to 1 (the share of rows decoded plainly as a check of "
            f"what speculation saved, e.g. 0.1), got {checks.show(spec.control)}")
    if share > 0 and spec.draft is None:
        bad("control", "needs a drafter: with no draft every row is decoded plainly already")
    spec.control = share


def cron_fields(expression) -> Dict[str, str]:
    """``"0 2 * * *"`` -> crontab keyword arguments, checked with huey's strict parser."""
    from huey import crontab

    if not isinstance(expression, str):
        raise ValueError(f"must be a cron string like '0 2 * * *', got {expression!r}")
    text = CRON_ALIASES.get(expression.strip(), expression)
    parts = text.split()
    names = ("minute", "hour", "day", "month", "day_of_week")
    if len(parts) != 5:
        raise ValueError(f"{expression!r} is not a cron expression: need 5 fields (minute hour day month day_of_week), got {len(parts)}")
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
