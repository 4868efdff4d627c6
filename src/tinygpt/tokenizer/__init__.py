"""Tokenizers: text <-> token ids, each saved as one JSON file (never a pickle).

Four kinds share one small protocol (`Tokenizer`, in `base` with what they have in common), a module each:

- `char.CharTokenizer`: one id per distinct character of the corpus, in sorted order (nanoGPT's
  shakespeare_char). Text with characters outside the vocabulary is refused, naming them.
- `bpe.BPETokenizer`: byte-level BPE trained on the user's corpus with Hugging Face `tokenizers`.
  Text is a sequence of UTF-8 bytes to it, so any string round-trips exactly.
- `gpt2.GPT2Tokenizer`: GPT-2's own BPE through `tiktoken`, from local files. The saved JSON carries
  the ranks, so a data or run folder never needs the network again.
- `hf.HFTokenizer`: a pretrained model's own tokenizer.json, special tokens and Jinja chat template
  (`hf_folder` reads a Hugging Face folder's tokenizer files as one of these kinds).

Every tokenizer has a fingerprint (`tokenizer.fingerprint()`): a SHA-256 of what it does, the same
however it was built or saved. Data folders and runs carry it, so data prepared with another
tokenizer is refused rather than trained on (`tinygpt.data.folder.check_same_tokenizer`).

Encoding treats all text as text: the literal string "<|endoftext|>" is never turned into the
separator token (tiktoken's `encode_ordinary`). Documents are separated by the data pipeline,
which inserts `eot_id` between them. Decoding renders the separator as "<|endoftext|>".

Chat: a tokenizer may carry a `ChatTemplate` (`chat.with_chat_template`), saved in its JSON. The template
names special tokens (one per role's start, one for the end of a turn) that get ids of their own:
reserved ids after the characters (char), added special tokens (bpe), new ids after GPT-2's 50,256
(gpt2). Like "<|endoftext|>", they are never produced by encoding text: only `render_chat` places
them, so a user who types "<|end|>" gets the characters, not the end of their turn. The templates are
`chat_template`'s, rendering and fitting a conversation `chat`'s; `incremental` streams ids as text.

The names below are what `from tinygpt.tokenizer import ...` gives; tinygpt's own modules import from
the topic module.
"""

from .base import EOT, Tokenizer, load_tokenizer, tokenizer_from_dict
from .bpe import BPETokenizer, byte_to_unicode
from .char import CharTokenizer
from .chat import fit_chat_prompt, render_chat, render_chat_prompt, stop_ids, with_chat_template
from .chat_template import ChatTemplate, JinjaChatTemplate, Rendered
from .gpt2 import GPT2_PATTERN, GPT2Tokenizer
from .hf import HFTokenizer
from .incremental import IncrementalDecoder

__all__ = [
    "Tokenizer",
    "CharTokenizer",
    "BPETokenizer",
    "GPT2Tokenizer",
    "HFTokenizer",
    "EOT",
    "GPT2_PATTERN",
    "byte_to_unicode",
    "load_tokenizer",
    "tokenizer_from_dict",
    "ChatTemplate",
    "JinjaChatTemplate",
    "Rendered",
    "with_chat_template",
    "render_chat",
    "render_chat_prompt",
    "fit_chat_prompt",
    "stop_ids",
    "IncrementalDecoder",
]
