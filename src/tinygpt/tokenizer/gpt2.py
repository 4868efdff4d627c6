"""GPT-2's own BPE, run by `tiktoken` (ids equal tiktoken's "gpt2" encoding), from tiktoken's cache or
from local files: vocab.json + merges.txt, OpenAI's encoder.json + vocab.bpe, a .tiktoken file. The saved
JSON carries the ranks, so a data or run folder never needs the network again.
"""

from __future__ import annotations

import base64
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from ..errors import TokenizerError
from ..fileio import read_json
from .base import EOT, FORMAT, Tokenizer, TokenizerBase, load_tokenizer, tokenizer_from_dict
from .bpe import token_bytes

# GPT-2's pre-tokenizer split (tiktoken's r50k/gpt2 pattern): contractions, letters, digits,
# other symbols, whitespace. BPE merges never cross these pieces.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


class GPT2Tokenizer(TokenizerBase):
    """GPT-2's BPE (50,257 tokens) run by `tiktoken`; ids equal tiktoken's "gpt2" encoding."""

    kind = "gpt2"

    def __init__(
        self,
        ranks: dict[bytes, int],
        special_tokens: dict[str, int] | None = None,
        *,
        pat_str: str = GPT2_PATTERN,
        name: str = "gpt2",
    ) -> None:
        """Args:
        ranks: token bytes -> rank (= token id); the merge order of byte-pair encoding.
        special_tokens: text -> id for tokens outside the merges, e.g. {"<|endoftext|>": 50256}.
        pat_str: the pre-tokenizer regex (GPT-2's by default).
        name: a label for tiktoken.
        """
        import tiktoken

        special_tokens = dict(special_tokens or {})
        ids = sorted([*ranks.values(), *special_tokens.values()])
        if not ranks or ids != list(range(len(ids))):
            raise TokenizerError("GPT-2 token ids (ranks and special tokens) must be exactly 0..N-1")
        missing = [b for b in range(256) if bytes([b]) not in ranks]
        if missing:
            raise TokenizerError(f"the vocabulary lacks {len(missing)} of the 256 single-byte tokens")
        self._ranks = ranks
        self._special = special_tokens
        self._pat_str = pat_str
        try:
            self._enc = tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens)
        except Exception as e:
            raise TokenizerError(f"tiktoken refused the vocabulary: {e}") from None
        self.vocab_size = len(ids)
        self.eot_id = special_tokens.get(EOT)

    @classmethod
    def from_tiktoken(cls, name: str = "gpt2", timeout: float = 10.0) -> GPT2Tokenizer:
        """tiktoken's own encoding: from its cache, else downloaded.

        Args:
            name: the tiktoken encoding ("gpt2").
            timeout: seconds to wait for it: tiktoken's download has no timeout of its own, so a
                machine whose network drops packets would otherwise wait forever.
        """
        try:
            enc = _get_encoding_within(name, timeout)
        except Exception as e:
            raise TokenizerError(
                f"GPT-2's BPE files are not in tiktoken's cache and could not be downloaded ({type(e).__name__}); "
                "pass --tokenizer-file PATH with a local GPT-2 vocab.json + merges.txt or gpt2.tiktoken"
            ) from None
        ranks = {b: enc.encode_single_token(b) for b in enc.token_byte_values()}
        special = {t: enc.encode_single_token(t) for t in enc.special_tokens_set}
        return cls(ranks, special, pat_str=enc._pat_str, name=enc.name)

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> GPT2Tokenizer:
        """Load GPT-2's BPE from local files.

        Args:
            path: a `vocab.json` + `merges.txt` pair (Hugging Face's names; OpenAI's `encoder.json`
                + `vocab.bpe` too), given as either file or their folder; a tiktoken `.tiktoken`
                file (e.g. `gpt2.tiktoken`); or a tinygpt tokenizer JSON of kind gpt2.
        """
        p = Path(path).expanduser()
        if not p.exists():
            raise TokenizerError(f"tokenizer file not found: {p}")
        if p.is_dir():
            for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
                if (p / vocab_name).is_file() and (p / merges_name).is_file():
                    return cls.from_vocab_merges(p / vocab_name, p / merges_name)
            tiktoken_files = sorted(p.glob("*.tiktoken"))
            if tiktoken_files:
                return cls.from_tiktoken_file(tiktoken_files[0])
            if (p / "tokenizer.json").is_file():
                return _as_gpt2(load_tokenizer(p / "tokenizer.json"), p)
            raise TokenizerError(f"no GPT-2 tokenizer files in {p} (expected vocab.json + merges.txt or *.tiktoken)")
        if p.suffix == ".tiktoken":
            return cls.from_tiktoken_file(p)
        if p.suffix in (".txt", ".bpe"):
            vocab = _sibling(
                p, [("merges.txt", "vocab.json"), ("vocab.bpe", "encoder.json")], ["vocab.json", "encoder.json"]
            )
            return cls.from_vocab_merges(vocab, p)
        data = read_json(p, TokenizerError)
        if isinstance(data, dict) and data.get("format") == FORMAT:
            return _as_gpt2(tokenizer_from_dict(data, where=str(p)), p)
        merges = _sibling(p, [("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")], ["merges.txt", "vocab.bpe"])
        return cls.from_vocab_merges(p, merges, vocab=data)

    @classmethod
    def from_vocab_merges(
        cls, vocab_path: str | os.PathLike, merges_path: str | os.PathLike, *, vocab: Any = None,
        specials: Sequence[str] = (),
    ) -> GPT2Tokenizer:
        """GPT-2's files as Hugging Face (vocab.json + merges.txt) and OpenAI (encoder.json + vocab.bpe) ship them.

        Args:
            vocab_path, merges_path: the two files.
            vocab: vocab.json's contents, when already read.
            specials: tokens of the vocabulary that are special besides <|endoftext|> (a chat
                template's, which an export writes into vocab.json after it).
        """
        if vocab is None:
            vocab = read_json(Path(vocab_path), TokenizerError)
        if not isinstance(vocab, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in vocab.values()
        ):
            raise TokenizerError(f"{vocab_path}: expected a JSON object of token -> id")
        special = {t: vocab[t] for t in (EOT, *specials) if t in vocab}
        try:
            ranks = {token_bytes(t): i for t, i in vocab.items() if t not in special}
        except TokenizerError as e:
            raise TokenizerError(f"{vocab_path}: {e}") from None
        if len(ranks) + len(special) != len(vocab):
            raise TokenizerError(f"{vocab_path}: two tokens spell the same bytes")
        # tiktoken merges by rank; that equals merging in merges.txt order only if each merge's
        # result ranks after the previous one, as in GPT-2's files. Check it rather than assume it.
        try:
            lines = Path(merges_path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read {merges_path}: {e}") from None
        last = -1
        for n, line in enumerate(lines, start=1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.split()
            merged = vocab.get("".join(parts)) if len(parts) == 2 else None
            if merged is None or parts[0] not in vocab or parts[1] not in vocab:
                raise TokenizerError(
                    f"{merges_path}:{n}: {line!r} is not a merge of two tokens into one in {Path(vocab_path).name}"
                )
            if merged <= last:
                raise TokenizerError(f"{merges_path}:{n}: merge ranks are not in id order, unlike GPT-2's files")
            last = merged
        return cls(ranks, special)

    @classmethod
    def from_tiktoken_file(cls, path: str | os.PathLike) -> GPT2Tokenizer:
        """A tiktoken BPE file: one `base64(token) rank` per line; <|endoftext|> follows the last rank."""
        ranks: dict[bytes, int] = {}
        try:
            text = Path(path).read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"cannot read {path} as a .tiktoken file: {e}") from None
        for n, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise TokenizerError(f"{path}:{n}: expected 'base64-token rank', got {line[:60]!r}") from None
        return cls(ranks, {EOT: len(ranks)})

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(list(texts))

    def encode_each(self, texts: Sequence[str]) -> list[np.ndarray]:
        # one text at a time: encode_ordinary_batch would start a thread pool of its own
        return [np.asarray(self._enc.encode_ordinary(t), dtype=np.uint32) for t in texts]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return self._enc.decode_bytes(self._check_ids(ids))

    @property
    def encoding(self) -> Any:
        """The underlying `tiktoken.Encoding`."""
        return self._enc

    @property
    def ranks(self) -> Mapping[bytes, int]:
        """Token bytes -> rank (= token id), read-only: the merge order of byte-pair encoding."""
        return MappingProxyType(self._ranks)

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Text -> id of the tokens outside the merges (GPT-2's <|endoftext|>), read-only."""
        return MappingProxyType(self._special)

    def special_ids(self) -> dict[str, int]:
        return dict(self._special)

    def _with_specials(self, tokens: list[str]) -> GPT2Tokenizer:
        special = dict(self._special)
        for t in tokens:  # new ids after the last one (50,256 for GPT-2's own)
            special.setdefault(t, len(self._ranks) + len(special))
        return GPT2Tokenizer(self._ranks, special, pat_str=self._pat_str, name=f"{self._enc.name}-chat")

    def to_dict(self) -> dict[str, Any]:
        by_rank = sorted(self._ranks.items(), key=lambda kv: kv[1])
        return {
            **self._header(),
            "pat_str": self._pat_str,
            "special_tokens": self._special,
            # ranks[i] is the base64 of the token whose rank is i (ranks are 0..n-1, checked on load)
            "ranks": [base64.b64encode(b).decode("ascii") for b, _ in by_rank],
        }

    def _canonical(self) -> dict[str, Any]:
        return {key: value for key, value in self.to_dict().items() if key not in ("format", "version", "vocab_size")}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GPT2Tokenizer:
        ranks_b64, special, pat = data.get("ranks"), data.get("special_tokens", {}), data.get("pat_str", GPT2_PATTERN)
        if not isinstance(ranks_b64, list) or not isinstance(special, dict) or not isinstance(pat, str):
            raise TokenizerError('a gpt2 tokenizer needs "ranks" (a list), "special_tokens" (an object) and "pat_str"')
        try:
            ranks = {base64.b64decode(t, validate=True): i for i, t in enumerate(ranks_b64)}
        except (TypeError, ValueError):
            raise TokenizerError('"ranks" holds an entry that is not base64') from None
        if len(ranks) != len(ranks_b64):
            raise TokenizerError('"ranks" holds duplicate tokens')
        return cls(ranks, special, pat_str=pat)


def _get_encoding_within(name: str, timeout: float) -> Any:
    """tiktoken.get_encoding(name), waited for at most `timeout` seconds.

    It runs in a daemon thread that the caller stops waiting for, so nothing process-wide changes
    (socket.setdefaulttimeout would reach every socket of the process, a server's included); a
    download that finishes later still lands in tiktoken's cache.

    Raises:
        TimeoutError: no encoding after `timeout` seconds; else whatever tiktoken raised.
    """
    import tiktoken

    outcome: dict[str, Any] = {}

    def fetch() -> None:
        try:
            outcome["encoding"] = tiktoken.get_encoding(name)
        except BaseException as e:  # handed to the caller's thread
            outcome["error"] = e

    worker = threading.Thread(target=fetch, name=f"tiktoken-{name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise TimeoutError(f"tiktoken's {name} encoding did not arrive within {timeout:g} s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["encoding"]


def _sibling(path: Path, renames: list[tuple[str, str]], fallbacks: list[str]) -> Path:
    """The other file of a vocab/merges pair: by name pattern (gpt2-vocab.json -> gpt2-merges.txt) or usual name."""
    names = [path.name.replace(a, b) for a, b in renames if a in path.name] + fallbacks
    for name in names:
        if name != path.name and (path.parent / name).is_file():
            return path.parent / name
    raise TokenizerError(
        f"{path}: its partner file is missing (looked for {', '.join(dict.fromkeys(names))} beside it)"
    )


def _as_gpt2(tokenizer: Tokenizer, where: Path) -> GPT2Tokenizer:
    if not isinstance(tokenizer, GPT2Tokenizer):
        raise TokenizerError(f"{where} holds a {tokenizer.kind} tokenizer, not GPT-2's")
    return tokenizer
