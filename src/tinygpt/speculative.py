"""Speculative decoding: several tokens for one read of the target model's weights.

A drafter proposes up to k tokens after the text so far: a smaller draft model of the same vocabulary,
on a KV cache of its own (DraftModel), or the tokens that followed the latest earlier occurrence of the
text's last n tokens, in the prompt or in what was generated since (PromptLookup: no model, llama.cpp's
lookup decoding and transformers' `prompt_lookup_num_tokens`). The target then reads the last token and
the k proposals in one forward pass of k + 1 rows (`verify`: on a CPU one call into its DecodePlan, each
row's logits bit for bit those of a step that decodes it alone), and `judge` keeps the longest run of
proposals it agrees with and one token of its own after them:

- greedy: a proposal stands while it is the target's argmax; the first that is not is replaced by the
  argmax, and when all stand the argmax after them is added. The text is the target's greedy text.
- sampling: each verified position's token is drawn from the target's distribution p (after the vocabulary
  mask, penalties, temperature, top-k and top-p, as `sampling.process_logits` shapes it) with the random
  numbers a plain step at that position would draw (`Draws`: torch.multinomial's exponential race, the
  generator's numbers taken position by position), and a proposal stands while it is that token. The text
  is then the one plain sampling gives with the same generator, token for token, whatever the rounds
  decided and whenever speculation stepped aside. A draft draws its proposals from its own distribution q
  with the same numbers (the Gumbel-max coupling, drafter-invariant speculative decoding: Daliri et al.,
  2024), so it proposes the target's token where q is near p: a proposal stands with probability at least
  (1 - t) / (1 + t), t the distance between p and q, where rejection sampling's min(1, p / q) keeps 1 - t
  but draws other tokens than plain sampling does. A lookup's proposal d stands with probability p(d), as
  under rejection sampling.

Both caches then roll back to what stood: their positions past it hold refused tokens' keys and values,
which no query reads before the next tokens overwrite them.

A `Speculator` is one sequence's speculation: its drafter, the tokens it proposes (k, up to the most it
was given: the number that gives the most tokens for the time by the acceptance and the costs it measured)
and whether to speculate at all. It times its rounds against plain steps and steps aside where a round's
tokens cost more than plain steps would, at once where two rounds in a row kept none of their proposals
(a retry then ends after one such round), and at once where its ledger, the draft's reading counted, shows
the reply slower than without it by more than 4 steps and 1% of its time: for 8 tokens the first time, four
times as many each time it loses again (after a trial that kept nothing, until the reply may lose as much
again). While it is aside a draft reads nothing; a retry catches it up. `generate_stream` (the library,
`tinygpt sample` and `chat`) and the server's scheduler both decode through `speculate`.

A constraint on the tokens (a grammar's mask: structured output, tool calls) is in the caller's `shape`,
which is given each verified position's logits with the proposals before it: the mask there is the one the
grammar allows after those proposals (constrain.Matcher.masks takes them and gives them back), so a
proposal the grammar refuses falls as any other, and the grammar then follows the tokens that stood only,
as the caches roll back.
"""

from __future__ import annotations

import logging
import statistics
import time
import weakref
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import fastpath
from .calc import count_params
from .errors import ConfigError
from .interop import quantize
from .kv_cache import KVCache
from .sampling import choose_with, noise

log = logging.getLogger(__name__)

DEFAULT_TOKENS = 8  # proposals a round makes at most, unless told otherwise (transformers' lookup: 10)
# proposals of the first round: a draft that misses wastes little finding out (verifying 5 rows of an int8 model
# costs 2.2 of its steps on the Zen 3, 2 rows about 1.3), and one that hits gets its k from the next round on
START_TOKENS = 1
# plain tokens after speculation first loses, four times as many each time it loses again: short, since a draft that
# pays may miss at a hard spot (the first tokens after a prompt cut mid-line); a retry costs a never-right draft a round
FIRST_PAUSE, LONGEST_PAUSE = 8, 1024
TRIAL_ROUNDS = 4  # rounds that decide whether speculation pays at the start
RETRY_ROUNDS = 2  # and after a pause: fewer, since it lost before
# rounds in a row of which no proposal stood that end a trial there (the retry after them: its first round): such a
# round gives the one token a plain step gives, for a verification of two rows or more and the draft's steps
EMPTY_ROUNDS = 2
# plain steps timed before the first round, the fastest weighing rounds: the first 4-5 after a prompt's pass are
# slower (benchmarks/speculative.py's int8 target, Zen 3: 0.7-1.3 ms, then 0.47-0.55): losing rounds looked paying
PLAIN_PROBES = 6
# rounds between two timings of plain steps: the steps that weigh a round's time are then the latest, on the threads
# the rounds run on. Each timing is of PLAIN_RUN plain steps in a row, since the first after a round is slower too
PLAIN_EVERY = 8
PLAIN_RUN = 2
GLANCE = 16  # tokens a draft reads of the text before speculation pays (DraftModel): one call into its DecodePlan
WHOLE_SHARE = 1 / 8  # a draft of at most this share of the target's parameters reads the whole text once it pays
# the most tokens a draft reads in 16-row calls into its DecodePlan, not one forward pass, whose fixed cost is most of a
# short read's (benchmarks/speculative.py's 3 x 128 draft, Zen 3: 34 tokens 4.1 ms in one pass, 1.9 in 16-row calls)
CHUNKED_READ = 4 * fastpath.PROMPT_ROWS
# what a reply may lose to speculation (Speculator.headroom): STAKE plain steps (a first trial: a glance and a round or
# two, 3.6 steps for benchmarks/speculative.py's int4 target with a never-right draft on the Zen 3) and LOSS_SHARE of
# its tokens' steps, which pays for retries (one after a trial that kept nothing, once it may lose as much again)
STAKE, LOSS_SHARE = 4, 0.01
DECAY = 0.8  # how much an earlier round's proposals still count in the acceptance, per round since

# (logits (R, V) at R consecutive positions, the proposals drafted (m,) with m >= R - 1) -> the logits a token is
# chosen from at each (R, V): row r's position follows the sequence and drafted[: m - R + 1 + r]
Shape = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def most_tokens(model) -> int:
    """The most tokens a draft may propose for `model`, by its weight format: its Linear layers' kernel takes
    16 rows of float32, float16 or bfloat16 weights at a time, 8 of int8 or int4 (quantize's row limits)."""
    if quantize.weight_format(model) in ("int8", "int4"):
        return quantize.INT8_KERNEL_ROWS
    return quantize.FLOAT_KERNEL_ROWS


def check_tokens(model, k: int, flag: str = "speculate") -> int:
    """k (the most tokens a round proposes), checked against the model's format; returns it.

    Raises:
        ConfigError: k not an integer from 1 to most_tokens(model).
    """
    most = most_tokens(model)
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= most:
        raise ConfigError(f"{flag}: a round proposes 1 to {most} tokens for this {quantize.weight_format(model)} "
                          f"model (its kernels verify up to {most} + 1 rows in one read of the weights), got {k!r}")
    return k


def draft_warning(target, draft) -> str | None:
    """Why a draft cannot pay, with the figures: its step reads as many bytes of weights as the target's, or more
    (what a step costs where the weights stream from memory; a draft may be the target in fewer bits). None where
    it reads fewer."""
    big, small = weight_bytes(target), weight_bytes(draft)
    if small < big:
        return None
    counts = [count_params(m.config).total for m in (draft, target)]
    return (f"the draft reads {small / 1e6:,.1f} MB of weights a step ({counts[0]:,} parameters), the target "
            f"{big / 1e6:,.1f} MB ({counts[1]:,}): a draft at least as large as its target costs more to run than "
            "the target steps it saves")


def weight_bytes(model) -> int:
    """The bytes of the Linear layers' weights a decode step reads, in the format they are stored in."""
    total = 0
    for m in model.modules():
        if hasattr(m, "nbytes"):  # quantize's layers say what their forward reads
            total += m.nbytes
        elif isinstance(m, torch.nn.Linear):
            total += sum(p.numel() * p.element_size() for p in m.parameters(recurse=False))
    return total


def vocabulary_mismatch(tokenizer, draft_tokenizer) -> str | None:
    """Why a draft's tokenizer is not the model's (a vocabulary of another size, or an id that stands for other
    bytes), in words; None where every id is the same token to both."""
    if set(tokenizer.fingerprints()) & set(draft_tokenizer.fingerprints()):
        return None
    ours, theirs = tokenizer.vocab_size, draft_tokenizer.vocab_size
    if ours != theirs:
        return (f"its tokenizer ({draft_tokenizer.describe()}) is not the model's ({tokenizer.describe()}): a draft "
                "must share the model's vocabulary and ids")
    for i in range(ours):
        a, b = tokenizer.decode_bytes([i]), draft_tokenizer.decode_bytes([i])
        if a != b:
            return (f"its tokenizer is not the model's: id {i} is {b!r} to the draft and {a!r} to the model (a draft "
                    "must share the model's vocabulary and ids)")
    return None


_warned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafts already warned about, by target
# draft -> seconds a token of its latest read in one forward pass: a whole text's price (a glance's is 1.3-1.6x it)
_long_reads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class SpeculationStats:
    """What speculation did for a sequence (or, added up, for several)."""

    rounds: int = 0  # target calls that verified proposals
    drafted: int = 0  # tokens proposed to them
    accepted: int = 0  # proposals the target kept
    plain: int = 0  # tokens of plain steps: no proposal, or speculation set aside

    @property
    def acceptance(self) -> float | None:
        """The share of proposed tokens that stood, or None before any proposal."""
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens(self) -> int:
        """Tokens given (a round gives what stood and one more, a plain step one), the prompt's aside."""
        return self.accepted + self.rounds + self.plain

    @property
    def tokens_per_step(self) -> float | None:
        """Tokens per target call, the prompt's aside."""
        steps = self.rounds + self.plain
        return self.tokens / steps if steps else None

    def add(self, other: SpeculationStats) -> None:
        """Count another sequence's figures in these."""
        self.rounds += other.rounds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.plain += other.plain

    def to_dict(self) -> dict:
        """The figures as the server's usage reports them (rates rounded to 4 places, None before any)."""
        rate, per_step = self.acceptance, self.tokens_per_step
        return {"rounds": self.rounds, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "plain_steps": self.plain, "acceptance_rate": None if rate is None else round(rate, 4),
                "tokens_per_step": None if per_step is None else round(per_step, 4)}

    def describe(self) -> str:
        """One line: "40 of 52 proposed tokens accepted (77%), 2.91 tokens per target step"."""
        if not self.drafted:
            return f"no tokens proposed ({self.plain} plain steps)"
        return (f"{self.accepted} of {self.drafted} proposed tokens accepted ({self.acceptance:.0%}), "
                f"{self.tokens_per_step:.2f} tokens per target step")


class PromptLookup:
    """Proposals from the text itself: the tokens that followed the latest earlier occurrence of the text's
    last n tokens (in the prompt or in what was generated since), as many as asked: where the occurrence
    is closer to the end than that, the text from it repeats. Costs a dictionary look-up a round.

    Args:
        n: how many of the last tokens must match (>= 1).
    """

    def __init__(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"prompt_lookup: the n-gram to look up must be an integer >= 1, got {n!r}")
        self.n = n
        self.text: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n tokens -> where the token after their latest occurrence is

    def propose(self, tokens: torch.Tensor, k: int, shape: Shape, draws: Draws | None) -> torch.Tensor:
        """Up to k proposals after tokens (T,), the whole sequence so far (no draws: they are not drawn)."""
        seen = len(self.text)
        self.text += tokens[seen:].tolist()  # the text only grows: what was proposed and refused never entered it
        n, text = self.n, self.text
        for end in range(max(n, seen), len(text)):
            self.follows[tuple(text[end - n : end])] = end
        at = self.follows.get(tuple(text[-n:])) if len(text) >= n else None
        found: list[int] = []
        for i in range(k if at is not None else 0):
            # an occurrence that ends near the text's end continues as the text went on from it: the
            # proposals repeat with the same period (a run of one token proposes more of it)
            found.append(text[at + i] if at + i < len(text) else found[at + i - len(text)])
        return torch.tensor(found, dtype=torch.long, device=tokens.device) if found else tokens.new_empty(0)

    def prepare(self, tokens: torch.Tensor, spend: float = 0.0) -> None:
        """Nothing to read ahead: the look-up indexes the text as it proposes."""

    def rollback(self, length: int) -> None:
        """Nothing to undo: the lookup holds only the text that stood."""


class DraftModel:
    """Proposals from a smaller model of the same vocabulary, decoding on a KV cache of its own: greedy for
    greedy decoding, else drawn from its logits shaped as the target's are (its distribution q), with the
    random numbers of each proposal's position (Draws).

    Until speculation pays (a trial's rounds, the first or a retry's after a pause), the draft glances: it reads
    the text's last GLANCE tokens from its own position 0 (as training reads a window cut from running text),
    not the whole prompt nor the tokens of a pause: reading them costs a draft of a thirteenth of an int8
    target's size 3 ms for an 87-token prompt, 6 of that target's steps, and a never-right draft's trial
    nothing else worth counting. Once speculation pays and the reply can afford it (Speculator.headroom, against
    the time of the draft's latest long read, else its glance's), a draft of at most a WHOLE_SHARE of the
    target's parameters reads the whole text again, from the start (its proposals then see what the target sees:
    on benchmarks/speculative.py's code prompt 98% of a distilled draft's stood against 89% from its glance; the
    read costs its 3 x 128 draft 8 ms for 277 tokens, 10 bf16 target steps); a larger one, such as the target in
    fewer bits, goes on from its glance, since a read of the text costs it what the target's prompt pass cost
    (the float32 target's int4 copy gave 1.13x with it, 1.33x without).

    Args:
        draft: the draft model (a tinygpt GPT; eval mode while it proposes).
        target: the model it drafts for.
        vocab_size: the target's head (its logits' width): the draft's are cut or padded to it.
        max_len: the positions the draft's cache may need (the target's cache length).
    """

    def __init__(self, draft, target, vocab_size: int, max_len: int) -> None:
        self.model, self.vocab_size = draft, vocab_size
        self.max_len = min(max_len, draft.config.block_size)
        self.rereads = count_params(draft.config).total <= WHOLE_SHARE * count_params(target.config).total
        self.cache: KVCache | None = None
        self.start = 0  # the sequence's position of the token in the cache's first position (a glance's start)
        self.filled = 0  # the cache holds the sequence's tokens from `start` to `filled`
        self.whole = False  # it read the whole text (once speculation paid), and reads on from there
        self.rate: float | None = None  # seconds a token of its latest glance-sized read (longer: _long_reads)

    def propose(self, tokens: torch.Tensor, k: int, shape: Shape, draws: Draws | None) -> torch.Tensor:
        """Up to k proposals after tokens (T,): the argmax of each position's logits, or with `draws` (sampling)
        the draw its random numbers make."""
        at = len(tokens) - self.start  # the last token's position in the draft's cache
        k = min(k, self.max_len - at)  # the draft sees its own context and no further
        if k < 1:
            return tokens.new_empty(0)
        if self.cache is None:
            self.cache = KVCache.for_model(self.model, 1, self.max_len)
        with _evaluating(self.model):
            logits = self._catch_up(tokens)
            drafted = []
            for i in range(k):
                if i:
                    logits = _forward(self.model, drafted[-1].view(1, 1), self.cache, at + i - 1)
                shaped = shape(self._widen(logits.float()), torch.cat(drafted) if drafted else tokens.new_empty(0))
                drafted.append(shaped.argmax(dim=-1) if draws is None else choose_with(shaped, draws.row(i)))
        self.filled = len(tokens) + k - 1  # the last proposal was never read
        return torch.cat(drafted)

    def prepare(self, tokens: torch.Tensor, spend: float = 0.0) -> None:
        """Read what tokens (T,) hold beyond the last round's tokens, all but the last, before the round's clock
        starts (a prompt's or a pause's cost is no round's): the text from its start where the draft is small
        enough to read it again, its context holds it and the read costs no more than `spend` seconds (what the
        reply can afford: Speculator.headroom), else its last GLANCE tokens where more than those are unread."""
        gap = len(tokens) - self.filled
        rate = _long_reads.get(self.model, self.rate)
        if self.rereads and len(tokens) < self.max_len and rate is not None and rate * len(tokens) <= spend:
            start, self.whole = 0, True
        # a pause's tokens, unless the draft read the text from its start (a retry keeps it: a glance and another
        # read once the retry paid cost a bf16 target's trained draft, paused and retried often, 0.84x); or no room
        elif (gap > GLANCE and not self.whole) or len(tokens) - self.start >= self.max_len:
            start, self.whole = max(0, len(tokens) - GLANCE), False
        else:
            start = self.start
        if self.cache is None:
            self.cache = KVCache.for_model(self.model, 1, self.max_len)
        if start != self.start:
            self.start = self.filled = start
        elif gap <= 2:  # the last round's last proposal and token after it: the round reads them with its first
            return
        # else the tokens of plain steps since the draft's last read (a pause's, or the timing's), read before the
        # round's clock: in it they made a retry's one-proposal round of the target's int4 copy look 2x as slow
        if not 1 < len(tokens) - self.start <= self.max_len:
            return
        read, begin = len(tokens) - 1 - self.filled, time.perf_counter()
        with _evaluating(self.model):
            self._catch_up(tokens[:-1])
        self.filled = len(tokens) - 1
        if read > CHUNKED_READ:
            _long_reads[self.model] = (time.perf_counter() - begin) / read
        elif read >= GLANCE - 1:
            self.rate = (time.perf_counter() - begin) / read

    def _catch_up(self, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's logits (1, V_draft) after tokens (T,), reading the ones its cache lacks: a round's token
        and the proposals that stood, or the text a glance or the whole text reads."""
        new = tokens[self.filled :].unsqueeze(0)
        at = self.filled - self.start
        if new.shape[1] > CHUNKED_READ:
            positions = torch.arange(at, at + new.shape[1], device=tokens.device)
            return self.model(new, self.cache, positions, last_only=True)[:, -1]
        for i in range(0, new.shape[1], fastpath.PROMPT_ROWS):  # the last row's logits only, as a prompt's
            rows = new[:, i : i + fastpath.PROMPT_ROWS]
            logits = fastpath.prompt(self.model, rows, self.cache, at + i)
            logits = _forward(self.model, rows, self.cache, at + i)[-1:] if logits is None else logits
        return logits

    def _widen(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits (1, V_draft) over the target's head: ids only one of them has are never proposed."""
        width = logits.shape[-1]
        if width >= self.vocab_size:
            return logits[:, : self.vocab_size]
        return torch.cat([logits, logits.new_full((1, self.vocab_size - width), float("-inf"))], dim=1)

    def rollback(self, length: int) -> None:
        """The sequence stood at its first `length` tokens: the draft's cache holds no more than them."""
        self.filled = min(self.filled, length)


@contextmanager
def _evaluating(model):
    """The model in eval mode (no dropout) for the block, then in the mode it was in; one in eval mode is left
    alone (setting the mode walks every module: 0.3 ms a round for a 3-layer draft whose step takes 0.15)."""
    if not model.training:
        yield
        return
    model.eval()
    try:
        yield
    finally:
        model.train()


def _forward(model, tokens: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
    """The logits (T, V) of tokens (1, T) at positions start .. start + T - 1, written to the cache."""
    if tokens.shape[1] == 1 and fastpath.applies(model, tokens[:, 0], cache, start):  # a draft's step
        return fastpath.step(model, tokens[:, 0], cache, start)
    logits = fastpath.verify(model, tokens, cache, start)
    if logits is None:
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        logits = model(tokens, cache, positions)
    return logits[0]


def verify(model, rows: torch.Tensor, kv_cache: KVCache, start: int) -> torch.Tensor:
    """The target's logits (T, V) of rows (1, T) (the last token and the proposals) at positions start ..
    start + T - 1, their keys and values written to the cache: on a CPU one call into the model's DecodePlan,
    each row's logits those of a step that decodes it alone, bit for bit; elsewhere the model's forward,
    equal to a step's to float rounding."""
    return _forward(model, rows, kv_cache, start)


class Draws:
    """The random numbers of the positions a round decides, (1, V) a position (sampling.noise), taken from the
    generator in the order of the positions as they are needed, as plain steps there would take them; `keep`
    then leaves the generator as the steps of the positions that were decided leave it, so the next position
    draws the same numbers whether a round or a plain step decides it.

    Args:
        generator: the sequence's generator; None: torch's default one, which is not wound back (unseeded
            draws repeat nothing).
        width: the logits' width (the target's head).
        device: where the logits are.
    """

    def __init__(self, generator: torch.Generator | None, width: int, device: torch.device) -> None:
        self.generator, self.width, self.device = generator, width, device
        self.drawn: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []  # the generator's before the first draw, then after each

    def row(self, i: int) -> torch.Tensor:
        """Position i's random numbers (1, V), drawing those of the positions up to it not drawn yet."""
        while len(self.drawn) <= i:
            if self.generator is not None and not self.states:
                self.states.append(self.generator.get_state())
            self.drawn.append(noise(self.width, self.generator, self.device))
            if self.generator is not None:
                self.states.append(self.generator.get_state())
        return self.drawn[i]

    def rows(self, n: int) -> torch.Tensor:
        """The first n positions' random numbers (n, V)."""
        return torch.cat([self.row(i) for i in range(n)])

    def keep(self, n: int) -> None:
        """The first n positions were decided: the generator goes on from there (their plain steps' draws)."""
        if self.states:  # else nothing was drawn: the generator is where it was
            self.generator.set_state(self.states[n])


def judge(processed: torch.Tensor, drafted: torch.Tensor, draws: Draws | None) -> tuple[int, int]:
    """How many proposals stand and the token after them: the target's token at each verified position (its
    argmax, or with `draws` the draw of that position's random numbers), a proposal standing while it is that
    token.

    Args:
        processed: the target's logits at each verified position, shaped for the choice (k + 1, V).
        drafted: the k proposals.
        draws: the positions' random numbers (sampling); None: greedy.

    Returns:
        (n, token): drafted[:n] stand and `token` follows them.
    """
    best = processed.argmax(dim=-1) if draws is None else choose_with(processed, draws.rows(len(processed)))
    n = int((best[:-1] == drafted).long().cumprod(0).sum())
    return n, int(best[n])


class Speculator:
    """One sequence's speculation: its drafter, how many tokens it proposes, whether it speculates, its figures.

    k is the number that gives the most tokens for the time by what the rounds measured: a proposal stands with
    probability a (the proposals that stood over them and the refusals, the latest rounds weighing most: a round
    keeps its proposals up to the first that falls), and a round of k costs k draft steps and a verification of
    k + 1 rows, d and 1 + c k plain steps' time, so that k maximises (1 + a + ... + a^k) / (1 + k (d + c)). On a
    CPU a verification row is not free once the weights are no longer the bottleneck (the README's Zen 3: 5
    rows of a 100 MB float32 model cost 1.35 steps, 9 rows 2.2), so a high acceptance alone does not make a
    long round pay. Rounds whose measured time per token loses to a plain step's are set aside, and so is
    speculation that has lost more than it may over the reply by its ledger, `saved` (the module's docstring).

    Args:
        drafter: a DraftModel or a PromptLookup of this sequence's own.
        most: the most tokens a round proposes (check_tokens).
    """

    def __init__(self, drafter: DraftModel | PromptLookup, most: int) -> None:
        self.drafter, self.most = drafter, most
        self.k = min(START_TOKENS, most)
        self.stats = SpeculationStats()
        # the latest measures, of which the median counts (of the plain steps, the fastest): on a machine shared
        # with other work a round or a step now and then takes several times its time, and a mean would set
        # speculation aside for it
        self.steps: deque[float] = deque(maxlen=5)  # plain steps' seconds
        self.stood, self.fell = 1.0, 1.0  # proposals that stood and rounds where one fell, weighted: a = 1/2 at first
        self.draft_costs: deque[float] = deque(maxlen=5)  # a draft step's time, in plain steps (d)
        self.row_costs: deque[float] = deque(maxlen=5)  # a verified row's beyond the first, in plain steps (c)
        self.verifies: deque[float] = deque(maxlen=5)  # verifications' seconds
        self.pause = 0  # plain tokens to go before speculating again
        self.next_pause = FIRST_PAUSE
        self.trial: list[float] = []  # each round's gain since speculation (re)started: plain steps' time / its own
        self.empty = 0  # the latest rounds in a row of which no proposal stood, pauses between them or not
        self.rounds_since = 0  # rounds since the latest timing of plain steps
        self.timed = 0  # plain steps timed since the latest round
        self.saved = 0.0  # the ledger: plain steps' time of the rounds' tokens, less the rounds' and the reading's
        self.opened = 0.0  # the ledger when the latest trial began
        self.ante = 0.0  # what the latest trial lost where nothing of it stood
        self.step: float | None = None  # what a plain step costs, as the latest round weighed it

    @property
    def paying(self) -> bool:
        """Whether the rounds since speculation (re)started have shown that it pays: its trial is over."""
        return len(self.trial) >= (TRIAL_ROUNDS if self.next_pause == FIRST_PAUSE else RETRY_ROUNDS)

    def budget(self, room: int) -> int:
        """How many tokens to propose now (0: take a plain step), with room for `room` (the tokens the caller
        may still add less one, and the positions its cache has left less one)."""
        if self.pause or self.stats.plain < PLAIN_PROBES or self.rounds_since >= PLAIN_EVERY \
                or self.headroom < (0.0 if self.trial else self.ante):
            return 0  # aside, plain steps to time, or the reply cannot afford another trial (until it grows to)
        return max(0, min(self.k, room))

    def plain(self, seconds: float | None) -> None:
        """A plain step gave one token in `seconds` (None: not timed)."""
        self.stats.plain += 1
        self.pause = max(0, self.pause - 1)
        if seconds is not None:
            self.steps.append(seconds)
            self.timed += 1
            if self.timed >= PLAIN_RUN:
                self.rounds_since = 0

    def settle(self, drafted: int, accepted: int, seconds: float, drafting: float = 0.0) -> None:
        """A round proposed `drafted` tokens, of which `accepted` stood, in `seconds` (`drafting` of them the
        drafter's): choose the next k, and whether to go on."""
        self.stats.rounds += 1
        self.rounds_since += 1
        self.timed = 0
        self.stats.drafted += drafted
        self.stats.accepted += accepted
        self.stood = DECAY * self.stood + accepted
        self.fell = DECAY * self.fell + (accepted < drafted)
        self.empty = 0 if accepted else self.empty + 1
        if not self.steps:  # nothing to weigh the time by (PLAIN_PROBES = 0): as many as it may
            self.k = self.most
            return
        # the fastest of the latest plain steps: a step the machine held up is slower, none is faster than a step
        # costs; and a verification reads what a step reads and more: where the plain steps timed slower (the
        # first ones run on one thread while ThreadChoice looks), a verification bounds what a step costs now
        self.verifies.append(seconds - drafting)
        step = min(min(self.steps), min(self.verifies))
        self.draft_costs.append(drafting / drafted / step)
        self.row_costs.append(max(0.0, (seconds - drafting) / step - 1) / drafted)
        self.k = self._best_k()
        gain = step * (accepted + 1) / max(seconds, 1e-9)  # plain steps' time for its tokens, over its own
        # a round costs at most a draft step and a verified row a proposal beyond a step: more is another program's
        self.saved += step * (accepted + 1) - min(seconds, step * (1 + 2 * drafted))
        self.trial.append(gain)
        if accepted == drafted and gain >= 1.0:
            # every proposal stood and the round paid: at least twice as many next time (transformers' adds 2), as
            # costs measured at small k overstate a row's where weights stream from memory (a round's fixed share
            # charged to few proposals); where such a round did not pay (int8 rows), k stays the costs' choice
            self.k = max(self.k, min(self.most, 2 * drafted))
        rounds = TRIAL_ROUNDS if self.next_pause == FIRST_PAUSE else RETRY_ROUNDS
        nothing = len(self.trial) <= rounds and self.empty >= EMPTY_ROUNDS  # they cannot have paid, whatever the clock
        self.step = step
        spent = self.headroom < 0  # lost more than it may: rounds whose median pays lose where losses outweigh gains
        if len(self.trial) < rounds and not (nothing or spent):
            return
        # slower than plain steps, as timed: set it aside. The clock, not what the costs expect of the best k: those
        # measured at small k overstate a row's, and they set aside the target's int4 copy whose rounds paid 1.3x
        if nothing or spent or statistics.median(self.trial[-rounds:]) < 1.0:
            self.pause, self.next_pause = self.next_pause, min(4 * self.next_pause, LONGEST_PAUSE)
            # a trial of which nothing stood says the draft is wrong here: a retry waits until the reply may lose
            # as much again; one whose proposals stood but paid too little retries within the allowance
            self.trial, self.ante = [], max(0.0, self.opened - self.saved) if nothing else 0.0
        elif len(self.trial) == rounds:  # it pays: a later loss pauses it briefly again
            self.next_pause = FIRST_PAUSE

    def reading(self, seconds: float) -> None:
        """The drafter read the text for `seconds` before a round, outside its clock: a trial opens with it."""
        if not self.trial:
            self.opened = self.saved
        self.saved -= seconds

    @property
    def headroom(self) -> float:
        """Seconds speculation may still spend on this reply, by the ledger: what it saved, and what the reply may
        lose to it (STAKE plain steps and LOSS_SHARE of its tokens' steps)."""
        if self.step is None:
            return 0.0
        return self.saved + (STAKE + LOSS_SHARE * self.stats.tokens) * self.step

    def _best_k(self) -> int:
        """The k of the most tokens per time, (1 + a + ... + a^k) / (1 + k (d + c)) (a plain step gives 1)."""
        a = self.stood / (self.stood + self.fell)
        cost = statistics.median(self.draft_costs) + statistics.median(self.row_costs)
        best, best_value, tokens, term = 1, 0.0, 1.0, 1.0
        for k in range(1, self.most + 1):
            term *= a
            tokens += term
            value = tokens / (1 + k * cost)
            if value > best_value:
                best, best_value = k, value
        return best


@dataclass
class Round:
    """What one speculative round chose: the proposals that stood and the target's token after them."""

    tokens: list[int]  # n proposals and the token after them
    logits: torch.Tensor  # (n + 1, V) the target's raw logits at each
    processed: torch.Tensor  # (n + 1, V) as shaped for the choice
    drafted: int  # tokens proposed


def speculate(model, spec: Speculator, tokens: torch.Tensor, kv_cache: KVCache, filled: int, k: int, shape: Shape,
              greedy: bool, generator: torch.Generator | None,
              run: Callable[[Callable[[], torch.Tensor]], torch.Tensor] | None = None) -> Round | None:
    """One round for one sequence: propose, verify in one target call, judge, roll back; timed into `spec`.

    Args:
        model: the target.
        spec: the sequence's Speculator.
        tokens: the sequence so far (T,); the cache holds all of it but the last token.
        kv_cache: the sequence's one-row cache; `filled` positions hold tokens[:-1].
        k: the most tokens to propose (Speculator.budget).
        shape: the caller's processing of positions' logits (vocabulary mask, penalties, temperature, top-k,
            top-p), given the proposals before them (Shape).
        greedy: choose by argmax (else draw, as the module's docstring says).
        generator: the sequence's random numbers: each position's draws, the draft's and the target's, are the
            ones its plain step would take, and it is left as those of the positions decided leave it.
        run: calls the verification on the threads chosen (a ThreadChoice's prefill: its looks time plain steps,
            which a verification of several rows is not); None: directly.

    Returns:
        The Round, or None where the drafter proposed nothing (take a plain step).
    """
    begin = time.perf_counter()
    spec.drafter.prepare(tokens, spec.headroom if spec.paying else 0.0)
    start = time.perf_counter()
    spec.reading(start - begin)
    draws = None if greedy else Draws(generator, model.config.vocab_size, tokens.device)
    drafted = spec.drafter.propose(tokens, k, shape, draws)
    if not drafted.numel():
        if draws is not None:
            draws.keep(0)
        return None
    proposed = time.perf_counter()
    rows = torch.cat([tokens[-1:], drafted]).unsqueeze(0)
    logits = (run or (lambda f: f()))(lambda: verify(model, rows, kv_cache, filled))
    processed = shape(logits, drafted)
    n, token = judge(processed, drafted, draws)
    if draws is not None:
        draws.keep(n + 1)
    spec.drafter.rollback(len(tokens) + n)
    spec.settle(len(drafted), n, time.perf_counter() - start, proposed - start)
    return Round(drafted[:n].tolist() + [token], logits[: n + 1], processed[: n + 1], len(drafted))


def speculator(model, *, draft=None, speculate: int | None = None, prompt_lookup: int | None = None,
               max_len: int | None = None, vocab_size: int | None = None) -> Speculator | None:
    """A Speculator for one sequence of `model`, from generate's arguments; None without draft or prompt_lookup.

    Args:
        model: the target.
        draft: a draft model (a tinygpt GPT with the target's vocabulary).
        speculate: the most tokens a round proposes (DEFAULT_TOKENS, at most most_tokens(model)).
        prompt_lookup: n, for proposals from the text itself (PromptLookup).
        max_len: the positions of the target's cache (the draft's need no more).
        vocab_size: the tokenizer's vocabulary: a draft's head must cover it where its size differs from the
            target's.

    Raises:
        ConfigError: both or neither of draft and prompt_lookup with speculate; a bad speculate or n; a draft
            whose head is not the target's.
    """
    if draft is None and prompt_lookup is None:
        if speculate is not None:
            raise ConfigError("speculate: the tokens a draft proposes, for a draft or prompt_lookup; neither is given")
        return None
    if draft is not None and prompt_lookup is not None:
        raise ConfigError("draft and prompt_lookup: one source of proposals at a time")
    most = check_tokens(model, min(DEFAULT_TOKENS, most_tokens(model)) if speculate is None else speculate)
    if prompt_lookup is not None:
        return Speculator(PromptLookup(prompt_lookup), most)
    why = check_draft(model, draft, vocab_size)
    if why is not None:
        log.warning("tinygpt: warning: %s", why)
    return Speculator(DraftModel(draft, model, model.config.vocab_size, max_len or model.config.block_size), most)


def check_draft(model, draft, vocab_size: int | None = None) -> str | None:
    """A draft fit for `model`: a tinygpt GPT whose head covers the vocabulary (the target's size, or both at
    least the tokenizer's). Returns the warning for a draft as large as the target or larger (draft_warning),
    the first time this pair is checked; None after, or for a smaller draft.

    Raises:
        ConfigError: the draft is not a model, or its vocabulary is not the target's.
    """
    cfg = getattr(draft, "config", None)
    if cfg is None or not hasattr(cfg, "vocab_size") or not isinstance(draft, torch.nn.Module):
        raise ConfigError(f"draft: expected a tinygpt model, got a {type(draft).__name__}")
    theirs, ours = cfg.vocab_size, model.config.vocab_size
    if theirs != ours and (vocab_size is None or min(theirs, ours) < vocab_size):
        raise ConfigError(f"draft: its vocabulary of {theirs:,} ids is not the target's {ours:,}: a draft must "
                          "share the target's tokenizer (its vocabulary and ids)")
    warned = _warned.setdefault(model, weakref.WeakSet())
    if draft in warned:
        return None
    warned.add(draft)
    return draft_warning(model, draft)
