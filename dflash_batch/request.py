"""One prompt on its way from an input row to a result row, and what the runner needs of an engine.

Plain data, no MLX: the runner builds ``Request``s, the engine (or a fake in the tests) turns
them into ``Completion``s.

The options of a request are settled here, by one rule, in one place:

* a row's own ``max_tokens``, ``temperature``, ``stop``, ``system``, ``n`` and sampling controls
  (``SamplingControls``: top-k/p, min-p, penalties, logprobs, ``response_format``, each with its
  default and its check) are checked as the row is read (``row_options``, ``control``; a bad one
  makes the row an error row naming the field);
* they win over the job's values (the flag, else the YAML, else the default: the job spec, whose
  values ``runner.spec.validate`` checks with the same checks), and ``max_tokens_cap``
  bounds ``max_tokens`` whoever set it (``resolve_options``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import (
    Any,
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    Optional,
    Protocol,
    Tuple,
    Union,
    runtime_checkable,
)

from . import checks, constraints
from .completion import Completion
from .errors import BadOption

Prompt = Union[str, List[Dict[str, str]]]
MAX_SAMPLES = 1024  # n: samples per prompt, at most
MAX_TOP_LOGPROBS = 20  # as OpenAI


def _integer(top: Optional[int] = None) -> Callable[[Any], int]:
    """An integer >= 0 (and <= ``top``)."""

    def check(value):
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < 0
            or (top is not None and value > top)
        ):
            says = f"from 0 to {top}" if top is not None else ">= 0"
            raise checks.BadValue(f"must be an integer {says}, got {checks.show(value)}")
        return value

    return check


def _number(ok: Callable[[float], bool], says: str) -> Callable[[Any], float]:
    """A finite number for which ``ok`` holds (``says`` how, for the message)."""

    def check(value):
        number = checks.finite_number(value)
        if not ok(number):
            raise checks.BadValue(f"must be a number {says}, got {checks.show(value)}")
        return number

    return check


def _boolean(value) -> bool:
    if not isinstance(value, bool):
        raise checks.BadValue(f"must be true or false, got {checks.show(value)}")
    return value


def _response_format(value):
    constraints.grammar(value)  # compiles it: a bad schema is refused here, before any generation
    return value


def _control(default, check: Callable[[Any], Any]):
    return field(default=default, metadata={"check": check})


def samples(value) -> int:
    """``n``, samples of a prompt: an integer from 1 to ``MAX_SAMPLES`` (a row's and a job's)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SAMPLES:
        raise checks.BadValue(
            f"must be an integer from 1 to {MAX_SAMPLES}, got {checks.show(value)}"
        )
    return value


def stops(value) -> List[str]:
    """``stop``: a string or a list of non-empty strings, as a list (a row's and a job's)."""
    listed = [value] if isinstance(value, str) else value
    if not isinstance(listed, list) or not all(isinstance(s, str) and s for s in listed):
        raise checks.BadValue(f"must be a string or a list of non-empty strings, got {value!r}")
    return listed


@dataclass
class SamplingControls:
    """The sampling controls (docs/sampling.md): each one's name, its default (off) and its check,
    written once. A row's own win over the job's; ``Options`` and ``runner.spec.JobSpec`` carry
    them as fields of their own (they inherit this class) and the engine builds its request from
    them (``Engine.request``). No MLX here."""

    top_k: int = _control(0, _integer())  # 0: off
    top_p: float = _control(1.0, _number(lambda x: 0 < x <= 1, "in (0, 1]"))
    min_p: float = _control(0.0, _number(lambda x: 0 <= x < 1, "in [0, 1)"))
    repetition_penalty: float = _control(1.0, _number(lambda x: x > 0, "> 0"))
    # OpenAI's range
    presence_penalty: float = _control(0.0, _number(lambda x: -2 <= x <= 2, "in [-2, 2]"))
    frequency_penalty: float = _control(0.0, _number(lambda x: -2 <= x <= 2, "in [-2, 2]"))
    logprobs: bool = _control(False, _boolean)
    top_logprobs: int = _control(0, _integer(MAX_TOP_LOGPROBS))
    # constraints.grammar's input
    response_format: Optional[Dict[str, Any]] = _control(None, _response_format)

    @staticmethod
    def defaults() -> Dict[str, Any]:
        """Each control's name and default, in order."""
        return {f.name: f.default for f in dataclasses.fields(SamplingControls)}

    @staticmethod
    def check(name: str, value: Any) -> Any:
        """A control's value, checked (raises ``checks.BadValue`` without naming the key)."""
        return _CHECKS[name](value)

    def controls(self) -> "SamplingControls":
        """The controls alone (of an ``Options`` or a ``JobSpec``)."""
        return SamplingControls(**{name: getattr(self, name) for name in CONTROLS})

    def set_controls(self) -> Dict[str, Any]:
        """The controls set away from their default."""
        return {
            name: getattr(self, name)
            for name, off in CONTROLS.items()
            if getattr(self, name) != off
        }


_CHECKS = {f.name: f.metadata["check"] for f in dataclasses.fields(SamplingControls)}
CONTROLS: Dict[str, Any] = SamplingControls.defaults()  # name -> default ("off")
ROW_OPTIONS = ("max_tokens", "temperature", "stop", "system", "n") + tuple(CONTROLS)


@dataclass
class Options(SamplingControls):
    """How one request is generated: the ``Engine.request`` keyword arguments (the sampling
    controls are inherited)."""

    max_tokens: int = 256
    temperature: float = 0.0
    stop: Optional[List[str]] = None
    seed: Optional[int] = None
    system: Optional[str] = None
    chat_template: Optional[bool] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    n: int = 1  # samples of the prompt, each its own result row (``sample_seed`` seeds them)

    def as_kwargs(self) -> Dict[str, Any]:
        out = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stop": self.stop,
            "seed": self.seed,
            "system": self.system,
            "chat_template": self.chat_template,
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        # controls only where set, so an engine without them (a fake in the tests) still works
        out.update(self.set_controls())
        return out


@dataclass
class Request:
    """One prompt (text or chat messages) with its resolved options and the row's metadata."""

    id: str
    prompt: Prompt
    options: Options = field(default_factory=Options)
    metadata: Dict[str, Any] = field(default_factory=dict)
    index: int = 0  # the row's 0-based position in the input
    where: str = ""  # "line 7" / "row 7": how messages name the row
    sample_index: int = 0  # which of the row's n samples (the runner gives each its own request)
    # decode it plainly in the batch (no draft verified), as a check (docs/runner.md)
    control: bool = False


# What a completion engine yields per request: its completion, or why it has none (a
# GenerationError for a prompt the engine refuses; another exception for a failure of that one
# request).
Outcome = Union[Completion, Exception]


@runtime_checkable
class CompletionEngine(Protocol):
    """The engine as the runner sees it.

    ``generate_requests`` takes requests (any iterable) and yields ``(request, outcome)`` once per
    request, as each finishes: not in input order. A request that cannot be generated (empty,
    too long...) is yielded with its exception and the others go on; an exception raised by the
    call itself ends the whole call (the runner fails the job, finished rows stay).
    ``batch_size``: most requests decoded together; None: what memory allows.
    """

    def generate_requests(
        self, requests: Iterable[Request], batch_size: Optional[int] = None
    ) -> Iterator[Tuple[Request, Outcome]]: ...


def sample_seed(seed: Optional[int], sample_index: int, item: str = "") -> Optional[int]:
    """The seed of sample ``sample_index`` of a prompt seeded ``seed`` (the runner also names the
    item): sample 0 keeps ``seed``; sample k > 0 takes 64 bits of a hash of (seed, item, k), so
    every sample is reproducible from the three and samples do not share noise. None stays None."""
    if seed is None or sample_index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{item}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def control_row(share: float, item: str, sample_index: int = 0) -> bool:
    """Whether a job's row (item, sample) is one of its control rows, decoded plainly (``--control
    share``): 64 bits of a hash of the two, read as a fraction, below ``share``. About that share
    of the rows, drawn at random but the same on every run, worker and chunking."""
    if share <= 0:
        return False
    digest = hashlib.blake2b(f"control/{item}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < share


def control(name: str, value: Any) -> Any:
    """A sampling control's value, checked (raises ``checks.BadValue`` without naming the key):
    top_k an integer >= 0 (0: off), top_p in (0, 1], min_p in [0, 1), repetition_penalty > 0,
    presence / frequency penalty in [-2, 2] (OpenAI's range), logprobs a boolean, top_logprobs
    0..20, response_format as ``constraints.grammar`` accepts it (``SamplingControls``)."""
    return SamplingControls.check(name, value)


def row_options(row: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """A row's own sampling options (``ROW_OPTIONS``), checked; raises ``BadOption``."""
    out: Dict[str, Any] = {}
    value = row.get("max_tokens")
    if value is not None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadOption(f"'{prefix}max_tokens' must be a positive integer, got {value!r}")
        out["max_tokens"] = value
    value = row.get("temperature")
    if value is not None:
        try:
            out["temperature"] = checks.temperature(value)
        except checks.BadValue as e:
            raise BadOption(f"'{prefix}temperature' {e}") from None
    value = row.get("stop")
    if value is not None:
        try:
            out["stop"] = stops(value)
        except checks.BadValue as e:
            raise BadOption(f"'{prefix}stop' {e}") from None
    value = row.get("system")
    if value is not None:
        if not isinstance(value, str):
            raise BadOption(f"'{prefix}system' must be a string, got {checks.json_type(value)}")
        out["system"] = value
    value = row.get("n")
    if value is not None:
        try:
            out["n"] = samples(value)
        except checks.BadValue as e:
            raise BadOption(f"'{prefix}n' {e}") from None
    for name in CONTROLS:
        if row.get(name) is not None:
            try:
                out[name] = control(name, row[name])
            except checks.BadValue as e:
                raise BadOption(f"'{prefix}{name}' {e}") from None
    return out


def resolve_options(job: Any, row: Dict[str, Any]) -> Options:
    """The options of one row: its own (from ``row_options``) win over the job's (a ``JobSpec``:
    the flag, else the YAML, else the default); ``max_tokens_cap`` bounds ``max_tokens``."""
    max_tokens = row.get("max_tokens", job.max_tokens)
    if job.max_tokens_cap is not None:
        max_tokens = min(max_tokens, job.max_tokens_cap)
    return Options(
        max_tokens=max_tokens,
        temperature=row.get("temperature", job.temperature),
        stop=row.get("stop", job.stop) or None,
        seed=job.seed,
        system=row.get("system", job.system_prompt),
        # False on an OpenAI /v1/completions line: its prompt is raw text (runner/items.py)
        chat_template=row.get("chat_template", job.chat_template),
        chat_template_kwargs=job.chat_template_kwargs or None,
        n=row.get("n", getattr(job, "n", 1)),
        **{k: row.get(k, getattr(job, k, off)) for k, off in CONTROLS.items()},
    )
