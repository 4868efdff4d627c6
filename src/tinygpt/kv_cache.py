"""A preallocated key/value cache for decoding, owned by the generator and passed into the model.

The buffers have a fixed shape (n_layer, batch, n_head, max_len, head_dim), so every decode step
sees the same tensor shapes (what torch.compile wants). The caller says where each new token
lands with `input_pos`; the cache keeps no position of its own.
"""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer for `batch_size` sequences of up to `max_len` tokens.

    Args:
        n_layer, batch_size, n_head, max_len, head_dim: buffer sizes.
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
        """A cache sized for `model` (a tinygpt GPT): up to its block_size tokens per sequence."""
        cfg = model.config
        weight = model.wte.weight
        return cls(
            cfg.n_layer, batch_size, cfg.n_head, max_len or cfg.block_size, cfg.head_dim,
            dtype=weight.dtype, device=weight.device,
        )

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
        """`input_pos` of shape (T,) or (B, T) as a (B, T) tensor, checked against the buffers."""
        if input_pos.dim() == 1:
            input_pos = input_pos.unsqueeze(0).expand(batch_size, -1)
        if input_pos.shape[0] != self.batch_size:
            raise ValueError(f"batch of {input_pos.shape[0]} rows for a cache of {self.batch_size}")
        return input_pos

    def attention_mask(self, input_pos: torch.Tensor) -> torch.Tensor:
        """(B, 1, T, max_len) bool: a query at position p sees the cached keys at positions <= p."""
        return (self._key_pos <= input_pos.unsqueeze(-1)).unsqueeze(1)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, input_pos: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, n_head, T, head_dim) at positions `input_pos` (B, T); return the whole buffers."""
        rows = torch.arange(k.shape[0], device=k.device).unsqueeze(1)  # (B, 1)
        k_buf, v_buf = self.k[layer], self.v[layer]
        # Advanced indices on dims 0 and 2 put the (B, T) index dims first: values go in as (B, T, H, D).
        k_buf[rows, :, input_pos] = k.transpose(1, 2).to(k_buf.dtype)
        v_buf[rows, :, input_pos] = v.transpose(1, 2).to(v_buf.dtype)
        return k_buf, v_buf
