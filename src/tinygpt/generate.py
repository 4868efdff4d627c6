"""Autoregressive generation: prefill the prompt into a KV cache, then one decode step per token.

The plain loop (`use_cache=False`) is the lesson's: run the model on the last block_size tokens,
take the last position's logits, choose, append. The cached loop gives the same tokens. Once a
sequence outgrows block_size every position shifts, so the cache is rebuilt from the last
block_size tokens at each step, exactly the context the plain loop sees.

`compile=True` runs the decode steps through torch.compile (compiled_decode_step), as gpt-fast
decodes: one graph for every position, replayed as a CUDA graph on a GPU.
"""

from __future__ import annotations

import functools
import operator
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from . import fastpath, speculative
from .config.sampling import SampleConfig
from .constrain import Constraint, Rows, compile_grammar
from .device import free_cores
from .errors import ConfigError
from .interop import quantize
from .kv_cache import KVCache
from .prompt_cache import PromptCache
from .sampling import choose, process_logits
from .speculative import SpeculationStats
from .tokenizer.base import Tokenizer


def prefill(model, idx: torch.Tensor, kv_cache: KVCache, start: int = 0) -> torch.Tensor:
    """Run the prompt idx (B, T) at positions start..start+T-1, filling the cache. Returns the last logits (B, V).

    A short prompt on a CPU takes `fastpath.prompt`, one call for the whole forward pass; `start` > 0
    continues a cache whose first positions hold the prompt's beginning (a prompt cache's).
    """
    logits = fastpath.prompt(model, idx, kv_cache, start)
    if logits is not None:
        return logits
    positions = torch.arange(start, start + idx.shape[1], device=idx.device)
    return model(idx, kv_cache, positions, last_only=True)[:, -1]


def decode_step(model, token: torch.Tensor, kv_cache: KVCache, pos: int | torch.Tensor) -> torch.Tensor:
    """Run one new token per row, token (B,), at position `pos` (an int or a (B,) tensor). Returns logits (B, V).

    Rows on a CPU take `fastpath.step`, the same arithmetic in fewer operators (one call where the model
    has a DecodePlan, each row's logits then those of a step that decodes it alone).
    """
    if fastpath.applies(model, token, kv_cache, pos):
        return fastpath.step(model, token, kv_cache, pos)
    return _step(model, token, kv_cache, _positions(pos, token.device))


def compiled_decode_step(model, token: torch.Tensor, kv_cache: KVCache, pos: int | torch.Tensor) -> torch.Tensor:
    """decode_step through torch.compile, as gpt-fast decodes: one graph serves every position (the
    position is a tensor input, and the cache is read whole, masked: KVCache.span under the compiler),
    and on a GPU it is replayed as a CUDA graph (mode "reduce-overhead"), a whole step one launch
    instead of a few hundred kernels each waiting on Python. The first step of a model shape, dtype and
    batch compiles (seconds on a GPU, tens of seconds on a CPU); the logits are the eager step's to float
    rounding. Returns logits (B, V) of the caller's own (a CUDA graph's output is overwritten by its next replay).
    """
    for buffer in (kv_cache.k, kv_cache.v):
        # written in place by every step: a CUDA graph may keep their addresses rather than copy them in
        # and out (unguarded: a new cache of the same shape reuses the graph instead of recompiling)
        torch._dynamo.mark_static_address(buffer, guard=False)
    if token.device.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()  # each step is a new replay; the last one's output is ours
    step = _compiled_step(token.device.type)
    # a column of the tokens so far has a stride of their length, a new one at every step: a copy with the
    # standard stride keeps one graph (contiguous() would not copy a single row, already contiguous)
    token = token.clone(memory_format=torch.contiguous_format)
    return step(model, token, kv_cache, _positions(pos, token.device)).clone()


def _positions(pos: int | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A step's positions as the model takes them: (1,) for rows at one position, (B, 1) for a position per row."""
    return torch.tensor([pos], device=device) if isinstance(pos, int) else pos.view(-1, 1)


def _step(model, token: torch.Tensor, kv_cache: KVCache, positions: torch.Tensor) -> torch.Tensor:
    return model(token.view(-1, 1), kv_cache, positions)[:, -1]


@functools.cache
def _compiled_step(device_type: str):
    # CUDA graphs where there are any; static shapes: a decode step's never change
    return torch.compile(_step, mode="reduce-overhead" if device_type == "cuda" else None, dynamic=False)


class ThreadChoice:
    """How many threads a CPU's decode steps run on, chosen as they go from what the machine allows.

    A decode step is a few hundred short parallel regions, each ending when its slowest thread is done.
    On a quiet machine more threads stream the weights faster; when another program holds a core, a
    region waits for the thread that core's scheduler has set aside, and a step on two threads was
    measured 10 to 100 times slower than on one on a loaded 2-core machine (issue 40). What the machine
    is doing changes while a reply is written, so every `every` steps a look counts the cores no other
    program is using (device.free_cores): with one, the steps run on one thread until the next look;
    with more, `steps` steps run on one thread, then as many on those cores, and the faster (the best
    step of each counts: the first after a switch wakes or parks threads) decodes until the next look,
    twice as far away if one thread won again (up to `longest`). A step on many threads that takes
    twice one thread's best ends the look there. A prompt's forward pass (`prefill`) runs on the threads
    chosen last, one from the start where another program holds a core: a 16-token prompt to a
    SmolLM2-135M-shaped model took 2.7-5.3 s on two threads there, against 0.06-0.2 s on one.

    A timed look's verdict is kept for `model` (any object, the generating model) for `remember` seconds:
    the next call's looks, with as many cores free, take it instead of timing again (a chat's replies, a
    benchmark's rounds), since a look's steps on one thread cost a quiet machine 2-5% of a 64-token reply.

    Where `enabled` is False (an accelerator, compiled steps) or torch has one thread, `run` and `prefill`
    call what they are given as it is.
    """

    # model -> (cores timed, threads chosen, when): the verdicts of timed looks
    verdicts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, model=None, *, enabled: bool = True, every: int = 64, steps: int = 3, longest: int = 1024,
                 remember: float = 60.0) -> None:
        self.model, self.remember = model, remember
        self.threads = self.current = self.choice = torch.get_num_threads()
        self.enabled = enabled and self.threads > 1
        self.every, self.steps, self.longest = every, steps, longest
        self.interval = every
        self.look = 0  # the step the next look starts at
        self.count = 0
        self.trial = self.threads  # the many threads a look times against one
        self.best: dict[int, float] = {}
        if self.enabled and free_cores() == 1:
            self.choice = 1

    def run(self, step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """step() on the threads chosen for it, timed while it is part of a look."""
        if not self.enabled:
            return step()
        i = self.count - self.look  # this step's place in the look, or before it
        self.count += 1
        if i == 0:
            free = free_cores()
            self.trial = min(self.threads, free if free is not None else self.threads)
            kept = self.verdicts.get(self.model) if self.model is not None else None
            if self.trial == 1:
                self._chose(1, cheap=True)
                i = -1
            elif kept is not None and kept[0] == self.trial and time.monotonic() - kept[2] < self.remember:
                self._chose(kept[1], cheap=True)
                i = -1
        if i < 0:
            self._use(self.choice)
            return step()
        threads = 1 if i < self.steps else self.trial
        self._use(threads)
        start = time.perf_counter()
        out = step()
        took = time.perf_counter() - start
        self.best[threads] = min(took, self.best[threads]) if i % self.steps else took
        if i == 2 * self.steps - 1 or (threads > 1 and took > 2 * self.best[1]):
            verdict = min(self.best, key=self.best.get) if i == 2 * self.steps - 1 else 1
            self._chose(verdict)
            if self.model is not None:
                self.verdicts[self.model] = (self.trial, verdict, time.monotonic())
        return out

    def prefill(self, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """forward() (a prompt's forward pass) on the threads chosen last."""
        self._use(self.choice)
        return forward()

    def _chose(self, threads: int, cheap: bool = False) -> None:
        # a look that timed many threads and found one faster waits longer for the next: those steps cost
        again = not cheap and threads == 1 and self.choice == 1
        self.interval = min(2 * self.interval, self.longest) if again else self.every
        self.choice = threads
        self.look = self.count + self.interval

    def _use(self, threads: int) -> None:
        if threads != self.current:
            torch.set_num_threads(threads)
            self.current = threads

    def restore(self) -> None:
        """Put torch's thread count back as it was."""
        self._use(self.threads)


def _cache_len(block_size: int, prompt: int, max_new_tokens: int, compile: bool) -> int:
    """Positions a call's KV cache holds: what the call can fill (prompt and new tokens, up to block_size),
    not block_size whatever it needs. A fresh buffer is zeroed page by page, and a block_size one costs
    more than the decode it serves: 85-95 ms for GPT-2 small's 72 MiB at 1,024 positions on the shared
    AMD EPYC Zen 5, 15% of a 64-token generation, 0.05 ms at the 80 a 16-token prompt and 64 new
    tokens fill. Compiled steps keep block_size: their graph is built for the cache's shape, one for
    every call."""
    return block_size if compile else min(block_size, prompt + max_new_tokens)


def _check_inputs(model, idx: torch.Tensor, max_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens: must be an integer >= 0, got {max_new_tokens!r}")
    if not isinstance(idx, torch.Tensor):
        raise ConfigError(f"idx: expected a tensor of token ids of shape (B, T), got a {type(idx).__name__} "
                          "(torch.tensor([ids]) makes one row)")
    if idx.dim() != 2 or idx.shape[1] == 0 or idx.dtype not in (torch.int64, torch.int32):
        raise ConfigError(f"idx: expected integer token ids of shape (B, T) with T >= 1, got {tuple(idx.shape)} "
                          f"{idx.dtype}")
    vocab = model.config.vocab_size
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= vocab):
        raise ConfigError(f"idx: token ids must be in [0, {vocab}), got {int(idx.min())}..{int(idx.max())}")


def _stop_ids(stop_tokens: Iterable[int] | None) -> list[int]:
    """stop_tokens as a sorted list of ids. A string is refused rather than read as its characters,
    and a single id rather than failing as not iterable."""
    if stop_tokens is None:
        return []
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Iterable):
        raise ConfigError(f"stop_tokens: expected a collection of token ids, got {stop_tokens!r}")
    ids = set()
    for token in stop_tokens:
        if not isinstance(token, bool):
            try:
                ids.add(operator.index(token))  # ints, and numpy's or torch's integer scalars
                continue
            except TypeError:
                pass
        raise ConfigError(f"stop_tokens: expected integer token ids, got {token!r}")
    return sorted(ids)


@dataclass
class StepTrace:
    """One generation step as an observer of `generate_stream` sees it (`tinygpt sample --trace`)."""

    step: int  # 0-based
    context: torch.Tensor  # (B, T_ctx) ids the prediction is conditioned on: the last block_size tokens
    logits: torch.Tensor  # (B, V) the model's raw next-token logits
    processed: torch.Tensor  # (B, V) after the vocabulary mask, penalty, temperature, top-k, top-p
    token: torch.Tensor  # (B,) the token appended (a row that already stopped repeats its stop token)
    config: SampleConfig
    drafted: bool = False  # speculating: the token was proposed, and the model kept it
    speculation: SpeculationStats | None = None  # speculating: the sequence's figures so far (they keep counting)


class _Ends:
    """Which rows of a batch have ended, at a stop token or where their grammar is complete, and the token
    each repeats from then on (its stop token; after a grammar, the first stop token, or its last token
    where there is none) until every row has ended."""

    def __init__(self, stops: torch.Tensor, rows: Rows | None, batch: int) -> None:
        self.stops, self.rows = stops, rows
        self.on = bool(stops.numel()) or rows is not None
        self.finished = torch.zeros(batch, dtype=torch.bool, device=stops.device)
        self.last = torch.zeros_like(self.finished, dtype=torch.long)

    def follow(self, token: torch.Tensor) -> torch.Tensor:
        """The tokens (B,) to append: each ended row's repeat in place of its choice."""
        if not self.on:
            return token
        token = torch.where(self.finished, self.last, token)
        hit = torch.isin(token, self.stops) & ~self.finished
        last = torch.where(hit, token, self.last)
        if self.rows is not None:
            done = self.rows.advance(token, ~self.finished & ~hit)
            last = torch.where(done, self.stops[0] if self.stops.numel() else token, last)
            hit |= done
        self.last = last
        self.finished |= hit
        return token

    def all(self) -> bool:
        return self.on and bool(self.finished.all())


def _rows(model, idx: torch.Tensor, tokenizer: Tokenizer | None, stops: list[int],
          constraint: Constraint | None) -> Rows | None:
    """A grammar's matchers for every row of idx, or None without a constraint."""
    if constraint is None:
        return None
    if tokenizer is None:
        raise ConfigError(f"{constraint.kind}: a constraint is compiled for a vocabulary; pass tokenizer=")
    return Rows(compile_grammar(tokenizer, constraint, model.config.vocab_size, frozenset(stops)), idx.shape[0])


@torch.inference_mode()
def generate_stream(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    stop_tokens: Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    observer: Callable[[StepTrace], None] | None = None,
    vocab_size: int | None = None,
    compile: bool = False,
    tokenizer: Tokenizer | None = None,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    choices: list[str] | None = None,
    prompt_cache: PromptCache | None = None,
    draft=None,
    speculate: int | None = None,
    prompt_lookup: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, (B,), as soon as it is chosen. Arguments as `generate`."""
    cfg = SampleConfig(
        temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=repetition_penalty, greedy=greedy
    )
    _check_inputs(model, idx, max_new_tokens)
    _check_options(vocab_size, use_cache, compile, model, idx, prompt_cache)
    block_size = model.config.block_size
    idx = idx.long()
    cache_len = _cache_len(block_size, idx.shape[1], max_new_tokens, compile)
    stop_ids = _stop_ids(stop_tokens)
    rows = _rows(model, idx, tokenizer, stop_ids, Constraint.given(json_schema, regex, choices))
    spec = _speculation(model, idx, use_cache, compile, cache_len, vocab_size, draft, speculate, prompt_lookup)
    ends = _Ends(torch.tensor(stop_ids, dtype=torch.long, device=idx.device), rows, idx.shape[0])
    tokens = idx
    # on a CPU, the decode steps' thread count follows what the machine allows
    threads = ThreadChoice(model, enabled=use_cache and not compile and idx.device.type == "cpu")
    decoder = _Decoder(model, cfg, generator, vocab_size, KVCache.for_model(model, idx.shape[0], cache_len)
                       if use_cache else None, threads, compiled_decode_step if compile else decode_step, spec, rows,
                       ends, prompt_cache)
    training = model.training
    model.eval()  # dropout off: greedy and seeded sampling repeat, with and without the cache
    try:
        produced = 0
        while produced < max_new_tokens:
            for logits, processed, token, drafted in decoder.next(tokens, max_new_tokens - produced):
                token = ends.follow(token)
                if observer is not None:
                    observer(StepTrace(produced, tokens[:, -block_size:], logits, processed, token, cfg, drafted,
                                       spec.stats if spec is not None else None))
                tokens = torch.cat([tokens, token.unsqueeze(1)], dim=1)
                produced += 1
                yield token
                if ends.all():
                    return
    finally:
        decoder.keep(tokens)
        threads.restore()
        model.train(training)


def _check_options(vocab_size: int | None, use_cache: bool, compile: bool, model, idx: torch.Tensor,
                   prompt_cache: PromptCache | None) -> None:
    if vocab_size is not None and not (isinstance(vocab_size, int) and not isinstance(vocab_size, bool)
                                       and 1 <= vocab_size):
        raise ConfigError(f"vocab_size: must be an integer >= 1, got {vocab_size!r}")
    if compile and not use_cache:
        raise ConfigError("compile: compiles the decode steps with the KV cache; use_cache=False has none")
    if compile and quantize.on_cpu_kernels(model):
        raise ConfigError("compile: this model's layers run on CPU kernels torch.compile cannot trace (tinygpt.quantize "
                          "converts a model on a CPU for them, which decode faster there than a compiled graph)")
    if prompt_cache is not None and (idx.shape[0] != 1 or not use_cache or compile):
        raise ConfigError("prompt_cache: reuses one sequence's keys and values: one row, with the KV cache, eager")


def _speculation(model, idx: torch.Tensor, use_cache: bool, compile: bool, cache_len: int, vocab_size: int | None,
                 draft, speculate: int | None, prompt_lookup: int | None) -> speculative.Speculator | None:
    """generate's speculation arguments as a Speculator (None without them), checked."""
    spec = speculative.speculator(model, draft=draft, speculate=speculate, prompt_lookup=prompt_lookup,
                                  max_len=cache_len, vocab_size=vocab_size)
    if spec is None:
        return None
    what = "draft" if draft is not None else "prompt_lookup"
    if idx.shape[0] != 1:
        raise ConfigError(f"{what}: speculation decodes one sequence at a time; idx has {idx.shape[0]} rows "
                          "(generate each on its own)")
    if not use_cache or compile:
        raise ConfigError(f"{what}: speculation verifies the proposals on the KV cache, in eager mode: "
                          f"{'use_cache=False' if not use_cache else 'compile=True'} has no such step")
    return spec


class _Decoder:
    """generate_stream's model calls: from the tokens so far, the next token of every row, or where a sequence
    speculates, the next few (the proposals that stood, then the model's own).

    Args:
        model, cfg, generator, vocab_size: generate_stream's model, sampling settings and their arguments.
        kv_cache: the rows' cache; None: the whole context again at every step.
        threads: the CPU threads of the steps and prompts.
        decode: the decode step (decode_step or compiled_decode_step).
        spec: the sequence's speculation, or None.
        rows: a grammar's matchers for the rows, or None.
        ends: which rows have ended (their grammar is not applied again).
        prompt_cache: where the prompt's prefix is looked up and the sequence kept, or None.
    """

    def __init__(self, model, cfg: SampleConfig, generator: torch.Generator | None, vocab_size: int | None,
                 kv_cache: KVCache | None, threads: ThreadChoice, decode, spec: speculative.Speculator | None,
                 rows: Rows | None, ends: _Ends, prompt_cache: PromptCache | None) -> None:
        self.model, self.cfg, self.generator, self.vocab_size = model, cfg, generator, vocab_size
        self.kv_cache, self.threads, self.decode, self.spec = kv_cache, threads, decode, spec
        self.rows, self.ends, self.prompt_cache = rows, ends, prompt_cache
        self.filled = 0  # positions of the cache that hold the current context: all of it but its last token
        self.slid = False  # the context slid past block_size (the cache then holds not the start but the end)

    def next(self, tokens: torch.Tensor, left: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]]:
        """(raw logits (B, V), processed (B, V), token (B,), proposed) of each token chosen after tokens (B, T),
        with `left` tokens still to generate."""
        model, block_size, spec = self.model, self.model.config.block_size, self.spec
        if self.kv_cache is None:  # the reference: the whole context again at every step
            return [self._choose(model(tokens[:, -block_size:])[:, -1], tokens)]
        if not 0 < self.filled < block_size:  # the first step, or the context slid past block_size: (re)build
            context = tokens[:, -block_size:]
            self.slid = self.filled > 0 or tokens.shape[1] > block_size
            # a prompt cache fills the positions an earlier sequence shares with the prompt
            start = self.prompt_cache.load(context[0].tolist(), self.kv_cache) \
                if self.prompt_cache is not None and not self.slid else 0
            logits = self.threads.prefill(lambda: prefill(model, context[:, start:], self.kv_cache, start))
            if self.filled and spec is not None:
                spec.plain(None)
            self.filled = context.shape[1]
            return [self._choose(logits, tokens)]
        k = spec.budget(min(left, self.kv_cache.max_len - self.filled) - 1) if spec is not None else 0
        if k:
            shape = functools.partial(self._shape, tokens)
            done = speculative.speculate(model, spec, tokens[0], self.kv_cache, self.filled, k, shape,
                                         self.cfg.is_greedy, self.generator, run=self.threads.prefill)
            if done is not None:
                self.filled += len(done.tokens)
                last = len(done.tokens) - 1
                return [(done.logits[i : i + 1], done.processed[i : i + 1], tokens.new_tensor([t]), i < last)
                        for i, t in enumerate(done.tokens)]
        start = time.perf_counter()
        token = tokens[:, -1]
        logits = self.threads.run(lambda: self.decode(model, token, self.kv_cache, self.filled))
        self.filled += 1
        chosen = self._choose(logits, tokens)
        if spec is not None:
            spec.plain(time.perf_counter() - start)
        return [chosen]

    def _shape(self, tokens: torch.Tensor, logits: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """speculative.Shape for a sequence of tokens (1, T): each row as a plain step would process it, a grammar's
        mask the one its state after the proposals before the row allows."""
        if self.rows is not None:
            logits = self.rows.matchers[0].masks(logits, drafted)
        if self.cfg.repetition_penalty == 1.0:  # the history does not enter: every row at once
            return process_logits(logits, None, self.cfg, self.vocab_size)
        first = len(drafted) - logits.shape[0] + 1
        return torch.cat([process_logits(logits[r : r + 1], torch.cat([tokens, drafted[: first + r].view(1, -1)], 1),
                                         self.cfg, self.vocab_size) for r in range(logits.shape[0])])

    def _choose(self, logits: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                           bool]:
        masked = logits if self.rows is None else self.rows.mask(logits, self.ends.finished)
        processed = process_logits(masked, tokens, self.cfg, self.vocab_size)
        return logits, processed, choose(processed, self.cfg, self.generator), False

    def keep(self, tokens: torch.Tensor) -> None:
        """Keep the sequence, tokens (1, T), in the prompt cache, where the cache holds it from its start: all
        but its last token, as a plain step leaves it (one that ends inside a speculative round holds more)."""
        if self.prompt_cache is not None and self.filled and not self.slid:
            self.prompt_cache.store(tokens[0, : min(self.filled, tokens.shape[1] - 1)].tolist(), self.kv_cache)


def generate(
    model,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    greedy: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    stop_tokens: Iterable[int] | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    observer: Callable[[StepTrace], None] | None = None,
    vocab_size: int | None = None,
    compile: bool = False,
    tokenizer: Tokenizer | None = None,
    json_schema: dict | str | None = None,
    regex: str | None = None,
    choices: list[str] | None = None,
    prompt_cache: PromptCache | None = None,
    draft=None,
    speculate: int | None = None,
    prompt_lookup: int | None = None,
) -> torch.Tensor:
    """Extend every row of idx (B, T) by up to max_new_tokens tokens; returns (B, T + n).

    Args:
        model: a tinygpt GPT. It generates in eval mode (no dropout), and is put back in the mode
            it was in when the tokens are done.
        idx: prompt token ids (B, T); rows share one length. Prompts longer than block_size are
            seen through their last block_size tokens, as the lesson's loop does.
        max_new_tokens: how many tokens to add (n < max_new_tokens only when every row hit a stop token).
        greedy: argmax decoding (temperature=0 means the same).
        temperature, top_k, top_p, repetition_penalty: see SampleConfig.
        stop_tokens: ids that end a row. The stop token is kept; rows that stop early repeat it
            until every row has stopped or max_new_tokens is reached.
        generator: a seeded torch.Generator makes sampling reproducible.
        use_cache: decode with a KV cache (True) or rerun the whole context each step (the reference).
        observer: called at every step with a StepTrace (context, raw and processed logits, the
            token chosen) before the token is yielded; None costs nothing.
        vocab_size: the tokenizer's vocabulary size (`tokenizer.vocab_size`): ids at or past it are
            never chosen, for a model whose vocabulary is padded past its tokenizer's. None: any id.
        compile: decode through torch.compile (compiled_decode_step; CUDA graphs on a GPU): the first
            call for a shape compiles, later steps cost a fraction of eager ones where Python's
            per-operator time dominates (small models, a GPU). Needs use_cache.
        tokenizer: the model's tokenizer, which a constraint is compiled for.
        json_schema, regex, choices: at most one: what the new tokens must write (a JSON Schema as a dict
            or its JSON; a regular expression the whole text matches; one of a list of strings). Each step
            chooses among the tokens the grammar allows (tinygpt.constrain), and a row ends where its
            grammar is complete (or at a stop token, which the grammar allows once it is). JSON is written
            with json.dumps' separators and no other whitespace.
        prompt_cache: a PromptCache (one row, use_cache, not compile): the prompt reuses the keys and values
            of the longest prefix it shares with a sequence generated before, and this one is kept in it.
        draft: a smaller model of the same vocabulary that proposes tokens for the model to verify, several
            in one forward pass (speculative decoding, tinygpt.speculative): the output is the one plain
            decoding gives, token for token, greedy or sampled with the same generator. One row (B = 1),
            with the cache, eager. A draft at least as large as the model is logged as a warning.
        speculate: the most tokens a round proposes (8; from 1 to 16, or to 8 for int8 and int4 weights);
            fewer where the proposals keep falling. Speculation steps aside for a while where it measures
            itself slower than plain steps.
        prompt_lookup: n: propose, instead of a draft, the tokens that followed the latest earlier
            occurrence of the text's last n tokens, in the prompt or the text generated since (the same
            verification and guarantees; pays where the reply repeats its input: editing, summaries, code).

    Raises:
        ConfigError: an argument out of range or of the wrong type.
        GrammarError: a constraint that does not compile, or that the vocabulary cannot write.
    """
    new = list(generate_stream(
        model, idx, max_new_tokens, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
        repetition_penalty=repetition_penalty, stop_tokens=stop_tokens, generator=generator, use_cache=use_cache,
        observer=observer, vocab_size=vocab_size, compile=compile, tokenizer=tokenizer, json_schema=json_schema,
        regex=regex, choices=choices, prompt_cache=prompt_cache, draft=draft, speculate=speculate,
        prompt_lookup=prompt_lookup))
    if not new:
        return idx.clone()
    return torch.cat([idx.long(), torch.stack(new, dim=1)], dim=1)


class StopText:
    """Cuts streamed text at the first of some stop strings.

    `push(chunk)` returns the text that is safe to show: text that might be the beginning of a
    stop string is held back until the next chunk settles it. `done` turns True once a stop string
    appears; the stop string itself and anything after it are dropped.
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.done = False

    def push(self, chunk: str) -> str:
        if self.done:
            return ""
        self.pending += chunk
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.done = True
            out, self.pending = self.pending[: min(hits)], ""
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        out = self.pending[: len(self.pending) - hold]
        self.pending = self.pending[len(out) :]
        return out

    def flush(self) -> str:
        out, self.pending = ("" if self.done else self.pending), ""
        return out
