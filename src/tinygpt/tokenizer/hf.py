"""A pretrained model's own tokenizer as its Hugging Face folder has it: tokenizer.json run by `tokenizers`,
with tokenizer_config.json's special tokens and the model's Jinja chat template (HFTokenizer).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from ..errors import TokenizerError
from .base import EOT, digest
from .bpe import TokenizersKind, byte_level_table
from .chat_template import JinjaChatTemplate

# a tokenizer.json BPE model's options and the values that leave its merges to decide alone
BPE_OPTIONS = {"dropout": None, "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
               "fuse_unk": False, "byte_fallback": False, "ignore_merges": False}

# tokenizer_config.json's names for the special tokens a chat template sees (transformers' special_tokens_map)
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def _decoder_steps(data: dict[str, Any]) -> list[dict[str, Any]]:
    """A tokenizer.json's decoder as a list of steps: a Sequence's, or the one."""
    decoder = data.get("decoder") or {}
    steps = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
    return [step for step in steps if isinstance(step, dict)]


def _is_byte_level(data: dict[str, Any]) -> bool:
    """Whether a tokenizer.json decodes byte-level tokens (GPT-2's alphabet)."""
    return any(step.get("type") == "ByteLevel" for step in _decoder_steps(data))


def _as_transformers_builds(data: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """tokenizer.json as transformers 5 runs it. Its LlamaTokenizer class (TinyLlama's and Llama 2's
    tokenizer_class) builds a SentencePiece pipeline of its own around tokenizer.json's vocabulary and
    merges: no normalizer, a Metaspace pre-tokenizer that puts "▁" before the first piece only
    (legacy false, its default; before every piece with legacy true; never without add_prefix_space),
    and the matching decoder. Every other tokenizer.json (byte-level ones included, which it loads for
    a LlamaTokenizer too, as Llama 3's) runs as written: the classes that rebuild theirs (Qwen2's,
    GPT-2's) rebuild what the Hub's files hold."""
    name = config.get("tokenizer_class") or ""
    if name.removesuffix("Fast") != "LlamaTokenizer" or _is_byte_level(data):
        return data
    from tokenizers import Tokenizer as HFTokenizerCore
    from tokenizers import decoders, pre_tokenizers

    prefix = config.get("add_prefix_space") is not False
    scheme = ("always" if config.get("legacy") is True else "first") if prefix else "never"
    tok = HFTokenizerCore.from_str(json.dumps(data))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return json.loads(tok.to_str())


class HFTokenizer(TokenizersKind):
    """A pretrained model's tokenizer as its Hugging Face folder has it: tokenizer.json run by the
    `tokenizers` library (byte-level BPE as SmolLM2, Qwen and Llama 3 have it, or SentencePiece-style
    BPE with byte fallback as TinyLlama's), the special tokens of tokenizer_config.json, and the
    model's Jinja chat template (a JinjaChatTemplate), kept whole in a run's tokenizer.json.

    Text is text, as for every tinygpt tokenizer (`encode`: a "<|im_start|>" typed in a prompt is its
    characters); a rendered chat template is encoded with its special tokens found (`encode_rendered`),
    as transformers' apply_chat_template does. `added_ids` are the ids transformers puts around a text
    it encodes (Llama's and TinyLlama's BOS, say): tokenizer.json's post-processor's, as transformers 5
    has it (it ignores tokenizer_config.json's add_bos_token and add_eos_token beside a tokenizer.json).
    eot_id, the document separator, is the eos token.

    Args:
        data: tokenizer.json's content.
        config: bos_token, eos_token, unk_token, pad_token (strings or None), split_special_tokens, tokenizer_class,
            legacy and add_prefix_space (see _as_transformers_builds), and stop: the ids generation
            ends at (generation_config.json's eos_token_id).
        chat_template: the Jinja template, or None.
    """

    kind = "hf"

    def __init__(self, data: dict[str, Any], config: dict[str, Any], chat_template: str | None = None) -> None:
        from tokenizers import Tokenizer as HFTokenizerCore

        model = data.get("model") if isinstance(data, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE":
            kind = model.get("type") if isinstance(model, dict) else None
            raise TokenizerError(f"a {kind} tokenizer.json is not supported (tinygpt reads BPE: byte-level, or "
                                 "SentencePiece-style with byte fallback)")
        self._data, self.config = data, dict(config)
        try:
            pipeline = json.dumps(_as_transformers_builds(data, self.config))
            self._tok = HFTokenizerCore.from_str(pipeline)
            self._rendered = HFTokenizerCore.from_str(pipeline)
        except Exception as e:
            raise TokenizerError(f"tokenizer.json does not load ({type(e).__name__}: {e})") from None
        self._tok.encode_special_tokens = True  # a prompt's "<|im_end|>" is text
        self._rendered.encode_special_tokens = bool(config.get("split_special_tokens", False))
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1
        self._bytes = self._byte_table(data, vocab)
        names = {name: config.get(name) for name in SPECIAL_TOKEN_NAMES}
        for name, token in names.items():
            if token is not None and token not in vocab:
                raise TokenizerError(f"tokenizer_config.json's {name} {token!r} is not in the vocabulary")
        probe = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(full) - len(probe) + 1) if full[i:i + len(probe)] == probe), 0)
        self._added = (full[:at], full[at + len(probe):])
        self.eot_id = vocab.get(names["eos_token"]) if names["eos_token"] is not None else None
        self.bos_id = vocab.get(names["bos_token"]) if names["bos_token"] is not None else None
        stop = config.get("stop") or []
        if not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in stop):
            raise TokenizerError(f"generation stop ids {stop!r} are not ids of the vocabulary")
        self.chat_template = JinjaChatTemplate(chat_template, self.template_tokens()) if chat_template else None

    @staticmethod
    def _byte_table(data: dict[str, Any], vocab: dict[str, int]) -> list[bytes]:
        """Each id's bytes, as the tokenizer's decoder writes them: byte-level tokens in GPT-2's alphabet,
        or SentencePiece pieces ("▁" a space, "<0xNN>" a byte); added tokens as their text."""
        added = {t["id"]: t["content"] for t in data.get("added_tokens") or [] if isinstance(t, dict)}
        if _is_byte_level(data):
            return byte_level_table(vocab, added)
        steps = _decoder_steps(data)
        kinds = {step.get("type") for step in steps}
        if "Metaspace" not in kinds and not any(s.get("type") == "Replace" and s.get("content") == " " for s in steps):
            decoder = (data.get("decoder") or {}).get("type")
            raise TokenizerError(f"a tokenizer.json whose decoder is {decoder!r} is not supported "
                                 "(tinygpt reads byte-level BPE and SentencePiece-style BPE with byte fallback)")
        fallback = "ByteFallback" in kinds
        table = [b""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            if i in added:
                table[i] = added[i].encode("utf-8")
            elif fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                table[i] = bytes([int(token[3:5], 16)])
            else:
                table[i] = token.replace("\u2581", " ").encode("utf-8")
        return table

    def template_tokens(self) -> dict[str, str]:
        """What a chat template sees of the special tokens: bos_token, eos_token, ... (transformers'
        special_tokens_map), the ones tokenizer_config.json names."""
        return {name: self.config[name] for name in SPECIAL_TOKEN_NAMES if self.config.get(name) is not None}

    @property
    def added_ids(self) -> tuple[list[int], list[int]]:
        """(before, after): the ids transformers adds around an encoded text (a BOS, an EOS), or none."""
        return list(self._added[0]), list(self._added[1])

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids generation ends at: generation_config.json's eos ids, the eos token, and the chat
        template's end of turn."""
        ids = set(self.config.get("stop") or [])
        if self.eot_id is not None:
            ids.add(self.eot_id)
        if self.chat_template is not None:
            special = self.special_ids()
            ids.update(special[t] for t in self.chat_template.turn_ends(self) if t in special)
        return sorted(ids)

    def encode_rendered(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A rendered chat template's ids, its special tokens found as such (apply_chat_template's
        encoding: no BOS or EOS added), and each token's (start, end) characters in `text`."""
        try:
            encoding = self._rendered.encode(text, add_special_tokens=False)
        except Exception as e:
            raise TokenizerError(f"cannot encode text: {e}") from None
        return encoding.ids, encoding.offsets

    def decode(self, ids: Iterable[int]) -> str:
        """A text's ids back as transformers decodes them (special tokens written out): a SentencePiece
        tokenizer drops the space its encoding put before the first word, which decode_bytes (each
        token's bytes: what IncrementalDecoder streams of a continuation) keeps."""
        return self._tok.decode(self._check_ids(ids), skip_special_tokens=False)

    def _with_specials(self, tokens: list[str]) -> HFTokenizer:
        return HFTokenizer(json.loads(self._with_added_specials(tokens).to_str()), self.config)

    def to_dict(self) -> dict[str, Any]:
        header = self._header()
        header.pop("chat_template", None)  # this kind keeps its own, in Jinja
        template = self.chat_template.source if self.chat_template is not None else None
        return {**header, "tokenizer": self._data, "config": self.config, "jinja_chat_template": template}

    def _canonical(self) -> dict[str, Any]:
        pipeline = json.loads(self._tok.to_str())  # as it runs: after _as_transformers_builds
        rules, model = self._rules(pipeline), pipeline.get("model") or {}
        # the rules a bpe tokenizer never has, each only where this one has it: without them, it is the
        # bpe tokenizer of the same vocabulary (a tinygpt run's, exported to a Llama-family folder)
        options = {k: model.get(k, v) for k, v in BPE_OPTIONS.items() if model.get(k, v) != v}
        if options:
            rules["options"] = options
        if not _is_byte_level(pipeline):
            rules["decoder"] = pipeline.get("decoder")
        if self.eot_id != self._tok.token_to_id(EOT):
            rules["eot_id"] = self.eot_id
        if any(self._added):
            rules["added_ids"] = [list(self._added[0]), list(self._added[1])]
        if self.chat_template is not None:  # what the template sees, and how its text is encoded
            rules["template_tokens"] = self.template_tokens()
            rules["split_special_tokens"] = bool(self.config.get("split_special_tokens", False))
        return rules

    def fingerprints(self) -> tuple[str, ...]:
        # before the rules above, an hf tokenizer's fingerprint took its files as they were
        inner = {k: v for k, v in self._data.items() if k not in ("version", "truncation", "padding")}
        template = self.chat_template.source if self.chat_template is not None else None
        return self.fingerprint(), digest({"kind": self.kind, "tokenizer": inner, "config": self.config,
                                            "jinja_chat_template": template})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HFTokenizer:
        inner, config, template = data.get("tokenizer"), data.get("config"), data.get("jinja_chat_template")
        if not isinstance(inner, dict) or not isinstance(config, dict) or not (template is None or
                                                                              isinstance(template, str)):
            raise TokenizerError('an hf tokenizer needs "tokenizer" (tokenizer.json\'s object), "config" (an object) '
                                 'and "jinja_chat_template" (text or null)')
        return cls(inner, config, template)
