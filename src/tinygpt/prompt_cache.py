"""A prompt cache: the keys and values of sequences generated before, kept so that a prompt starting with the
same tokens (a conversation's next turn, a shared system message) copies them instead of computing them again.

An entry is a sequence's tokens and its KV cache row over them. A new prompt takes the longest prefix any
entry shares with it, checked token for token (a chat template that rewrites earlier turns shares less, and
costs only the prefill it would have cost anyway), and always leaves its last token to the model, whose
logits choose the first new token. Entries live within a byte budget, the least recently used going first;
an entry that another extends is dropped (the longer one holds it).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .kv_cache import KVCache


class PromptCache:
    """Keys and values of earlier sequences, reused by prompts that begin as they do.

    Args:
        max_bytes: the most the entries' keys and values may hold together; 0 keeps nothing.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.bytes = 0
        self.hits = 0  # prompts that reused a prefix
        self.reused = 0  # tokens those prompts did not compute again
        # tokens -> (the tokens as a tensor, keys, values (n_layer, 1, n_kv_head, len(tokens), head_dim)), the
        # least recently used first
        self._entries: OrderedDict[tuple[int, ...], tuple[torch.Tensor, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def load(self, tokens: list[int], row: KVCache) -> int:
        """Copy into `row` (a one-sequence cache view) the keys and values of the longest prefix of `tokens`
        an entry holds, at most all but the last token; returns how many positions were filled (0: none).

        Args:
            tokens: the prompt, as the row is to hold it from position 0.
            row: its KV cache row (KVCache.slot), long enough for the prompt.
        """
        best, found, ids = 0, None, torch.tensor(tokens, dtype=torch.long)
        for key, (held, _, _) in self._entries.items():
            n = _shared(held, ids, len(tokens) - 1)
            if n > best:
                best, found = n, key
        if found is None:
            return 0
        self._entries.move_to_end(found)
        _, keys, values = self._entries[found]
        row.k[:, :, :, :best].copy_(keys[:, :, :, :best])
        row.v[:, :, :, :best].copy_(values[:, :, :, :best])
        self.hits += 1
        self.reused += best
        return best

    def store(self, tokens: list[int], row: KVCache) -> None:
        """Keep `tokens` and row's keys and values over their positions (0 .. len(tokens) - 1), unless an
        entry already holds them; entries they extend are dropped, then the least recently used until the
        budget holds.

        Args:
            tokens: what the row holds from position 0.
            row: the sequence's KV cache row (KVCache.slot).
        """
        key, n = tuple(tokens), len(tokens)
        size = 2 * row.k[:, :, :, :n].numel() * row.k.element_size()
        if not n or size > self.max_bytes:
            return
        ids = torch.tensor(tokens, dtype=torch.long)
        for other, (held, _, _) in list(self._entries.items()):
            shared = _shared(held, ids, n)
            if shared == len(held):  # a prefix of the new one (or the same): the new one holds it
                self._drop(other)
            elif shared == n:  # the new one is a prefix of it: nothing to add
                self._entries.move_to_end(other)
                return
        while self._entries and self.bytes + size > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = (ids, row.k[:, :, :, :n].clone(), row.v[:, :, :, :n].clone())
        self.bytes += size

    def _drop(self, key: tuple[int, ...]) -> None:
        _, keys, values = self._entries.pop(key)
        self.bytes -= keys.numel() * keys.element_size() + values.numel() * values.element_size()

    def stats(self) -> dict:
        """Entries, bytes held and the budget, prompts that reused a prefix and the tokens they reused."""
        return {"entries": len(self._entries), "bytes": self.bytes, "max_bytes": self.max_bytes, "hits": self.hits,
                "reused_tokens": self.reused}


def _shared(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    """How many leading tokens the id tensors a and b share, at most `limit`."""
    n = min(len(a), len(b), limit)
    if n <= 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.int().argmax())
    return first if bool(differ[first]) else n
