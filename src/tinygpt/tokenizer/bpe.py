"""Byte-level BPE (GPT-2's scheme) trained on the user's corpus with Hugging Face `tokenizers`, and what
it shares with a pretrained model's tokenizer, which `tokenizers` runs too: text is UTF-8 bytes to it, so
any string round-trips exactly, and each id stands for bytes spelled in GPT-2's byte-level alphabet.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import TokenizerError
from .base import EOT, TokenizerBase

BPE_MIN_VOCAB = 257  # the 256 byte tokens + <|endoftext|>
BPE_MAX_VOCAB = 1 << 20
DEFAULT_BPE_VOCAB = 4096


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, as byte-level BPE vocabularies spell tokens.

    Bytes that are printable Latin-1 (except space) stand for themselves; the other 68 bytes are
    mapped, in order, to code points 256, 257, ... so every token is a visible string.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {c: b for b, c in byte_to_unicode().items()}


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level token stands for.

    Args:
        token: the token as a byte-level vocabulary spells it, in GPT-2's alphabet (byte_to_unicode).

    Raises:
        TokenizerError: a character outside that alphabet.
    """
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        raise TokenizerError(f"token {token!r} is not spelled in GPT-2's byte-level alphabet") from None


def byte_level_table(vocab: Mapping[str, int], added: Mapping[int, str]) -> list[bytes]:
    """Each id's bytes in a byte-level vocabulary: an added token's text, any other token's spelling read
    back (token_bytes).

    Args:
        vocab: token -> id, the added tokens included.
        added: id -> text of the added tokens.
    """
    table = [b""] * (max(vocab.values(), default=-1) + 1)
    for token, i in vocab.items():
        table[i] = added[i].encode("utf-8") if i in added else token_bytes(token)
    return table


def check_bpe_vocab_size(vocab_size: int) -> None:
    """Refuse a BPE vocabulary size that cannot work: below 257 (256 bytes + <|endoftext|>) or absurdly large."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        raise TokenizerError(f"vocab size must be an integer, got {vocab_size!r}")
    if vocab_size < BPE_MIN_VOCAB:
        raise TokenizerError(
            f"vocab size {vocab_size} is too small for byte-level BPE: it needs at least {BPE_MIN_VOCAB} "
            "(the 256 byte tokens and <|endoftext|>)"
        )
    if vocab_size > BPE_MAX_VOCAB:
        raise TokenizerError(f"vocab size {vocab_size:,} is too large for BPE (at most {BPE_MAX_VOCAB:,})")


class TokenizersKind(TokenizerBase):
    """What the kinds a `tokenizers.Tokenizer` runs (self._tok) share: text encoded as text, each id's
    bytes (self._bytes), the special tokens."""

    _tok: Any
    _bytes: list[bytes]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        texts = list(texts)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("encode expects str")
        try:
            encodings = self._tok.encode_batch_fast(texts, add_special_tokens=False)
        except Exception as e:  # tokenizers refuses strings it cannot hold, e.g. lone surrogates
            raise TokenizerError(f"cannot encode text: {e}") from None
        return [e.ids for e in encodings]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(map(self._bytes.__getitem__, self._check_ids(ids)))

    @property
    def hf_tokenizer(self) -> Any:
        """The underlying `tokenizers.Tokenizer` (for export to Hugging Face formats)."""
        return self._tok

    def special_ids(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def _canonical(self) -> dict[str, Any]:
        return self._rules(json.loads(self._tok.to_str()))

    def _rules(self, pipeline: dict[str, Any]) -> dict[str, Any]:
        """The byte-pair encoding `pipeline` (tokenizer.json's form) runs, as the fingerprint holds it."""
        # tokenizers 0.20 began writing a merge as ["a", "b"] instead of "a b"; byte-level tokens hold
        # no space, so "a b" is the same merge either way
        merges = [m if isinstance(m, str) else " ".join(m) for m in (pipeline.get("model") or {}).get("merges", [])]
        added = sorted([t.get("id"), t.get("content"), bool(t.get("special"))]
                       for t in pipeline.get("added_tokens") or [])
        return {
            "kind": "bpe",  # the scheme, whichever kind runs it
            "tokens": [base64.b64encode(b).decode("ascii") for b in self._bytes],
            "merges": merges,
            "added": added,
            "normalizer": pipeline.get("normalizer"),
            "pre_tokenizer": pipeline.get("pre_tokenizer"),
        }

    def _with_added_specials(self, tokens: list[str]) -> Any:
        """A copy of the `tokenizers.Tokenizer` with `tokens` added as special tokens where it lacks them,
        one by one in order, so each lands on the next id."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as HFTokenizerCore

        tok = HFTokenizerCore.from_str(self._tok.to_str())  # a copy: this tokenizer stays as it is
        have = self.special_ids()
        for t in tokens:
            if t not in have:
                tok.add_special_tokens([AddedToken(t, special=True, normalized=False)])
        return tok


class BPETokenizer(TokenizersKind):
    """Byte-level BPE (GPT-2's scheme) trained on your corpus with Hugging Face `tokenizers`."""

    kind = "bpe"

    def __init__(self, hf_tokenizer: Any) -> None:
        """Args:
        hf_tokenizer: a `tokenizers.Tokenizer` with a BPE model and ByteLevel pre-tokenizer.
        """
        model = json.loads(hf_tokenizer.to_str())
        if (model.get("model") or {}).get("type") != "BPE":
            raise TokenizerError("the embedded tokenizer is not a BPE model")
        if (model.get("pre_tokenizer") or {}).get("type") != "ByteLevel":
            raise TokenizerError("the embedded tokenizer is not byte-level (its pre_tokenizer is not ByteLevel)")
        self._tok = hf_tokenizer
        # Literal "<|endoftext|>" in user text stays text; only the data pipeline inserts the separator.
        self._tok.encode_special_tokens = True
        vocab = hf_tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = len(vocab)
        if sorted(vocab.values()) != list(range(self.vocab_size)):
            raise TokenizerError("the BPE vocabulary's ids are not 0..N-1")
        added = {i: t.content for i, t in hf_tokenizer.get_added_tokens_decoder().items()}
        self._bytes = byte_level_table(vocab, added)
        self.eot_id = hf_tokenizer.token_to_id(EOT)

    @classmethod
    def train(
        cls,
        texts: Iterable[str],
        vocab_size: int = DEFAULT_BPE_VOCAB,
        *,
        min_frequency: int = 2,
        show_progress: bool = False,
    ) -> BPETokenizer:
        """Learn a byte-level BPE vocabulary from an iterable of texts.

        Args:
            texts: the corpus, in pieces of any size (streamed, never joined in memory).
            vocab_size: the target size, including the 256 byte tokens and <|endoftext|>. A small
                corpus may stop short of it: the result has as many tokens as merges were found.
            min_frequency: a pair must occur this often to be merged.
            show_progress: let `tokenizers` draw its own progress bars.
        """
        check_bpe_vocab_size(vocab_size)
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tok = HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=show_progress,
        )
        # The Rust trainer pulls from our iterator; keep any error it raises so it surfaces as itself.
        failure: list[BaseException] = []

        def guarded() -> Iterable[str]:
            try:
                yield from texts
            except BaseException as e:
                failure.append(e)
                raise

        try:
            tok.train_from_iterator(guarded(), trainer=trainer)
        except BaseException:
            if failure:
                raise failure[0] from None
            raise
        return cls(tok)

    def _with_specials(self, tokens: list[str]) -> BPETokenizer:
        return BPETokenizer(self._with_added_specials(tokens))

    def to_dict(self) -> dict[str, Any]:
        return {**self._header(), "eot": EOT, "tokenizer": json.loads(self._tok.to_str())}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BPETokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        inner = data.get("tokenizer")
        if not isinstance(inner, dict):
            raise TokenizerError('a bpe tokenizer needs "tokenizer", the Hugging Face tokenizer JSON object')
        try:
            tok = HFTokenizer.from_str(json.dumps(inner))
        except Exception as e:
            raise TokenizerError(f"the embedded Hugging Face tokenizer does not load: {e}") from None
        return cls(tok)
