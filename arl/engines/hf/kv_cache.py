"""The slot KV cache of the hf engine: one row per running request, each at its own length."""

from __future__ import annotations

import torch

from arl.engines.hf.errors import HFEngineError

_MIN_SEQ_CAPACITY = 128  # first KV allocation; grows by doubling up to max_seq_len
_MIN_ROW_CAPACITY = 4


class SlotKVCache:
    """KV cache of fixed rows: row i of each layer's buffer holds request i at its own length.

    The model calls `update` once per layer. In prefill mode the new rows' keys/values are
    written at positions 0..L-1 and returned as they are (a new prompt attends only to itself);
    in decode mode each row's single new key/value is written at that row's position and the
    first ``kv_len`` positions of all active rows are returned for the masked attention.
    """

    def __init__(
        self, max_rows: int, max_seq: int, seq_align: int = 1, layers: int | None = None
    ) -> None:
        self._max_rows, self._max_seq, self._seq_align = max_rows, max_seq, seq_align
        self._rows_cap, self._seq_cap = 0, 0
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        # With ``layers`` (every layer's keys and values of one shape): one buffer
        # [layers, 2, rows, kv_heads, positions, dim] whose slices are the layers' buffers, so
        # moving rows (compaction) is one copy for the whole model rather than one per layer,
        # and each layer's keys and values are one contiguous block (`layer_kv`).
        self._layers = layers
        self._kv: torch.Tensor | None = None
        self._prefill: tuple[int, int, int] | None = None
        self._decode: tuple[int, int, torch.Tensor, torch.Tensor] | None = None
        self._kv_len = 0
        self.generation = 0  # bumped when buffers are reallocated (captured graphs go stale)

    @property
    def max_rows(self) -> int:
        """The most rows the cache may ever hold."""
        return self._max_rows

    @property
    def row_capacity(self) -> int:
        """Rows the buffers hold (after the next `update`)."""
        return self._rows_cap

    @property
    def allocated(self) -> bool:
        """Whether the stacked buffers exist at the reserved capacity, so that a layer's
        `layer_kv` returns them as they are (a CUDA graph may read them by address)."""
        kv = self._kv
        return kv is not None and kv.shape[2] >= self._rows_cap and kv.shape[4] >= self._seq_cap

    @property
    def seq_capacity(self) -> int:
        """Positions per row the buffers hold (after the next `update`): a multiple of
        ``seq_align``, which may exceed ``max_seq`` by less than that."""
        return self._seq_cap

    def reserve(self, rows: int, seq: int) -> None:
        """Make room for ``rows`` rows of ``seq`` positions (buffers grow by doubling)."""
        if rows > self._rows_cap:
            self._rows_cap = min(self._max_rows, max(rows, 2 * self._rows_cap, _MIN_ROW_CAPACITY))
        if seq > self._seq_cap:
            seq = min(self._max_seq, max(seq, 2 * self._seq_cap, _MIN_SEQ_CAPACITY))
            # Rounded up so that a kernel reading whole blocks of positions stays inside a row.
            self._seq_cap = -(-seq // self._seq_align) * self._seq_align

    def begin_prefill(self, row0: int, rows: int, length: int) -> None:
        """The next forward writes ``rows`` new rows from ``row0``, ``length`` tokens each."""
        self._prefill, self._decode, self._kv_len = (row0, rows, length), None, length

    def begin_decode(self, row_idx: torch.Tensor, positions: torch.Tensor, kv_len: int) -> None:
        """The next forward decodes one token for rows 0..n-1, written at ``positions``."""
        self._decode = (len(row_idx), kv_len, row_idx, positions)
        self._prefill, self._kv_len = None, kv_len

    def _buffers(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer(layer, like.shape[1], like.shape[3], like.dtype, like.device)

    def layer(
        self, layer: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value buffers of ``layer`` ([rows, kv_heads, positions, dim]), allocated
        or grown to the reserved size first."""
        if self._layers is not None:
            return self._stacked(layer, kv_heads, dim, dtype, device)
        k = self.keys.get(layer)
        if k is None or k.shape[0] < self._rows_cap or k.shape[2] < self._seq_cap:
            shape = (self._rows_cap, kv_heads, self._seq_cap, dim)
            # zeros, not empty: masked positions are multiplied by 0 in attention, and a NaN
            # left in uninitialised memory would survive that.
            new_k = torch.zeros(shape, dtype=dtype, device=device)
            new_v = torch.zeros(shape, dtype=dtype, device=device)
            if k is not None:
                v = self.values[layer]
                new_k[: k.shape[0], :, : k.shape[2]] = k
                new_v[: v.shape[0], :, : v.shape[2]] = v
            self.keys[layer], self.values[layer] = new_k, new_v
            self.generation += 1
        return self.keys[layer], self.values[layer]

    def layer_kv(
        self, layer: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The keys and values of ``layer`` as one contiguous tensor [2, rows, kv_heads,
        positions, dim] (a cache made with ``layers`` only), allocated or grown first."""
        if self._layers is None:
            raise HFEngineError("SlotKVCache.layer_kv needs a cache made with layers=")
        self._stacked(layer, kv_heads, dim, dtype, device)
        assert self._kv is not None
        return self._kv[layer]

    def _stacked(
        self, layer: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kv = self._kv
        if kv is None or kv.shape[2] < self._rows_cap or kv.shape[4] < self._seq_cap:
            assert self._layers is not None
            shape = (self._layers, 2, self._rows_cap, kv_heads, self._seq_cap, dim)
            new = torch.zeros(shape, dtype=dtype, device=device)  # zeros: see `layer`
            if kv is not None:
                new[:, :, : kv.shape[2], :, : kv.shape[4]] = kv
            self._kv = new
            self.keys = {i: new[i, 0] for i in range(self._layers)}
            self.values = {i: new[i, 1] for i in range(self._layers)}
            self.generation += 1
        return self.keys[layer], self.values[layer]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this step's keys/values for ``layer_idx`` and return what attention reads."""
        k, v = self._buffers(layer_idx, key_states)
        if self._prefill is not None:
            row0, rows, length = self._prefill
            k[row0 : row0 + rows, :, :length] = key_states
            v[row0 : row0 + rows, :, :length] = value_states
            return key_states, value_states
        if self._decode is None:
            raise HFEngineError("SlotKVCache.update called outside a prefill or decode step")
        n, kv_len, row_idx, positions = self._decode
        k[row_idx, :, positions] = key_states[:, :, 0]
        v[row_idx, :, positions] = value_states[:, :, 0]
        return k[:n, :, :kv_len], v[:n, :, :kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Longest length attended to in this step (asked for when position ids are absent)."""
        return self._kv_len

    def move_rows(self, dst: torch.Tensor, src: torch.Tensor, kv_len: int) -> None:
        """Copy rows ``src`` into rows ``dst`` (first ``kv_len`` positions): compaction."""
        if self._kv is not None:
            kv = self._kv
            kv[:, :, dst, :, :kv_len] = kv[:, :, src, :, :kv_len]
            return
        for layer, k in self.keys.items():
            v = self.values[layer]
            k[dst, :, :kv_len] = k[src, :, :kv_len]
            v[dst, :, :kv_len] = v[src, :, :kv_len]

    def free(self) -> None:
        """Drop the buffers (closing, or a warm-up that did not fit); later use reallocates."""
        self.keys, self.values, self._kv = {}, {}, None
        self._rows_cap = self._seq_cap = 0
        self.generation += 1
