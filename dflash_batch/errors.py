"""Every error this package raises on purpose, under one base: ``except DflashBatchError``
catches them all. Each also keeps the built-in base its callers expect (``ValueError`` for bad
input, ``LookupError`` for a missing name, ``RuntimeError`` for a state that forbids the call).
Plain Python: the engine, the runner and the front ends all import it."""

from __future__ import annotations


class DflashBatchError(Exception):
    """The common base."""


# -- bad input: the message names the field, row or key ----------------------------------------
class BadValue(DflashBatchError, ValueError):
    """What is wrong with a value; the caller adds the key."""


class BadOption(DflashBatchError, ValueError):
    """A row's sampling option that cannot be used; the message names the field."""


class SpecError(DflashBatchError, ValueError):
    """A job spec that cannot be used; the message names the key (and the file)."""


class SettingError(SpecError):
    """An environment variable whose value cannot be used; the message names the variable."""


class InputError(DflashBatchError, ValueError):
    """The input as a whole cannot be used (no row-level fallback possible)."""


class RowError(DflashBatchError, ValueError):
    """One input row that cannot become a prompt; it becomes an error row."""


# -- generation -------------------------------------------------------------------------------
class GenerationError(DflashBatchError, ValueError):
    """A prompt the engine refuses (empty, too long, bad type). The runner turns it into an error row."""


class EmptyPromptError(GenerationError):
    pass


class Cancelled(GenerationError):
    """An interactive request whose client went away before it finished (dflash_batch/inbox.py)."""


class Requeued(DflashBatchError, RuntimeError):
    """Not a failure: a batch row gave its slot up to an interactive request and starts again
    (engine/batch.py: ``_preempt``); its pieces so far are void."""


class AdaptRefused(DflashBatchError):
    """A job that cannot be adapted: too few finished rows, no drafter to start from."""


class InboxFull(DflashBatchError, RuntimeError):
    """More interactive requests wait than the server's inbox holds (dflash_batch/inbox.py)."""


class PromptTooLongError(GenerationError):
    pass


class ModelMismatchError(DflashBatchError, ValueError):
    """A drafter that does not fit its target (hidden size, tap layers, vocabulary)."""


# -- jobs, queue and output dirs --------------------------------------------------------------
class JobNotFound(DflashBatchError, LookupError):
    pass


class AmbiguousJob(JobNotFound):
    """A job id prefix that starts several job ids; the message lists them."""


class JobActive(BadValue):
    """A job still queued or running, where only a finished one will do (a refusal)."""


class ScheduleNotFound(DflashBatchError, LookupError):
    pass


class Locked(DflashBatchError, RuntimeError):
    """Another live process holds the lock."""


class OutputDirClaimed(SpecError):
    """An output dir holding results of another config. The message names the Python keyword
    arguments that get past it; ``cli_message`` says the same with the command-line flags."""

    def __init__(self, message: str, cli_message: str):
        super().__init__(message)
        self.cli_message = cli_message

    def __reduce__(self):  # an exception with two arguments pickles both
        return type(self), (str(self), self.cli_message)


class ConfigChanged(DflashBatchError, RuntimeError):
    """The output dir was claimed by another config after this job was submitted."""


class LeaseLost(DflashBatchError, RuntimeError):
    """This worker's lease on a chunk expired (it hung, or lost the queue) and may be another's."""


class SetupError(SpecError):
    """A setup in which several workers could not run safely (a refusal, exit code 2)."""


class JobFailed(DflashBatchError, RuntimeError):
    """A foreground job stopped by a job-level error (say, a model that does not load); the job
    is marked failed, and the error is the ``__cause__``."""


class CliError(DflashBatchError):
    """A command-line refusal with its exit code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code
