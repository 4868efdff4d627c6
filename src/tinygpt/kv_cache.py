"""A preallocated key/value cache for decoding, owned by the generator and passed into the model.

The buffers have a fixed shape (n_layer, batch, n_kv_head, max_len, head_dim), so every decode step
sees the same tensor shapes (what torch.compile wants). The caller says where each new token
lands with `input_pos`; the cache keeps no position of its own.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for `batch_size` sequences of up to `max_len` tokens.

    Args:
        n_layer, batch_size, n_head, max_len, head_dim: buffer sizes; n_head is the model's key/value
            heads (n_kv_head: fewer than its query heads under grouped-query attention).
        dtype, device: where the buffers live; match the model's.
    """

    def __init__(
        self,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (n_layer, batch_size, n_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._key_pos = torch.arange(max_len, device=device)

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int | None = None) -> KVCache:
        """A cache sized for `model` (a tinygpt GPT): up to its block_size tokens per sequence.

        It holds the model's dtype, except on a CPU, where it stays float32: PyTorch's bfloat16
        attention kernel there is several times slower than its float32 one for a single query (the
        README's Performance section), which outweighs reading twice the bytes.
        """
        cfg = model.config
        weight = model.wte.weight
        return cls(
            cfg.n_layer, batch_size, cfg.kv_heads, max_len or cfg.block_size, cfg.head_dim,
            dtype=_cache_dtype(weight), device=weight.device,
        )

    @staticmethod
    def bytes_for_model(model: torch.nn.Module, batch_size: int, max_len: int | None = None) -> int:
        """The bytes `for_model(model, batch_size, max_len)` allocates (keys and values), without allocating."""
        cfg = model.config
        elements = cfg.n_layer * batch_size * cfg.kv_heads * (max_len or cfg.block_size) * cfg.head_dim
        return 2 * elements * _cache_dtype(model.wte.weight).itemsize

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def slot(self, index: int) -> KVCache:
        """A one-sequence view of row `index`, sharing storage (for per-request prefill)."""
        return self.rows(index, index + 1)

    def rows(self, start: int, stop: int, length: int | None = None) -> KVCache:
        """A view of rows start..stop-1, sharing storage (a server decodes only the rows in use).

        With `length`, only positions 0..length-1 are seen, so attention costs what the longest
        row holds rather than max_len (positions past every row's query are masked anyway).
        """
        view = object.__new__(KVCache)
        view.k = self.k[:, start:stop, :, :length]
        view.v = self.v[:, start:stop, :, :length]
        view._key_pos = self._key_pos[:length]
        return view

    def positions(self, input_pos: torch.Tensor, batch_size: int) -> torch.Tensor:
        """`input_pos` checked against the buffers: (T,) when every row is at the same positions
        (kept that way: the writes are then one contiguous copy), or (B, T) per row."""
        if input_pos.dim() == 1:
            if batch_size != self.batch_size:
                raise ValueError(f"batch of {batch_size} rows for a cache of {self.batch_size}")
            return input_pos
        if input_pos.shape[0] != self.batch_size:
            raise ValueError(f"batch of {input_pos.shape[0]} rows for a cache of {self.batch_size}")
        return input_pos

    def span(self, input_pos: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """What attention reads for queries at `input_pos`: (key positions, mask over them).

        In eager mode on a CPU only the positions written so far are read, since reading fewer
        keys is faster (a GPT-2 step at position 100 needs a tenth of its 1024-long buffers), and
        one query at the newest position needs no mask at all (mask None: it sees every key).
        Under torch.compile or on an accelerator the whole buffer is read, so shapes stay static,
        and the mask hides what is not written yet.

        Returns:
            (length, mask): mask is bool (B or 1, 1, T, length), True where a query at position p
            may look (keys at positions <= p), or None.
        """
        if input_pos.device.type != "cpu" or torch.compiler.is_compiling():
            return self.max_len, self.attention_mask(input_pos)
        length = int(input_pos.max()) + 1
        if input_pos.dim() == 1 and input_pos.numel() == 1:  # a decode step of rows at one position
            return length, None
        return length, self.attention_mask(input_pos, length)

    def attention_mask(self, input_pos: torch.Tensor, length: int | None = None) -> torch.Tensor:
        """(B or 1, 1, T, length) bool: a query at position p sees the cached keys at positions <= p.

        Args:
            input_pos: positions (T,) or (B, T), as `positions` returns them.
            length: key positions covered (default max_len).
        """
        rows = input_pos if input_pos.dim() == 2 else input_pos.unsqueeze(0)  # (B or 1, T)
        return (self._key_pos[:length] <= rows.unsqueeze(-1)).unsqueeze(1)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_kv_head, T, head_dim) at positions `input_pos` ((T,) or (B, T)); return the
        buffers' first `length` positions (default all), (B, n_kv_head, length, head_dim)."""
        k_buf, v_buf = self.k[layer], self.v[layer]
        if input_pos.dim() == 1:  # every row at the same positions
            k_buf.index_copy_(2, input_pos, k.to(k_buf.dtype))
            v_buf.index_copy_(2, input_pos, v.to(v_buf.dtype))
        else:
            rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)  # (B, 1)
            # Advanced indices on dims 0 and 2 put the (B, T) index dims first: values go in as (B, T, H, D).
            k_buf[rows, :, input_pos] = k.transpose(1, 2).to(k_buf.dtype)
            v_buf[rows, :, input_pos] = v.transpose(1, 2).to(v_buf.dtype)
        return k_buf[:, :, :length], v_buf[:, :, :length]


def _cache_dtype(weight: torch.Tensor) -> torch.dtype:
    return torch.float32 if weight.device.type == "cpu" else weight.dtype
