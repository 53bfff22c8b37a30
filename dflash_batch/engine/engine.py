"""``Engine``: a resident target (+ optional DFlash drafter) that turns prompts into completions."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from .. import checks, constraints
from ..completion import (
    Completion,
    EmptyPromptError,
    GenerationError,
    GenerationStats,
    ModelMismatchError,
    Piece,
    PromptTooLongError,
)
from ..errors import Cancelled, Requeued
from ..inbox import Ticket
from ..request import CONTROLS, Request, SamplingControls, sample_seed
from . import cost_tables, decode, finish, memory, prefill, tree, warmup
from .batch import BatchDecoder, EncodedRequest
from .config import EngineConfig
from .models import loading, registry
from .models.target import Target
from .ops import activations, attention, compiled, device, matmul, switch
from .ops.kernels import cpu
from .waiting import Waiting
from .widths import (
    COMPILE_PRIOR,
    CompileCost,
    CostModel,
    DraftingProbes,
    NodeCalibration,
    PlainProbes,
    WidthPolicy,
    pooled_acceptance,
)

Prompt = Union[str, List[Dict[str, Any]], List[int]]
NO_LENGTH_LIMIT = int(1e30)  # what transformers itself sets for a tokenizer without a limit
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class Engine:
    """Generate with DFlash speculative decoding, or plain AR decoding when there is no drafter."""

    def __init__(
        self,
        model,
        tokenizer,
        drafter=None,
        *,
        config: Optional[dict] = None,
        description: Optional[dict] = None,
        settings: Optional[EngineConfig] = None,
        **options,
    ):
        """``config``: the target's model config; ``settings``, or its fields as ``options``:
        the engine's settings (``EngineConfig``)."""
        if settings is not None and options:
            raise TypeError(f"give settings or its fields, not both: {sorted(options)}")
        settings = EngineConfig(**options) if settings is None else settings
        self.settings = settings
        self.tokenizer = tokenizer
        _lift_length_limit(tokenizer)
        self.drafter = drafter
        self.loaded_drafter = drafter  # the one ``use_drafter(None)`` goes back to
        self.drafter_revision: Optional[str] = None  # a job's adapted drafter in use (use_drafter)
        self.target = Target(model)
        # The one process-wide act: mlx-lm's model files call the routed attention and SwiGLU,
        # which ask the routes in force (this engine's, while it steps: engine/ops/switch.py).
        attention.install(model)  # verify passes: multi-row attention routed per backend
        matmul.install(model)  # and few-row products (engine/ops/matmul.py)
        # SwiGLU by the CPU ops where they run (engine/ops/activations.py)
        activations.install(model)
        self.config = config or {}
        chunk, tokens = memory.default_prefill()
        self.prefill_chunk = chunk if settings.prefill_chunk is None else settings.prefill_chunk
        # tokens per packed prefill pass (rows x width), at most
        self.prefill_tokens = tokens if settings.prefill_tokens is None else settings.prefill_tokens
        self.prefill_rows = settings.prefill_rows  # prompts prefilled together, at most (None: any)
        # Prefix states kept across runs (engine/prefill.py); None: every prompt prefilled alone.
        mb = settings.prefix_mb
        self.prefixes = (
            prefill.PrefixCache(int(mb * 2**20), settings.prefix_granularity) if mb > 0 else None
        )
        self.max_context = settings.max_context or self.config.get("max_position_embeddings")
        self.block_size = 0
        # set with a drafter that has a draft vocabulary
        self.draft_head: Optional[decode.DraftHead] = None
        self.target.check_cache()
        if drafter is not None:
            self._attach(drafter, settings.block_size)
        # The verify width per cycle from a cost model of the passes and each row's acceptance
        # (engine/widths.py); False: the whole block every cycle.
        self.adaptive_block = True if settings.adaptive_block is None else settings.adaptive_block
        self.batch_cap = settings.batch_size
        self.cost: Dict[int, CostModel] = {}  # batch size -> measured pass costs (warm_up)
        # (batch size, context bucket) -> the few-row matmul a fixed width runs under (_fixed_cost)
        self.fixed_matmul: Dict[Tuple[int, int], Optional[str]] = {}
        # given pass costs: no warm-up, any batch size (load_engine)
        self.cost_model = settings.cost_model
        self.measured_passes = 0  # warm-ups that timed passes (not read from the model cache)
        # (batch size, context bucket) of the tables timed again (``_measured_cost``): once each
        self.timed_again: set = set()
        self.keep_costs = True  # measured pass costs read from and kept in the model cache (engine/cost_tables.py)
        # the drafter's acceptance over every job's cycles: each job's prior (engine/widths.py)
        self.acceptance = pooled_acceptance(self.block_size)
        # draft trees' nodes, likewise
        self.node_calibration = NodeCalibration(max(self.block_size - 1, 0))
        # how rows end, at their budgets or before (the job's last wave: engine/finish.py)
        self.ends = finish.Ends()
        # and what the plain and the drafting probes spent
        self.plain_probes, self.drafting_probes = PlainProbes(), DraftingProbes()
        # what a packed prefill pass costs, from the passes timed (engine/prefill.py)
        self.prefill_cost = prefill.PrefillCost()
        self.shapes_seen: set = set()  # (rows, width, key bucket) of the cycles run so far
        self.passes_run: set = set()  # and their (rows, width)
        with switch.use(settings.routes()):
            # what a pass shape's first cycle costs (engine/widths.py): compiling, on a GPU; on the
            # CPU nothing unless its passes are traced (engine/ops/compiled.py)
            on_gpu, traced = device.gpu() is not None, compiled.mode() == "compiled"
            self.compile_cost = CompileCost(COMPILE_PRIOR) if on_gpu else CompileCost(learns=traced)
            cpu_ops = cpu.in_force()
        self.description = dict(
            description or {},
            block_size=self.block_size,
            adaptive_block=self.adaptive_block,
            draft_vocab=None if self.draft_head is None else len(self.draft_head),
            drafts=tree.drafts(self.drafter, self.target, settings.drafts),
            cpu_ops=cpu_ops,
        )
        self.loaded_draft = self.description.get("draft")
        self._grammars = None  # engine/grammar.py, built when a request first has a grammar
        # True: constrained rows pick their drafts under their grammar (Grammars.draft). Off by default:
        # on the default pair it raised tokens per cycle but cost more per cycle (docs/sampling.md).
        self.grammar_drafts = False

    @property
    def grammars(self):
        if self._grammars is None:
            from .grammar import Grammars

            self._grammars = Grammars(self.tokenizer, self.target.vocab_size)
        return self._grammars

    def _attach(self, drafter, block_size: Optional[int]) -> None:
        args = drafter.args
        if drafter.target_hidden_size != self.target.hidden_size:
            raise ModelMismatchError(
                f"drafter expects target hidden size {drafter.target_hidden_size}, "
                f"target has {self.target.hidden_size}"
            )
        if max(args.target_layer_ids) >= self.target.num_layers:
            raise ModelMismatchError(
                f"drafter taps target layers {args.target_layer_ids}, target has {self.target.num_layers} layers"
            )
        if not 0 <= args.mask_token_id < self.target.vocab_size:
            raise ModelMismatchError(
                f"drafter mask token id {args.mask_token_id} is outside the target vocabulary ({self.target.vocab_size})"
            )
        vocab = args.draft_vocab
        if vocab is not None and not 0 <= min(vocab) <= max(vocab) < self.target.vocab_size:
            raise ModelMismatchError(
                f"drafter's draft vocabulary reaches token {max(vocab)}, outside the target vocabulary ({self.target.vocab_size})"
            )
        self.target.set_taps(args.target_layer_ids)
        matmul.install(drafter)
        # drafts from the draft vocabulary, if the drafter has one (decode.DraftHead)
        self.draft_head = (
            decode.DraftHead(self.target, vocab)
            if vocab is not None and len(vocab) < self.target.vocab_size
            else None
        )
        if drafter.selects and args.vocab_size != self.target.vocab_size:
            raise ModelMismatchError(
                f"drafter's selector covers {args.vocab_size} tokens, the target vocabulary has {self.target.vocab_size}"
            )
        # the drafter's runtime block size (DFlash 2's config names one) unless one is asked, at most its block
        self.block_size = min(
            block_size or args.runtime_block_size or args.block_size, args.block_size
        )
        if self.block_size < 2:
            raise ValueError(f"block_size must be at least 2, got {self.block_size}")

    def use_drafter(
        self, folder: Optional[Union[str, Path]], revision: Optional[str] = None
    ) -> None:
        """Draft with the drafter in ``folder`` (a job's adapted revision, named ``revision``)
        from the next stream on, or again with the one the engine was loaded with (None). Call it
        between streams only: a running ``BatchDecoder`` keeps the drafter it started with. The
        new drafter is loaded and checked against the target before anything changes, so one that
        fails to load or does not fit raises and leaves the engine drafting as before."""
        if self.loaded_drafter is None:
            raise ModelMismatchError(
                "this engine decodes without a drafter: there is none to replace"
            )
        drafter = self.loaded_drafter
        if folder is not None:
            drafter = loading.load_drafter(folder, dtype=self.loaded_drafter.norm.weight.dtype)
        old = self.drafter
        try:
            self._attach(drafter, self.settings.block_size)
        except Exception:
            self._attach(old, self.settings.block_size)
            raise
        self.drafter, self.drafter_revision = drafter, None if folder is None else revision
        # what was learnt about the old drafter's acceptance (its probes' failures too), and the
        # prefixes' drafter states, go
        self.acceptance = pooled_acceptance(self.block_size)
        self.drafting_probes = DraftingProbes()
        self.node_calibration = NodeCalibration(max(self.block_size - 1, 0))
        if self.prefixes is not None:
            self.prefixes = prefill.PrefixCache(self.prefixes.limit, self.prefixes.granularity)
        self.description.update(draft=str(folder) if folder is not None else self.loaded_draft,
                                drafter_revision=self.drafter_revision, block_size=self.block_size,
                                draft_vocab=None if self.draft_head is None else len(self.draft_head))  # fmt: skip

    # -- prompts -------------------------------------------------------------------------
    def encode(
        self,
        prompt: Prompt,
        *,
        system: Optional[str] = None,
        chat_template: Optional[bool] = None,
        chat_template_kwargs: Optional[dict] = None,
    ) -> List[int]:
        """Token ids for a prompt: text (chat-templated when the tokenizer has a template),
        chat messages, or ids as they are."""
        tok = self.tokenizer
        if isinstance(prompt, str):
            if not prompt.strip():
                raise EmptyPromptError("prompt is empty")
            use_template = tok.has_chat_template if chat_template is None else chat_template
            if not use_template:
                return tok.encode(prompt if system is None else f"{system}\n\n{prompt}")
            prompt = [{"role": "user", "content": prompt}]
        if not isinstance(prompt, list):
            raise GenerationError(
                f"prompt must be a string, a list of chat messages or a list of token ids, not {type(prompt).__name__}"
            )
        if not prompt:
            raise EmptyPromptError("prompt is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.target.vocab_size]
            if bad:
                raise GenerationError(
                    f"token id {bad[0]} is outside the vocabulary (size {self.target.vocab_size})"
                )
            return list(prompt)
        try:  # the runner reads a row's messages by the same rule
            prompt = checks.chat_messages(prompt)
        except checks.BadValue as e:
            raise GenerationError(str(e)) from None
        if system is not None and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": system}] + prompt
        if not tok.has_chat_template:
            raise GenerationError(
                "chat messages given, but the target tokenizer has no chat template"
            )
        return tok.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
        )

    # -- generation ----------------------------------------------------------------------
    def request(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        index: int = 0,
        **prompt_options,
    ) -> EncodedRequest:
        """Check and encode one prompt with its options (raises GenerationError naming the problem).
        Sampling controls (``request.SamplingControls``: top_k, top_p, min_p, the penalties,
        logprobs, top_logprobs, response_format) come as keywords; docs/sampling.md."""
        given = {}
        for name in CONTROLS:
            value = prompt_options.pop(name, None)
            if value is not None:
                try:
                    given[name] = SamplingControls.check(name, value)
                except checks.BadValue as e:
                    raise GenerationError(f"{name} {e}") from None
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise GenerationError(
                f"max_tokens must be an integer of at least 1, got {max_tokens!r}"
            )
        if (
            not isinstance(temperature, (int, float))
            or not math.isfinite(temperature)
            or temperature < 0
        ):
            raise GenerationError(f"temperature must be a finite number >= 0, got {temperature!r}")
        return self._encoded(
            prompt,
            max_tokens,
            float(temperature),
            stop,
            seed,
            index,
            SamplingControls(**given),
            **prompt_options,
        )

    def _encoded(
        self,
        prompt: Prompt,
        max_tokens: int,
        temperature: float,
        stop: Optional[Sequence[str]],
        seed: Optional[int],
        index: int,
        controls: SamplingControls,
        **prompt_options,
    ) -> EncodedRequest:
        """Encode one prompt whose options are checked: by ``request``, or as the runner read its
        row and job (``request.Options``: ``row_options``, ``runner.spec.validate``). Refuses only
        what depends on the model: an empty prompt, one too long for its context."""
        ids = self.encode(prompt, **prompt_options)
        if not ids:
            raise EmptyPromptError("prompt encodes to no tokens")
        if self.max_context and len(ids) >= self.max_context:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the target's context is {self.max_context}"
            )
        if self.max_context:
            max_tokens = min(max_tokens, self.max_context - len(ids))
        want_logprobs = controls.logprobs or controls.top_logprobs > 0
        return EncodedRequest(
            ids,
            max_tokens,
            temperature,
            seed,
            tuple(stop or ()),
            index,
            controls=controls,
            logprobs=controls.top_logprobs if want_logprobs else None,
            grammar=constraints.grammar(controls.response_format),
        )

    def stream_batch(
        self,
        prompts: Sequence[Prompt],
        max_tokens: Union[int, Sequence[int]] = 256,
        temperature: Union[float, Sequence[float]] = 0.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        batch_size: Optional[int] = None,
        n: int = 1,
        **prompt_options,
    ) -> Iterator[Tuple[int, Completion]]:
        """Decode many prompts together; yield ``(index, Completion)`` as each finishes.

        ``max_tokens`` and ``temperature`` are one value or one per prompt; ``seed`` seeds
        prompt i with ``seed + i``. ``n``: samples per prompt, each its own Completion
        (``sample_index`` k, seeded ``request.sample_seed(seed + i, k)``); the prompt is
        prefilled once for all of them. Every prompt is checked before any work starts.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise GenerationError(f"n must be an integer of at least 1, got {n!r}")
        count = len(prompts)
        max_tokens = _per_prompt(max_tokens, count, "max_tokens")
        temperature = _per_prompt(temperature, count, "temperature")
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                first = self.request(
                    prompt,
                    max_tokens[i],
                    temperature[i],
                    stop,
                    None if seed is None else seed + i,
                    index=i * n,
                    **prompt_options,
                )
            except GenerationError as e:
                raise type(e)(f"prompt {i}: {e}") from None
            requests += _samples(first, n)
        for index, completion in self.run(requests, batch_size):
            completion.sample_index = index % n
            yield index // n, completion

    def run(
        self, requests: Sequence[EncodedRequest], batch_size: Optional[int] = None
    ) -> Iterator[Tuple[int, Completion]]:
        """Decode checked requests (see ``request``); yield ``(request.index, Completion)`` as each
        finishes. ``prefill_counts`` then holds the run's prefill passes, prompt tokens run through
        them and padding tokens; ``decode_counts`` its cycles per verify width T:
        ``{T: [cycles, seconds, rows in flight summed]}``; ``context_counts`` the drafter's writes
        of prompt context outside its drafting passes (engine/batch.py: ``write_prompts``):
        ``{"writes", "rows", "seconds"}``."""
        if not requests:
            return
        slots = self.plan_batch(requests, batch_size)
        decoder = self._decoder(
            requests, slots, self._width_policy(slots, requests), capacity=self._positions(requests)
        )
        for index, completion in self._completions(decoder):
            if isinstance(completion, Exception):
                raise completion  # one request's failure ends a call that yields only completions
            yield index, completion

    def _decoder(self, requests, slots: int, width_policy: WidthPolicy, **kw) -> BatchDecoder:
        """A decoder whose steps run under this engine's routes, with the ragged route its cost
        model chose (engine/ops/switch.py): never another engine's, nor its consumer's."""
        with switch.use(self._routes(width_policy)):
            return BatchDecoder(self, requests, slots, width_policy, **kw)

    def _steps(self, decoder: BatchDecoder) -> Iterator[Tuple[Optional[int], Any]]:
        """The decoder's steps, each run under this engine's routes."""
        return switch.stepping(self._routes(decoder.width_policy), decoder.steps())

    def _routes(self, width_policy: WidthPolicy) -> switch.Routes:
        return self.settings.routes(width_policy.cost)

    def _completions(
        self, decoder: BatchDecoder, on_piece: Optional[Callable[[int, Piece], None]] = None
    ) -> Iterator[Tuple[Optional[int], Any]]:
        """``(request index, Completion)`` as the decoder finishes each request, ``(request index,
        error)`` for one that failed alone, and the decoder's ``(None, None)`` marks (a stream
        refused a request); its counts become the engine's. ``on_piece(index, piece)`` sees every
        piece as it is committed."""
        self.prefill_counts = decoder.group.counts
        self.decode_counts = decoder.decode_counts
        # the drafter's prompt context, written when it first drafts
        self.context_counts = decoder.context_counts
        parts: Dict[int, List[Piece]] = {}
        for index, piece in self._steps(decoder):
            if index is None:
                yield None, None
                continue
            if isinstance(piece, Requeued):  # it starts again: what it committed is void
                parts.pop(index, None)
                continue
            if isinstance(piece, Exception):
                parts.pop(index, None)
                yield index, piece
                continue
            if on_piece is not None:
                on_piece(index, piece)
            parts.setdefault(index, []).append(piece)
            if piece.finish_reason is not None:
                yield index, _completion(parts.pop(index))

    def generate_requests(
        self,
        requests: Iterable[Request],
        batch_size: Optional[int] = None,
        lookahead: Optional[int] = None,
        inbox=None,
    ) -> Iterator[Tuple[Request, Union[Completion, Exception]]]:
        """The runner's interface (``dflash_batch.request.CompletionEngine``): one stream, decoded
        together (``batch_size`` rows at most) and yielded as each request finishes, a request of
        ``options.n`` samples once per sample (``sample_index``; seeds from the request's seed, its
        id and the sample index). Requests are pulled and encoded (``request``) as slots free up,
        at most ``lookahead`` encoded ones waiting (default twice the batch size; engine/waiting.py),
        so the batch stays full until the input ends and a long job is never encoded up front. One
        the engine refuses (its ``GenerationError``: an empty or too long prompt, or one whose row
        alone does not fit in memory) is yielded as soon as the pull that met it is done; one that
        fails while decoding (its grammar) is yielded with its error, and the others go on.

        ``inbox`` (dflash_batch/inbox.py): interactive requests join at each step, ahead of the
        waiting ones; they are answered through their tickets, never yielded, and the batch keeps
        its slots for them until the call ends."""
        cap = self._batch_cap(batch_size)
        plan = memory.Plan(self, cap)  # rows in flight: the cap, or fewer once a long request comes
        refused: List[Tuple[Any, Exception]] = []
        owners: Dict[
            int, Tuple[Any, int]
        ] = {}  # engine request index -> (runner's request or ticket, sample)
        prompt_ids: Dict[int, List[int]] = {}  # engine request index -> its prompt's ids, in flight
        count = itertools.count()

        def encode(req) -> List[EncodedRequest]:
            first = self._checked(req, 0)
            # decoded plainly, as a check (docs/runner.md)
            first.control = getattr(req, "control", False)
            plan.take(self._positions([first]))
            samples = _samples(first, getattr(req.options, "n", 1), item=str(req.id))
            for sample in samples:
                sample.index = next(count)
                prompt_ids[sample.index] = first.ids
            return samples

        def encoded() -> Iterator[Optional[List[EncodedRequest]]]:
            for req in requests:
                try:
                    samples = encode(req)
                except GenerationError as e:
                    refused.append((req, e))
                    yield None  # counted by the look-ahead: reported once the pull is done
                    continue
                owners.update((s.index, (req, s.sample)) for s in samples)
                yield samples  # pulled together: the first prefills, the others copy its state

        def urgent() -> List[List[EncodedRequest]]:
            groups = []
            for ticket in inbox.take():
                try:
                    samples = encode(ticket.request)
                except GenerationError as e:
                    ticket.fail(e)
                    continue
                for s in samples:
                    s.urgent = True
                owners.update((s.index, (ticket, s.sample)) for s in samples)
                groups.append(samples)
            return groups

        def cancelled(request: EncodedRequest) -> bool:
            owner = owners.get(request.index, (None,))[0]
            return isinstance(owner, Ticket) and owner.cancelled.is_set()

        def on_piece(index: int, piece: Piece) -> None:
            owner, sample = owners[index]
            if isinstance(owner, Ticket):
                owner.on_piece(sample, piece)

        waiting = Waiting(
            encoded(), lookahead or 2 * cap, self.prefixes.granularity if self.prefixes else None
        )
        while (
            len(waiting) < waiting.ahead and not waiting.done
        ):  # the first look-ahead plans the batch
            waiting.refill()
            yield from _drain(refused)
        if inbox is not None:
            waiting.push_front(urgent())
        if not waiting:
            return
        slots = min(plan.rows, len(waiting)) if waiting.done and inbox is None else plan.rows
        hooks = dict(urgent=urgent, cancelled=cancelled) if inbox is not None else {}
        decoder = self._decoder(
            waiting,
            slots,
            self._width_policy(slots, waiting.peeked(), inbox is not None),
            plan=plan,
            capacity=plan.longest,
            **hooks,
        )
        try:
            for index, completion in self._completions(
                decoder, on_piece if inbox is not None else None
            ):
                yield from _drain(refused)
                if index is None:
                    continue
                owner, sample = owners.pop(index)
                ids = prompt_ids.pop(index)
                if not isinstance(completion, Exception):  # a failed one is named by its request
                    completion.sample_index = sample
                    completion.prompt_token_ids = list(ids)
                if isinstance(owner, Ticket):
                    owner.finish(sample, completion)
                else:
                    yield owner, completion
        except (
            BaseException
        ) as e:  # the call failed or its caller stopped it: no ticket waits forever
            for owner, _ in list(owners.values()):
                if isinstance(owner, Ticket):
                    owner.fail(e if isinstance(e, Exception) else Cancelled("the batch stopped"))
            raise
        yield from _drain(refused)

    def _checked(self, req: Request, index: int) -> EncodedRequest:
        """A runner's request encoded: its options were checked as its row and job were read."""
        options = req.options
        return self._encoded(
            req.prompt,
            options.max_tokens,
            float(options.temperature),
            options.stop,
            options.seed,
            index,
            options.controls(),
            system=options.system,
            chat_template=options.chat_template,
            chat_template_kwargs=options.chat_template_kwargs,
        )

    def generate_batch(
        self, prompts: Sequence[Prompt], *args, n: int = 1, **kwargs
    ) -> List[Completion]:
        """``stream_batch`` collected in input order: prompt i's samples at ``i * n .. i * n + n - 1``."""
        out: List[Optional[Completion]] = [None] * (len(prompts) * n)
        for i, c in self.stream_batch(prompts, *args, n=n, **kwargs):
            out[i * n + c.sample_index] = c
        return out

    def stream(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        **prompt_options,
    ) -> Iterator[Piece]:
        """Yield text as it is committed (one Piece per target pass); the last carries stats."""
        request = self.request(prompt, max_tokens, temperature, stop, seed, **prompt_options)
        decoder = self._decoder([request], 1, self._width_policy(1, [request]))
        for _, piece in self._steps(decoder):
            if isinstance(piece, Exception):
                raise piece
            yield piece

    def generate(
        self,
        prompt: Prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        stop: Optional[Sequence[str]] = None,
        seed: Optional[int] = None,
        **prompt_options,
    ) -> Completion:
        """Run one prompt to the end: text, token ids, finish reason and statistics (a batch of one)."""
        return _completion(
            list(self.stream(prompt, max_tokens, temperature, stop, seed, **prompt_options))
        )

    # -- batch size, pass costs ----------------------------------------------------------
    def plan_batch(
        self, requests: Sequence[EncodedRequest], batch_size: Optional[int] = None
    ) -> int:
        """Rows in flight: the asked (or configured) cap, at most what memory holds for the
        longest request. Too little memory for even one row is an error before any work."""
        plan = memory.Plan(self, self._batch_cap(batch_size))
        plan.take(self._positions(requests))
        return max(1, min(plan.rows, len(requests)))

    def _positions(self, requests: Sequence[EncodedRequest]) -> int:
        """Cache positions the longest of ``requests`` can reach: prompt, budget and one block."""
        return max(len(r.ids) + r.max_tokens for r in requests) + max(self.block_size, 1)

    def _batch_cap(self, batch_size: Optional[int]) -> int:
        cap = batch_size or self.batch_cap or memory.default_batch_cap()
        if cap < 1:
            raise ValueError(f"batch_size must be at least 1, got {cap}")
        return cap

    def _width_policy(
        self, slots: int, requests: Sequence[EncodedRequest] = (), waits: bool = False
    ) -> WidthPolicy:
        if not self.adaptive_block or self.drafter is None:
            return WidthPolicy(self.block_size, self._fixed_cost(slots, requests), fixed=True)
        cost = self.cost_model
        if cost is None:
            cost = self._measured_cost(slots, requests, waits)
        return WidthPolicy(
            self.block_size,
            cost,
            job=self.acceptance,
            nodes=self.node_calibration,
            plain=self.plain_probes,
            compile=self.compile_cost,
            drafting=self.drafting_probes,
        )

    def _fixed_cost(self, slots: int, requests: Sequence[EncodedRequest]) -> CostModel:
        """No cost model steers a fixed width, but on CUDA the few-row matmul is chosen for it as
        for a drafting job (engine/warmup.py), once per batch size and context bucket a machine."""
        context = max(_typical_context(requests), warmup.SHORT_CONTEXT)
        key = (slots, warmup.context_bucket(context))
        if key not in self.fixed_matmul:
            self.fixed_matmul[key] = self._fixed_matmul(slots, context)
        return CostModel(matmul=self.fixed_matmul[key])

    def _fixed_matmul(self, slots: int, context: int) -> Optional[str]:
        """The few-row matmul a fixed width's job of this batch size runs under: timed (a plain
        cycle, or a whole-block one with a drafter) and kept in the model cache beside the cost
        tables, or read from there; None where there is nothing to choose."""
        width = 1 if self.drafter is None else self.block_size  # every cycle's
        with switch.use(self.settings.routes()):
            if not warmup.matmul_choice(slots, width):
                return None
            table = self._cost_table(slots, context, fixed_width=True)
            kept = cost_tables.load(table) if table is not None else None
            if kept is not None:
                return kept.matmul
            chosen = warmup.choose_matmul(self, slots, context, width)
            if table is not None:
                cost_tables.save(table, CostModel(matmul=chosen))
            return chosen

    def _cost_table(self, batch_size: int, context: Optional[int], **extra) -> Optional[dict]:
        """The model cache's key for this engine's costs at this batch size and context bucket
        (engine/cost_tables.py; under the routes in force), None where costs are not kept."""
        if not self.keep_costs:
            return None
        return {**cost_tables.key(self, batch_size, warmup.context_bucket(context or 0)), **extra}

    def _measured_cost(
        self, slots: int, requests: Sequence[EncodedRequest], waits: bool = False
    ) -> CostModel:
        """The pass costs timed for this batch size at these requests' context (warm_up). ``waits``:
        someone waits for the first token (an interactive request): costs timed at another
        context serve rather than a warm-up on its path."""
        context = _typical_context(requests)
        cost = self.cost.get(slots)
        if cost is not None and waits:
            return cost
        if cost is not None and cost.read and cost.stale():
            # a table timed under a load that has passed: time the passes again, and keep the
            # faster timings (engine/cost_tables.py). Once a table: an honest one that this
            # job's cycles misjudge would otherwise be timed again at every job
            again = (slots, warmup.context_bucket(context or cost.context or 0))
            if again not in self.timed_again:
                return self.warm_up(slots, context or cost.context, measure=True)
        if cost is None or (
            cost.context is not None
            and context
            and warmup.context_bucket(cost.context) != warmup.context_bucket(context)
        ):
            cost = self.warm_up(slots, context)
        return cost

    def prepare(
        self, batch_size: Optional[int] = None, max_tokens: int = 0
    ) -> Optional[Dict[str, Any]]:
        """Warm up ahead of a job of this batch size (None: the engine's cap) and budget, unless
        nothing is to be warmed up (no drafter, a fixed width or given costs) or it is done
        already. Returns what it did: ``{"batch_size", "context", "seconds", "read"}`` (``read``:
        the costs came from the model cache), or None. The job's prompts are not known yet: its
        context is taken as a short prompt and half the budget; a job whose prompts fall in
        another bucket warms up again (from the cache, where it was measured before)."""
        if self.drafter is None or not self.adaptive_block or self.cost_model is not None:
            return None
        rows = self._batch_cap(batch_size)
        context = warmup.SHORT_CONTEXT + max_tokens // 2
        done = self.cost.get(rows)
        if done is not None and warmup.context_bucket(done.context or 0) == warmup.context_bucket(
            context
        ):
            return None
        started = time.perf_counter()
        measured = self.measured_passes
        self.warm_up(rows, context)
        return {
            "batch_size": rows,
            "context": context,
            "seconds": time.perf_counter() - started,
            "read": self.measured_passes == measured,
        }

    def warm_up(
        self, batch_size: int = 1, context: Optional[int] = None, *, measure: bool = False
    ) -> CostModel:
        """Compile and time the passes a job of this batch size runs: target passes of 1, half the
        block's and the block's rows, and drafter passes, at batch 1 (a GPU job wider than its compiled
        passes: the narrowest eager batch, engine/warmup.py) and ``batch_size``, the rows
        holding about ``context`` tokens (a job's prompt and half its budget; default: a short
        context). On a GPU it also picks the faster attention for ragged batches. A job's first
        use of a batch size (and of a context of another power of two) does this by itself; call
        it ahead to keep it out of a job's first items. Costs an earlier process measured on this
        machine for this model, batch size and context bucket are read from the model cache
        instead (engine/cost_tables.py; ``keep_costs`` False: neither read nor kept), unless
        ``measure``: then the passes are timed again, and the table keeps the faster of its
        timings and the new ones (cost_tables.py, "Timed again")."""
        with switch.use(self.settings.routes()):  # the key names this engine's routes
            table = self._cost_table(batch_size, context)
            cost = cost_tables.load(table) if table is not None and not measure else None
            if cost is None:
                cost = warmup.measure_costs(self, batch_size, context)
                self.measured_passes += 1
                if table is not None:
                    # with what a table kept there timed faster (engine/cost_tables.py)
                    cost = cost_tables.keep(table, cost)
            else:
                cost.read = True
        if measure:
            self.timed_again.add((batch_size, warmup.context_bucket(context or 0)))
        earlier = self.cost.get(batch_size)
        # what widths cost beyond their model follows their shapes, not the context (but not
        # beyond a stale table's: that excess made up for its passes)
        if earlier is not None and not (measure and earlier.read):
            cost.width_excess = earlier.width_excess
        self.cost[batch_size] = cost
        return cost


def _typical_context(requests: Sequence[EncodedRequest]) -> int:
    """Tokens a row of these requests holds halfway through: the median prompt and half the
    median budget (0 for none)."""
    if not requests:
        return 0
    prompts = sorted(len(r.ids) for r in requests)
    budgets = sorted(r.max_tokens for r in requests)
    return prompts[len(prompts) // 2] + budgets[len(budgets) // 2] // 2


def _samples(first: EncodedRequest, n: int, item: str = "") -> List[EncodedRequest]:
    """``first`` and its n - 1 siblings: the same prompt, sample k seeded ``sample_seed(seed, k, item)``."""
    return [
        dataclasses.replace(
            first, seed=sample_seed(first.seed, k, item), index=first.index + k, sample=k
        )
        for k in range(n)
    ]


def _drain(refused: list) -> Iterator:
    """Yield and forget the (request, error) pairs gathered so far."""
    while refused:
        yield refused.pop(0)


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise GenerationError(f"{name} has {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n


def _completion(pieces: List[Piece]) -> Completion:
    last = pieces[-1]
    return Completion(
        text="".join(p.text for p in pieces),
        token_ids=[t for p in pieces for t in p.token_ids],
        finish_reason=last.finish_reason,
        stats=last.stats,
        stop_reason=last.stop_reason,
        logprobs=[lp for p in pieces for lp in p.logprobs] if last.logprobs is not None else None,
    )


def pick_dtype(dtype: Optional[str]) -> Optional[mx.Dtype]:
    """fp32 on CPU (bf16 and quantized matmuls are slow there); as stored on a GPU."""
    if dtype is None or dtype == "auto":
        return mx.float32 if device.on_cpu() else None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


AUTO = "auto"


def _lift_length_limit(tokenizer) -> None:
    """The engine holds prompts to ``max_context`` itself (``PromptTooLongError``); a Hugging
    Face tokenizer's ``model_max_length`` truncates nothing unasked and would only log a
    warning ("Token indices sequence length is longer...") ahead of that clean error."""
    if isinstance(getattr(tokenizer, "model_max_length", None), int):
        tokenizer.model_max_length = NO_LENGTH_LIMIT


def load_engine(
    target: Optional[Union[str, Path]] = None,
    draft: Optional[Union[str, Path]] = AUTO,
    *,
    target_revision: Optional[str] = None,
    draft_revision: Optional[str] = None,
    dtype: Optional[str] = "auto",
    **options,
) -> Engine:
    """Load a target and its DFlash drafter.

    Args:
        target: a local model folder or a Hugging Face repo id; None for the embedded default.
        draft: a drafter folder or repo id; ``"auto"`` for the drafter registered for the
            target (none: plain AR decoding); None for plain AR decoding.
        target_revision, draft_revision: pin a branch, tag or commit on the hub.
        dtype: "auto" (fp32 on CPU, as stored on GPU), "float32", "bfloat16" or "float16".
        options: the engine's settings, ``EngineConfig``'s fields (block_size, adaptive_block,
            prefill_chunk, prefill_tokens, prefill_rows, prefix_cache_mb, prefix_granularity,
            max_context, batch_size, cost_model, and the routing modes attention, matmul,
            passes, drafts, cpu_ops), checked before any model is loaded.
    """
    settings = EngineConfig(**options)
    mx_dtype = pick_dtype(dtype)
    if target is None:
        target, default_draft = registry.default_pair()
        if draft == AUTO:
            draft = default_draft
    elif draft == AUTO:
        found = registry.auto_drafter(str(target))
        draft, draft_revision = found if found else (None, None)
    model, tokenizer, config = registry.load_any_target(target, target_revision, mx_dtype)
    drafter = loading.load_drafter(draft, draft_revision, mx_dtype) if draft is not None else None
    description = {
        "target": str(target),
        "target_revision": target_revision,
        "draft": None if draft is None else str(draft),
        "draft_revision": draft_revision,
        "dtype": str(mx_dtype or "as-stored"),
    }
    return Engine(
        model,
        tokenizer,
        drafter,
        config=config,
        description=description,
        settings=settings,
    )
