"""Data: text and datasets into data folders of token ids, and training batches from them.

A module a topic:

- `sources`: text SOURCEs (files, folders, the built-in corpora python-stdlib and shakespeare);
  `datasources`: dataset SOURCEs (parquet, JSONL, CSV files and folders, Hugging Face `hf:NAME`).
- `settings`: what every prepare checks first and shares (the validation split, the tokenizer it
  encodes with, the separator between documents).
- `text`: `prepare`, text read in chunks and encoded in two passes; `datasets`: datasets in one
  streaming pass on worker threads, resumable; `shards`: the token files written and read as shards.
- `chat`: conversations with their loss masks (`prepare_chat`); `preference`: preference pairs in TRL's
  formats, a prompt with a chosen and a rejected completion (`prepare_preference`).
- `folder`: a data folder (`DataSet`, `load_data`, its checks, the tokenizer's fingerprint a run is
  held to); `inspect`: what `tinygpt inspect data` shows (`inspect_data`).
- `batches`: training batches, packed conversations, preference pairs fitted to a window, and the order a
  run reads them in.

tinygpt's modules import from the topic module; this package gives the names users import from
`tinygpt.data`.
"""

from .batches import get_batch, get_chat_batch, pack_conversations
from .chat import prepare_chat
from .folder import DataSet, load_data
from .inspect import inspect_data
from .preference import prepare_preference
from .sources import resolve_sources
from .text import prepare

__all__ = [
    "prepare", "prepare_chat", "prepare_preference", "resolve_sources", "load_data", "DataSet", "inspect_data",
    "get_batch", "get_chat_batch", "pack_conversations",
]
