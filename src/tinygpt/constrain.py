"""Constrained decoding: what a reply may be (a JSON Schema, a regular expression, a list of choices, a Lark
grammar) compiled against a tokenizer's vocabulary, and a matcher per sequence that masks each step's logits
to the tokens the grammar allows and follows the tokens chosen.

The grammar engine is llguidance (a Rust library without dependencies of its own, ~7 MB): it compiles lazily
(a schema's lexer is built as the reply needs it, so compiling costs milliseconds), walks the vocabulary's
prefix tree for a mask (tens of microseconds for 50K tokens on a CPU), and bounds its own work by fuel, which
decision 16 asks of a grammar a request sends. docs/tutorials/structured.md has the comparison with xgrammar
that chose it.

A mask is sized by the model's head, not the tokenizer: ids past the tokenizer's vocabulary (a padded head,
Qwen's 151,936 rows for 151,669 tokens) are never allowed. JSON is written with fixed separators (", " and
": ", as json.dumps writes them) and no other whitespace between tokens, so a small model cannot run to the
token limit on blanks. A grammar the vocabulary cannot write (a character model that never saw "{") is
refused before generation, naming the characters it lacks.
"""

from __future__ import annotations

import functools
import json
import re
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from .errors import GrammarError, TokenizerError
from .tokenizer.base import Tokenizer

# The JSON every schema is written as: json.dumps' separators and no whitespace between tokens
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# The largest grammar source taken (a schema's JSON, a regex, the choices): the engine's fuel bounds the
# time, this the memory a request's grammar can cost before the engine sees it
MAX_SOURCE_BYTES = 256 * 1024
MAX_CHOICES = 4096
# how far the check that a vocabulary can write a grammar walks before it gives the grammar the benefit
WALK_STEPS = 4096
# the order the walk tries characters in: closing ones first, then plain ones, then those that open more
_WALK_ORDER = b'"}])>0a' + bytes(range(0x61, 0x7B)) + bytes(range(0x30, 0x3A)) + bytes(range(0x41, 0x5B))


@dataclass(frozen=True)
class Constraint:
    """What a reply must be, before it is compiled for a vocabulary: `kind` ("json_schema", "regex", "choices"
    or "lark": a grammar, Lark or GBNF) and its source as text (a schema or choices as JSON). Build one with
    the class methods, which check the source."""

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: Any) -> Constraint:
        """A JSON Schema (a dict, or its JSON text); True or {} is any JSON value.

        Raises:
            GrammarError: not a schema (not an object or a boolean), or larger than MAX_SOURCE_BYTES.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (ValueError, RecursionError) as e:
                raise GrammarError(f"json_schema: not JSON ({e})") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        try:
            text = json.dumps(schema, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise GrammarError(f"json_schema: not a JSON value ({type(e).__name__}: {e})") from None
        return cls("json_schema", _bounded(text, "json_schema"))

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """A regular expression the whole reply matches (Rust's regex syntax, as Python's for common ones)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("regex: must be a non-empty string")
        return cls("regex", _bounded(pattern, "regex"))

    @classmethod
    def choices(cls, options: list[str]) -> Constraint:
        """The reply is exactly one of these strings."""
        if not isinstance(options, (list, tuple)) or not options or not all(isinstance(o, str) and o for o in options):
            raise GrammarError("choices: must be a non-empty list of non-empty strings")
        if len(options) > MAX_CHOICES:
            raise GrammarError(f"choices: at most {MAX_CHOICES:,}, got {len(options):,}")
        return cls("choices", _bounded(json.dumps(list(options), ensure_ascii=False), "choices"))

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """A context-free grammar: llguidance's Lark syntax (`start: ...`, a JSON Schema embeddable as %json) or
        llama.cpp's GBNF (`root ::= ...`)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("grammar: must be a non-empty string")
        return cls("lark", _bounded(grammar, "grammar"))

    @classmethod
    def given(cls, json_schema: Any = None, regex: str | None = None, choices: list[str] | None = None,
              grammar: str | None = None) -> Constraint | None:
        """The one constraint given by name (generate's and the CLI's arguments), or None for none.

        Raises:
            GrammarError: more than one given, or one that is not what its name says.
        """
        given = {name: value for name, value in (("json_schema", json_schema), ("regex", regex),
                                                 ("choices", choices), ("grammar", grammar)) if value is not None}
        if len(given) > 1:
            raise GrammarError(f"give one constraint, got {' and '.join(given)}")
        if not given:
            return None
        name, value = given.popitem()
        return cls.lark(value) if name == "grammar" else getattr(cls, name)(value)

    def grammar(self) -> str:
        """The source as llguidance's grammar (its JSON form)."""
        from llguidance import LLMatcher, grammar_from

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choices":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, json.loads(self.source))))
        return grammar_from("grammar", self.source)  # GBNF is rewritten as Lark


def _bounded(text: str, what: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_SOURCE_BYTES:
        raise GrammarError(f"{what}: {size:,} bytes, more than the {MAX_SOURCE_BYTES:,} a grammar may have")
    return text


def schema_error(schema: Any) -> str | None:
    """What is wrong with a JSON Schema as the grammar engine reads it (an unsupported keyword, a bad type, a
    $ref to nothing), or None; no vocabulary needed (a tool's parameters are checked so, called or not).

    Args:
        schema: the schema (a dict).
    """
    from llguidance import LLMatcher

    try:
        grammar = Constraint.json_schema(schema).grammar()
    except (GrammarError, ValueError) as e:
        return str(e).removeprefix("json_schema: ")
    error = LLMatcher.validate_grammar(grammar, limits=_limits())
    return _first_line(error) if error and not error.startswith("WARNING") else None


class Vocabulary:
    """A tokenizer's vocabulary as llguidance sees it, sized to a model's head (`n_vocab` ids: the rows past
    the tokenizer's own are empty tokens no grammar allows), ending where `stops` end a reply.

    Args:
        tokenizer: any tinygpt tokenizer.
        n_vocab: the model's head size (model.config.vocab_size).
        stops: the ids that end a reply (the grammar allows them once it is complete). Without any, the
            engine's own end-of-text id sits past the head, and a reply ends when the grammar does.
    """

    def __init__(self, tokenizer: Tokenizer, n_vocab: int, stops: frozenset[int] = frozenset()) -> None:
        import llguidance

        self.n_vocab = n_vocab
        table = [tokenizer.decode_bytes([i]) for i in range(min(n_vocab, tokenizer.vocab_size))]
        table += [b""] * (n_vocab - len(table))
        specials = set(tokenizer.special_ids().values()) | set(stops)
        if tokenizer.eot_id is not None:
            specials.add(tokenizer.eot_id)
        specials = {i for i in specials if i < n_vocab}
        self.stops = sorted(i for i in stops if i < n_vocab)
        # each single character's (or byte's) id, for text the tokenizer's own encoding would not give back
        self._single: dict[bytes, int] = {}
        for i, data in enumerate(table):
            if data and i not in specials and len(data.decode("utf-8", "replace")) == 1:
                self._single.setdefault(data, i)
        self.tokenizer = tokenizer
        # the bytes its tokens can write: all 256 for byte-level kinds, a character vocabulary's own
        self.bytes = frozenset(b for i, data in enumerate(table) if i not in specials for b in data)
        wrapper = _Wrapper(table, self.stops[0] if self.stops else None, sorted(specials), self._encode)
        self.engine = llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper),
                                             eos_token=self.stops or None)

    def _encode(self, text: bytes | str) -> list[int]:
        """Text as ids whose bytes are the text's: the tokenizer's encoding where it gives that back (a
        SentencePiece encoding puts a space first), else a character or byte at a time."""
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        try:
            ids = self.tokenizer.encode(data.decode("utf-8", "replace"))
            if self.tokenizer.decode_bytes(ids) == data:
                return ids
        except TokenizerError:
            pass
        out = []
        for char in data.decode("utf-8", "replace"):
            piece = char.encode("utf-8")
            if piece in self._single:
                out.append(self._single[piece])
            else:
                out += [self._single[bytes([b])] for b in piece if bytes([b]) in self._single]
        return out


class _Wrapper:
    """What llguidance.TokenizerWrapper reads from a tokenizer: each id's bytes, the end and special ids,
    and an encoder."""

    def __init__(self, tokens: list[bytes], eos: int | None, specials: list[int], encode) -> None:
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos, None
        self.special_token_ids = specials
        self._encode = encode

    def __call__(self, text: bytes | str) -> list[int]:
        return self._encode(text)


# tokenizer -> {(n_vocab, stops): Vocabulary}: building one reads every token (a second for 150K)
_vocabularies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def vocabulary(tokenizer: Tokenizer, n_vocab: int, stops: frozenset[int] = frozenset()) -> Vocabulary:
    """The tokenizer's Vocabulary for a head of n_vocab ids, built once and kept while the tokenizer lives.

    Args:
        tokenizer: any tinygpt tokenizer.
        n_vocab: the model's head size.
        stops: the ids that end a reply.
    """
    kept = _vocabularies.setdefault(tokenizer, {})
    key = (n_vocab, frozenset(stops))
    if key not in kept:
        kept[key] = Vocabulary(tokenizer, n_vocab, frozenset(stops))
    return kept[key]


def _limits():
    from llguidance import LLParserLimits

    # the engine's defaults bound a step (fuel) and the grammar's size; errors leave out the grammar itself
    return LLParserLimits(verbose_errors=False)


class Grammar:
    """A Constraint compiled for a Vocabulary: a matcher at the start of a reply, copied for each sequence.

    Args:
        vocab: the vocabulary (`vocabulary(...)`).
        constraint: what the reply must be.

    Raises:
        GrammarError: the source does not compile (naming the problem: an unsupported keyword, a regex
            error, a grammar over the engine's limits), or the vocabulary cannot write it (naming the
            characters it lacks).
    """

    def __init__(self, vocab: Vocabulary, constraint: Constraint) -> None:
        from llguidance import LLMatcher

        self.vocab, self.constraint = vocab, constraint
        try:
            grammar = constraint.grammar()
        except ValueError as e:
            raise GrammarError(f"{_name(constraint)}: {e}") from None
        self._start = LLMatcher(vocab.engine, grammar, log_level=0, limits=_limits())
        if self._start.is_error():
            raise GrammarError(f"{_name(constraint)}: {_first_line(self._start.get_error())}")
        if not vocab.bytes.issuperset(range(256)):
            missing = _unwritable(grammar, vocab.bytes)
            if missing is not None:
                raise GrammarError(f"{_name(constraint)}: this model's vocabulary cannot write it: {missing}")

    def matcher(self) -> Matcher:
        """A Matcher at the start of a reply."""
        return Matcher(self._start.deep_copy(), self.vocab)


def _name(constraint: Constraint) -> str:
    return "grammar" if constraint.kind == "lark" else constraint.kind


def _first_line(error: str) -> str:
    """The engine's error in one line: its first, and where it names the error itself further down (a regex
    parser's 'error: unclosed group'), that too."""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    if not lines:
        return "does not compile"
    first = re.sub(r"^at \d+\(\d+\): ", "", lines[0]).removesuffix(":").replace(" (in regex): regex parse error", "")
    detail = next((line.removeprefix("error: ") for line in lines[1:] if line.startswith("error: ")), None)
    return f"{first}: {detail}" if detail else first


@functools.lru_cache(maxsize=128)
def _compiled(vocab: Vocabulary, constraint: Constraint) -> Grammar:
    return Grammar(vocab, constraint)


def compile_grammar(tokenizer: Tokenizer, constraint: Constraint, n_vocab: int,
                    stops: frozenset[int] = frozenset()) -> Grammar:
    """`constraint` compiled for the tokenizer and a head of n_vocab ids; the last 128 are kept, so a schema
    sent again (a client's every request) is not compiled again.

    Args:
        tokenizer: any tinygpt tokenizer.
        constraint: what the reply must be.
        n_vocab: the model's head size (model.config.vocab_size).
        stops: the ids that end a reply.

    Raises:
        GrammarError: as Grammar.
    """
    return _compiled(vocabulary(tokenizer, n_vocab, stops), constraint)


class Matcher:
    """One sequence's place in its grammar: `mask` the logits of its next token, `advance` by the token chosen."""

    def __init__(self, engine, vocab: Vocabulary) -> None:
        self.engine, self.vocab = engine, vocab
        self.done = False  # the grammar is complete and allows no more text

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (1, V) or (V,) with every id the grammar does not allow next set to -inf (a new tensor).

        Raises:
            GrammarError: the grammar allows nothing (the engine's step limit, or a dead end).
        """
        bias = self.engine.compute_logit_bias()  # a byte an id: 200 allowed, 0 not
        allowed = torch.frombuffer(bytearray(bias), dtype=torch.uint8)[: logits.shape[-1]]
        if self.engine.is_error():
            raise GrammarError(f"the grammar stopped: {_first_line(self.engine.get_error())}")
        return logits.masked_fill(allowed.to(logits.device) == 0, float("-inf"))

    def masks(self, logits: torch.Tensor, drafted: torch.Tensor) -> torch.Tensor:
        """A speculative round's logits (R, V) masked as `mask` would mask each row's step: row r's position
        follows the proposals drafted[: m - R + 1 + r] (m = len(drafted); speculative.Shape), which the matcher
        takes for the rows and then gives back, left where it was. A row after a proposal the grammar refuses,
        or after its end, stays as it is: no token is chosen there (the refused proposal falls; the reply ends
        with its grammar).

        Raises:
            GrammarError: as mask.
        """
        ids, first = drafted.tolist(), len(drafted) - logits.shape[0] + 1
        allowed = self.engine.validate_tokens(ids)  # the proposals it takes, in a row
        rows, taken = [], 0
        try:
            for r in range(logits.shape[0]):
                while taken < min(first + r, allowed):
                    self.engine.consume_token(ids[taken])
                    taken += 1
                live = taken == first + r and not self.engine.is_stopped()
                rows.append(self.mask(logits[r : r + 1]) if live else logits[r : r + 1])
        finally:
            self.engine.rollback(taken)
        return torch.cat(rows)

    def advance(self, token: int) -> bool:
        """Follow the token chosen; True once the grammar is complete and allows no more text.

        Raises:
            GrammarError: the token is not one the grammar allows (a mask was not applied).
        """
        if not self.engine.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {_first_line(self.engine.get_error())}")
        self.done = self.engine.is_stopped()
        return self.done


def _character(matcher, lead: int) -> str:
    """The character a grammar writes from the byte `lead` on: its UTF-8 sequence completed with the
    first continuation bytes the grammar allows."""
    if lead < 0xC0:
        return chr(lead)
    walker, data = matcher.deep_copy(), bytes([lead])
    walker.consume_token(lead)
    for _ in range(3):
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            bias = walker.compute_logit_bias()
            following = next((b for b in range(0x80, 0xC0) if bias[b]), None)
            if following is None:
                break
            data += bytes([following])
            walker.consume_token(following)
    return data.decode("utf-8", "replace")


@functools.cache
def _bytes_engine():
    """A vocabulary of the 256 bytes, for walking a grammar a character at a time."""
    import llguidance

    table = [bytes([b]) for b in range(256)]
    wrapper = _Wrapper(table, None, [], lambda text: list(text if isinstance(text, bytes) else text.encode()))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper))


def _unwritable(grammar: str, writable: frozenset[int]) -> str | None:
    """Why a vocabulary that writes only the bytes `writable` cannot write the grammar, or None when a walk
    through it finds an end (or gives up): at each step the walk takes a byte the vocabulary has, the one
    taken least so far, closing characters first; where the grammar allows none of them, it names the
    characters the grammar wanted there."""
    from llguidance import LLMatcher

    matcher = LLMatcher(_bytes_engine(), grammar, log_level=0, limits=_limits())
    taken: Counter[int] = Counter()
    text = b""
    rank = {b: i for i, b in enumerate(_WALK_ORDER)}
    for _ in range(WALK_STEPS):
        if matcher.is_accepting() or matcher.is_error():
            return None
        bias = matcher.compute_logit_bias()
        allowed = [b for b in range(256) if bias[b]]
        usable = [b for b in allowed if b in writable]
        if not usable:
            shown = list(dict.fromkeys(repr(_character(matcher, b)) for b in allowed[:8]))
            needs = shown[0] if len(shown) == 1 else "one of " + ", ".join(shown)
            after = f" after {text.decode('utf-8', 'replace')[-40:]!r}" if text else " at the start"
            return f"it needs {needs}{after}, and no token of the vocabulary writes it"
        byte = min(usable, key=lambda b: (taken[b], rank.get(b, len(rank) + b)))
        taken[byte] += 1
        text += bytes([byte])
        matcher.consume_token(byte)
    return None


class Rows:
    """The matchers of a batch's rows, each at its own place in one grammar (generate_stream's).

    Args:
        grammar: the compiled grammar.
        batch: how many rows.
    """

    def __init__(self, grammar: Grammar, batch: int) -> None:
        self.matchers = [grammar.matcher() for _ in range(batch)]

    def mask(self, logits: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        """logits (B, V) masked row by row (Matcher.mask), but for the rows where `skip` (B,) is True."""
        skipped = skip.tolist()
        return torch.cat([row if skipped[i] else m.mask(row)
                          for i, (m, row) in enumerate(zip(self.matchers, logits.split(1)))])

    def advance(self, tokens: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """Follow each live row's token (tokens and live (B,)); returns (B,) bool: the rows whose grammar is
        now complete."""
        done = [bool(on) and m.advance(t) for m, t, on in zip(self.matchers, tokens.tolist(), live.tolist())]
        return torch.tensor(done, dtype=torch.bool, device=tokens.device)
