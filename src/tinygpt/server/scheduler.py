"""Continuous batching: one model thread decodes every active sequence in one forward step.

Each sequence owns a row ("slot") of one shared KVCache. A new sequence is prefilled alone into
its slot; after that, every step runs `generate.decode_step` once over all active rows, each at
its own position, and chooses each row's next token with that row's sampling settings. Sequences
join and leave between steps: a finished or cancelled one gives its row to the last active row
(rows 0..n-1 stay in use, so a step only computes the rows that hold a sequence).

A row whose context reaches block_size is treated as `generate_stream` treats it: its slot is
re-prefilled from its last block_size tokens each step, exactly the context the plain loop sees.

With speculation on (`speculation`), a sequence decoding alone speculates through `speculative.speculate`,
as `generate_stream` does; beside others it takes the batched step, whose one read of the weights serves
every row (a verification of its own would be a second read that the others wait for).

Everything that touches the model runs on the one model thread; the web server talks to it
through `submit`, `cancel` and `call` and hears back through each sequence's `emit` callback.

An error in one sequence (its prefill, its sampling, its text) ends that sequence alone with an
error event; the others in the batch go on. Only an error in the batched forward itself, which
belongs to no one sequence, fails every row of that step. Should the model thread itself die, the
scheduler says so (`failure`), fails everything waiting or running with a 503, and refuses new work.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..calc.units import format_bytes
from ..config.sampling import SampleConfig
from ..constrain import Grammar
from ..device import free_memory
from ..errors import ConfigError, TinyGPTError
from ..generate import StopText, ThreadChoice, decode_step, prefill
from ..kv_cache import KVCache
from ..prompt_cache import PromptCache
from ..sampling import choose, mask_vocab, process_logits
from ..speculative import Round, SpeculationStats, Speculator, speculate, speculator
from ..tokenizer.incremental import IncrementalDecoder
from .scoring import TokenInfo, token_info

log = logging.getLogger("tinygpt.server")


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is full."""

    def __init__(self, retry_after: int) -> None:
        super().__init__("the server is at capacity")
        self.retry_after = retry_after


class Draining(Exception):
    """The server is shutting down and accepts no new work."""


class ModelDown(Exception):
    """The model thread has stopped (its message says why): no work can be done."""


@dataclass
class Event:
    """What the model thread reports for one choice: new text, and at the end why it stopped.

    `tokens` holds the TokenInfo of the tokens whose text is in `text` (when logprobs were asked).
    """

    index: int
    text: str = ""
    tokens: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" when finished
    completion_tokens: int = 0
    speculation: SpeculationStats | None = None  # with finish_reason, where the sequence could speculate
    error: str | None = None
    status: int = 500  # with an error: the HTTP status it calls for (503: shutting down, or the model thread died)
    cached_tokens: int = 0  # with the finish: prompt tokens whose keys and values came from the prompt cache


@dataclass(eq=False)
class Sequence:
    """One choice to generate, and (in the fields after `emit`) its decoding state.

    Args:
        prompt: token ids (cut to the model's last block_size tokens when longer).
        max_tokens: stop after this many new tokens (finish_reason "length").
        sampling: temperature, top_k, top_p, repetition_penalty.
        emit: called on the model thread with each Event; must not block.
        index: the choice index reported in events.
        seed: seeds this choice's own torch.Generator (reproducible sampling).
        stop: strings that end the text (not included in it).
        stop_tokens: token ids that end the sequence (e.g. <|endoftext|>); not included.
        logprobs: None, or how many top candidates to report with each token's logprob.
        presence_penalty, frequency_penalty: OpenAI's penalties on tokens already generated.
        logit_bias: token id -> value added to its logit.
        grammar: what the text must be (a compiled constraint): each step chooses among the tokens it
            allows, and the sequence ends where it is complete.
    """

    prompt: list[int]
    max_tokens: int
    sampling: SampleConfig
    emit: Callable[[Event], None]
    index: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_tokens: frozenset[int] = frozenset()
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    grammar: Grammar | None = None

    cancelled: bool = field(default=False, init=False)
    generated: int = field(default=0, init=False)
    chars: int = field(default=0, init=False)  # characters of text decoded so far (for text offsets)
    sent: int = field(default=0, init=False)  # characters of text emitted so far (the rest is held back or cut)
    filled: int = field(default=0, init=False)  # cache positions of this slot holding the current context
    cached: int = field(default=0, init=False)  # prompt positions the prompt cache filled
    speculator: Speculator | None = field(default=None, init=False)  # its speculation, with the server's on

    def start(self, tokenizer, vocab_size: int, device: torch.device) -> None:
        """Allocate the per-sequence state on the model thread."""
        self.decoder = IncrementalDecoder(tokenizer)
        self.stopper = StopText(self.stop)
        prompt = self.prompt
        self.tokens = torch.empty(len(prompt) + min(self.max_tokens, 256), dtype=torch.long, device=device)
        self.tokens[: len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        self.length = len(prompt)
        self.generator = None
        if self.seed is not None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        self.bias = None
        if self.logit_bias:
            self.bias = torch.zeros(1, vocab_size, device=device)
            for token, value in self.logit_bias.items():
                self.bias[0, token] = value
        self.counts = None
        if self.presence_penalty or self.frequency_penalty:
            self.counts = torch.zeros(1, vocab_size, device=device)
        self.pending: list[TokenInfo] = []
        self.matcher = self.grammar.matcher() if self.grammar is not None else None

    def context(self) -> torch.Tensor:
        """Every token so far, (1, T)."""
        return self.tokens[: self.length].unsqueeze(0)

    def append(self, token: int) -> None:
        if self.length == self.tokens.shape[0]:  # grow by doubling: max_tokens may be large
            grown = torch.empty(2 * self.length, dtype=torch.long, device=self.tokens.device)
            grown[: self.length] = self.tokens
            self.tokens = grown
        self.tokens[self.length] = token
        self.length += 1
        self.generated += 1


class Scheduler:
    """Runs the model for many sequences at once on one background thread.

    Args:
        model: a tinygpt GPT in eval mode.
        tokenizer: turns generated ids into text (IncrementalDecoder).
        max_concurrency: sequences decoded together (KV cache rows).
        max_queue: sequences that may wait for a row; beyond that `submit` raises QueueFull.
        prompt_cache: where finished sequences' keys and values are kept for prompts that begin as they do
            (None: every prompt is computed whole).
        speculation: speculative.speculator's arguments (draft, speculate, prompt_lookup) for each sequence's
            own speculation; None: none.

    Raises:
        ConfigError: speculation's arguments do not fit the model.
    """

    def __init__(self, model, tokenizer, *, max_concurrency: int = 8, max_queue: int = 32,
                 prompt_cache: PromptCache | None = None, speculation: dict | None = None) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("max_concurrency must be >= 1 and max_queue >= 0")
        self.speculation = dict(speculation or {}, max_len=model.config.block_size, vocab_size=tokenizer.vocab_size)
        speculator(model, **self.speculation)  # checked now: a bad setting is an error at start-up
        self.model = model
        self.tokenizer = tokenizer
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.prompt_cache = prompt_cache
        self.block_size = model.config.block_size
        self.vocab_size = model.config.vocab_size
        self.tokenizer_vocab = tokenizer.vocab_size  # ids at or past it are never chosen (sampling.mask_vocab)
        self.device = next(model.parameters()).device
        self.draining = False
        self.failure: str | None = None  # why the model thread died, once it has
        self.counters = {"completed": 0, "cancelled": 0, "failed": 0, "generated_tokens": 0, "steps": 0,
                         "peak_batch": 0}
        self._cond = threading.Condition()
        self._active: list[Sequence] = []  # row i of the cache belongs to _active[i]
        self._waiting: deque[Sequence] = deque()
        self._admitting: list[Sequence] = []  # taken from the queue, not yet given a row
        self._jobs: deque[tuple[Callable[[], object], Future]] = deque()
        self._held = 0  # places held by requests whose prompts are being scored (see `hold`)
        self._cache: KVCache | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._threads: ThreadChoice | None = None  # the CPU threads of decode steps and prompts (made by _loop)

    # -- called from the web server ----------------------------------------------------------

    def allocate(self) -> None:
        """Allocate the KV cache now, on this thread: `create_app` does, before the server listens, so
        that a cache this device cannot hold is an error at start-up and not a model thread that dies
        after the server said it was serving.

        Raises:
            ConfigError: the cache needs more memory than the device has free (or its allocation
                failed); the message says how much and that --max-concurrency lowers it.
        """
        if self._cache is not None:
            return
        need = KVCache.bytes_for_model(self.model, self.max_concurrency)
        what = (f"the KV cache for {self.max_concurrency:,} concurrent sequences of {self.block_size:,} tokens needs "
                f"{format_bytes(need)} ({format_bytes(need // self.max_concurrency)} a sequence)")
        free = free_memory(self.device)
        if free is not None and need > free:
            raise ConfigError(f"{what}, more than the {format_bytes(free)} free on {self.device}: "
                              "lower --max-concurrency")
        try:
            self._cache = KVCache.for_model(self.model, self.max_concurrency)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"{what} and could not be allocated on {self.device} ({first}): "
                              "lower --max-concurrency") from None

    def start(self) -> None:
        with self._cond:
            if self.failure is None and (self._thread is None or not self._thread.is_alive()):
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="tinygpt-model", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail whatever is still queued or running, and end the model thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._cond:
            for seq in [*self._waiting, *self._admitting, *self._active]:
                _safe_emit(seq, Event(seq.index, error="the server is shutting down"))
            self._waiting.clear()
            self._active.clear()
            self._admitting.clear()
            for _, future in self._jobs:
                future.cancel()
            self._jobs.clear()
            self._cond.notify_all()

    def submit(self, seqs: list[Sequence]) -> None:
        """Queue the sequences of one request, all or none.

        Raises:
            ModelDown: the model thread has died.
            Draining: the server is shutting down.
            QueueFull: not enough room in the slots and the queue (retry later).
        """
        with self._cond:
            self._admit_or_raise(len(seqs))
            self._waiting.extend(seqs)
            self._cond.notify_all()
        self.start()

    @contextmanager
    def hold(self, count: int) -> Iterator[None]:
        """Hold `count` places (slots or queue places) for as long as the block runs: a request whose
        prompts are scored first (echo with logprobs) is work on the model thread before its sequences
        exist, and a full server refuses it as it refuses sequences. Raises as `submit` does."""
        with self._cond:
            self._admit_or_raise(count)
            self._held += count
        try:
            yield
        finally:
            with self._cond:
                self._held -= count
                self._cond.notify_all()

    def _admit_or_raise(self, count: int) -> None:
        if self.failure is not None:
            raise ModelDown(self.failure)
        if self.draining or self._stopping:
            raise Draining()
        if not self._room(count):
            raise QueueFull(retry_after=1)

    def has_room(self, count: int) -> bool:
        """Whether `count` more sequences would be accepted now (submit decides for sure)."""
        with self._cond:
            return self._room(count)

    def _room(self, count: int) -> bool:
        taken = len(self._waiting) + self._running() + self._held
        return taken + count <= self.max_concurrency + self.max_queue

    def cancel(self, seqs: list[Sequence]) -> None:
        """Stop generating for these sequences: a waiting one leaves the queue now, an active one
        gives up its row before the next step."""
        with self._cond:
            for seq in seqs:
                if seq.cancelled:
                    continue
                seq.cancelled = True
                try:
                    self._waiting.remove(seq)
                    self.counters["cancelled"] += 1
                except ValueError:
                    pass  # active (or already finished): the model thread drops it
            self._cond.notify_all()

    def call(self, fn: Callable[[], object]) -> Future:
        """Run fn() on the model thread between two steps; returns a Future of its result."""
        future: Future = Future()
        with self._cond:
            if self.failure is not None:
                raise ModelDown(self.failure)
            if self._stopping:
                raise Draining()
            self._jobs.append((fn, future))
            self._cond.notify_all()
        self.start()
        return future

    def start_draining(self) -> None:
        """Refuse new work from now on; what is queued or running goes on to the end."""
        with self._cond:
            self.draining = True
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running. Returns False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._waiting or self._admitting or self._active or self._jobs or self._held), timeout
            )

    def stats(self) -> dict:
        """Sequences generating ("active") and waiting ("queued"), places held by prompts being scored
        ("scoring"), and counters since the start."""
        with self._cond:
            cache = {"prompt_cache": self.prompt_cache.stats()} if self.prompt_cache is not None else {}
            return {"active": self._running(), "queued": len(self._waiting), "scoring": self._held,
                    "slots": self.max_concurrency,
                    "max_queue": self.max_queue, **self.counters, **cache}

    def _running(self) -> int:
        return sum(not s.cancelled for s in self._active) + sum(not s.cancelled for s in self._admitting)

    # -- the model thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                self.allocate()
                self._loop()
        except BaseException as e:  # whatever ended the thread, the server must hear of it
            log.exception("the model thread stopped")
            self._die(f"the model thread stopped ({type(e).__name__}: {e})" if str(e) else
                      f"the model thread stopped ({type(e).__name__})")

    def _loop(self) -> None:
        self._threads = ThreadChoice(enabled=self.device.type == "cpu")
        while True:
            with self._cond:
                while not (self._stopping or self._active or self._waiting or self._jobs):
                    self._cond.wait()
                if self._stopping:
                    return
                jobs = list(self._jobs)
                self._jobs.clear()
                cancelled = [i for i, s in enumerate(self._active) if s.cancelled]
                free = self.max_concurrency - len(self._active) + len(cancelled)
                admit = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self._admitting = list(admit)
                self.counters["cancelled"] += len(cancelled)
            for fn, future in jobs:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn())
                    except BaseException as e:  # handed to the caller
                        future.set_exception(e)
            self._remove(cancelled)
            if not self._active and not admit:
                with self._cond:
                    self._cond.notify_all()  # wake wait_idle
                continue
            try:
                self._step(admit)
            except Exception:  # the batched forward: it belongs to every row of the step
                log.exception("generation step failed")
                failed = list(dict.fromkeys([*self._active, *admit]))
                for seq in failed:
                    _safe_emit(seq, Event(seq.index, error="internal error while generating"))
                self.counters["failed"] += len(failed)
                with self._cond:
                    self._active.clear()
                    self._admitting.clear()
                    self._cond.notify_all()

    def _die(self, reason: str) -> None:
        """The model thread is ending on an error: say so, fail what waits or runs, refuse the rest."""
        with self._cond:
            self.failure = reason
            seqs = list(dict.fromkeys([*self._waiting, *self._admitting, *self._active]))
            self._waiting.clear()
            self._admitting.clear()
            self._active.clear()
            jobs, self._jobs = list(self._jobs), deque()
            self.counters["failed"] += len(seqs)
            self._cond.notify_all()
        for seq in seqs:
            _safe_emit(seq, Event(seq.index, error=f"the model is not available: {reason}", status=503))
        for _, future in jobs:
            if future.set_running_or_notify_cancel():
                future.set_exception(ModelDown(reason))

    def _fail(self, s: Sequence, error: Exception) -> None:
        """End one sequence on an error of its own; the rest of the batch goes on."""
        log.error("a sequence failed: %s: %s", type(error).__name__, error, exc_info=error)
        why = f": {error}" if isinstance(error, (TinyGPTError, ValueError)) and str(error) else ""
        _safe_emit(s, Event(s.index, error=f"internal error while generating this choice{why}"))
        self.counters["failed"] += 1

    def _step(self, admit: list[Sequence]) -> None:
        """One step: every active row gets its next logits (batched decode, a speculative round for a sequence
        decoding alone, or a re-prefill once its context is full); every admitted sequence is prefilled into a
        free row; then each row chooses. What fails for one sequence alone (its prefill, its round, its choice)
        ends that sequence only."""
        active = self._active
        logits = self._decode(active) if active else []
        for s in admit:
            if s.cancelled:  # its client left while it waited
                with self._cond:
                    self._admitting.remove(s)
                    self.counters["cancelled"] += 1
                continue
            row = len(active)
            with self._cond:
                active.append(s)
                self._admitting.remove(s)
            logits.append(_attempt(lambda: self._admit(s, row)))
        self.counters["steps"] += 1
        self.counters["peak_batch"] = max(self.counters["peak_batch"], len(active))
        done = []
        for i, s in enumerate(active):
            result = logits[i]
            if isinstance(result, Round):  # its tokens one by one, as plain steps would report them
                result = _attempt(lambda: any(self._advance(s, logits[i].logits[j : j + 1], token)
                                              for j, token in enumerate(logits[i].tokens)))
            elif not isinstance(result, Exception):
                result = _attempt(lambda: self._advance(s, logits[i]))
            if isinstance(result, Exception):
                self._fail(s, result)
                done.append(i)
            elif result is True:
                _attempt(lambda: self._keep(s, i))  # a copy that fails costs the cache an entry, nothing else
                done.append(i)
        self._remove(done)

    def _decode(self, active: list[Sequence]) -> list[torch.Tensor | Round | Exception]:
        """Each active row's next logits (1, V), or the Round of a sequence that speculated alone."""
        model, cache, bs = self.model, self._cache, self.block_size
        full = [s.filled >= bs for s in active]
        if len(active) == 1 and not full[0] and active[0].speculator is not None:
            spoken = _attempt(lambda: self._speculate(active[0]))
            if spoken is not None:
                return [spoken]
        if not all(full):
            tokens = torch.stack([s.tokens[s.length - 1] for s in active])  # (B,)
            # A full row decodes a throwaway token at the last position; the re-prefill below
            # rewrites its whole row.
            positions = [min(s.filled, bs - 1) for s in active]
            pos = torch.tensor(positions, device=self.device)
            view = cache.rows(0, len(active), length=max(positions) + 1)  # no row looks further
            start = time.perf_counter()
            out = self._threads.run(lambda: decode_step(model, tokens, view, pos))  # (B, V)
            took = time.perf_counter() - start if len(active) == 1 else None  # a step of its own, or shared
        logits: list[torch.Tensor | Round | Exception] = []
        for i, s in enumerate(active):
            if full[i]:
                logits.append(_attempt(lambda: self._threads.prefill(lambda: prefill(model, s.context()[:, -bs:],
                                                                                     cache.slot(i)))))
            else:
                logits.append(out[i : i + 1])
                s.filled += 1
            if s.speculator is not None:
                s.speculator.plain(None if full[i] else took)
        return logits

    def _speculate(self, s: Sequence) -> Round | None:
        """A speculative round for s, decoding alone in row 0; None where it takes a plain step instead."""
        k = s.speculator.budget(min(s.max_tokens - s.generated, self.block_size - s.filled) - 1)
        if not k:
            return None
        done = speculate(self.model, s.speculator, s.tokens[: s.length], self._cache.slot(0), s.filled, k,
                         functools.partial(self._shape, s), s.sampling.is_greedy, s.generator,
                         run=self._threads.prefill)
        if done is not None:
            s.filled += len(done.tokens)
        return done

    def _admit(self, s: Sequence, row: int) -> torch.Tensor:
        """Set up an admitted sequence and prefill its prompt into `row`; returns its first logits."""
        s.start(self.tokenizer, self.vocab_size, self.device)
        s.speculator = speculator(self.model, **self.speculation)
        bs = self.block_size
        if len(s.prompt) > bs:  # the app cuts prompts already; keep the invariant here too
            s.tokens, s.length = s.tokens[len(s.prompt) - bs :], bs
        slot = self._cache.slot(row)
        if self.prompt_cache is not None:
            s.cached = self.prompt_cache.load(s.context()[0].tolist(), slot)
        logits = self._threads.prefill(lambda: prefill(self.model, s.context()[:, s.cached:], slot, s.cached))
        s.filled = s.length
        return logits

    def _keep(self, s: Sequence, row: int) -> None:
        """Keep a finished sequence's keys and values in the prompt cache, where its row holds its tokens
        from the start (a sequence whose context slid past block_size holds only its end): all but its last
        token, as a plain step leaves them (one that ends inside a speculative round holds more)."""
        if self.prompt_cache is not None and s.filled >= s.length - 1:
            self.prompt_cache.store(s.context()[0, : s.length - 1].tolist(), self._cache.slot(row))

    def _shape(self, s: Sequence, logits: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """s's logits at R consecutive positions (R, V), shaped for the choice as the proposals drafted (m,)
        before them leave them (speculative.Shape): the vocabulary mask, logit_bias, the presence and frequency
        penalties, the grammar's mask, then the sampling settings. A plain step's is one row with no proposals."""
        x = mask_vocab(logits.float(), self.tokenizer_vocab)
        if s.bias is not None:
            x = x + s.bias
        before = [drafted[: len(drafted) - x.shape[0] + 1 + r] for r in range(x.shape[0])]  # each row's proposals
        if s.counts is not None:
            counts = torch.cat([s.counts + torch.bincount(b, minlength=s.counts.shape[1]) for b in before])
            x = x - s.frequency_penalty * counts - s.presence_penalty * (counts > 0)
        if s.matcher is not None:
            x = s.matcher.masks(x, drafted)
        if s.sampling.repetition_penalty == 1.0:  # no row's depends on what came before
            return process_logits(x, None, s.sampling)
        return torch.cat([process_logits(x[r : r + 1], torch.cat([s.context(), b.view(1, -1)], 1), s.sampling)
                          for r, b in enumerate(before)])

    def _advance(self, s: Sequence, logits: torch.Tensor, token: int | None = None) -> bool:
        """Choose s's next token from logits (1, V) (or take `token`, chosen by a round), report its text; True
        when s is finished."""
        if s.cancelled:
            return False  # dropped (and counted) at the start of the next step
        raw = mask_vocab(logits.float(), self.tokenizer_vocab)  # the logprobs reported exclude those ids too
        if token is None:
            token = int(choose(self._shape(s, logits, s.tokens[:0]), s.sampling, s.generator))
        s.append(token)
        self.counters["generated_tokens"] += 1
        if s.counts is not None:
            s.counts[0, token] += 1
        if token in s.stop_tokens:
            return self._finish(s, "stop")
        complete = s.matcher is not None and s.matcher.advance(token)
        decoded, lead = s.decoder.push_at(token)
        if s.logprobs is not None:
            s.pending.append(token_info(raw, token, s.logprobs, s.chars + lead))
        s.chars += len(decoded)
        text = s.stopper.push(decoded)
        if s.stopper.done or complete:
            return self._finish(s, "stop", text)
        if s.generated >= s.max_tokens:
            return self._finish(s, "length", text)
        if text:
            _safe_emit(s, Event(s.index, text, _sent_tokens(s, text)))
        return False

    def _finish(self, s: Sequence, reason: str, text: str = "") -> bool:
        if reason != "stop" or not s.stopper.done:
            tail = s.stopper.push(s.decoder.flush())
            if s.stopper.done:
                reason = "stop"
            text += tail + s.stopper.flush()
        tokens = _sent_tokens(s, text) if s.stopper.done else s.pending
        stats = s.speculator.stats if s.speculator is not None else None
        _safe_emit(s, Event(s.index, text, tokens, finish_reason=reason, completion_tokens=s.generated,
                            cached_tokens=s.cached, speculation=stats))
        self.counters["completed"] += 1
        return True

    def _remove(self, rows: list[int]) -> None:
        """Free these rows: the last active row moves into each gap, so rows 0..n-1 stay in use."""
        if not rows:
            return
        moves = []  # (to, from), in order: a later move may take a row an earlier one just filled
        with self._cond:
            for i in sorted(rows, reverse=True):
                last = len(self._active) - 1
                moved = self._active.pop()
                if i != last:
                    self._active[i] = moved
                    moves.append((i, last))
            self._cond.notify_all()
        # The cache is this thread's alone, so its rows move outside the lock: the event loop takes the
        # lock for every admission check, and a large model's row takes milliseconds to copy.
        for i, last in moves:
            dst, src = self._cache.slot(i), self._cache.slot(last)
            dst.k.copy_(src.k)
            dst.v.copy_(src.v)


def _attempt(fn: Callable[[], object]) -> object:
    """fn()'s result, or the Exception it raised (for errors that belong to one sequence)."""
    try:
        return fn()
    except Exception as e:  # returned, and turned into that sequence's error event
        return e


def _sent_tokens(s: Sequence, text: str) -> list[TokenInfo]:
    """The pending tokens whose text begins within what has been emitted once `text` is: a token
    whose text is still held back (it may start a stop string) stays pending, and one whose text a
    stop string cut away is never reported."""
    s.sent += len(text)
    n = sum(1 for t in s.pending if t.offset < s.sent)  # offsets only grow
    tokens, s.pending = s.pending[:n], s.pending[n:]
    return tokens


def _safe_emit(seq: Sequence, event: Event) -> None:
    """Deliver an event; a listener that is gone (its event loop closed) cancels the sequence."""
    try:
        seq.emit(event)
    except Exception:
        seq.cancelled = True
