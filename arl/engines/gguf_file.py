"""A GGUF file's metadata and tensors, read in one pass over its header, and the transformers
config and weights of a llama-architecture one (`gguf_llama_config`, `gguf_llama_weights`).

The offline default model is a GGUF (`arl.engines.model`). gguf-py's ``GGUFReader`` builds a
numpy view per element of every metadata array while it opens a file, seconds for a vocabulary
of 49k tokens and as many merges, and transformers opens the file anew for the config, the
tokenizer and the weights. Here the header is parsed once with `struct` and each tensor is a
view of the memory-mapped file, dequantized by gguf-py's own kernels (`gguf.quants`).

The layout (GGUF v2/v3, little-endian): magic ``GGUF``, version (u32), tensor count (u64),
metadata count (u64); each metadata entry a key (u64 length + UTF-8), a value type (u32) and
its value (strings as u64 length + bytes, arrays as item type u32 + count u64 + items); each
tensor's name, dimension count (u32), dimensions (u64 each, innermost first), type (u32) and
offset (u64) into the data section, which starts at the next multiple of ``general.alignment``
(32 unless set).
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import attrs
import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Value type -> the struct of that scalar type.
_SCALARS = {
    vtype: struct.Struct(fmt)
    for vtype, fmt in {
        0: "<B",
        1: "<b",
        2: "<H",
        3: "<h",
        4: "<I",
        5: "<i",
        6: "<f",
        7: "<?",
        10: "<Q",
        11: "<q",
        12: "<d",
    }.items()
}


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands, or not one arl converts (named)."""


@attrs.frozen
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: outermost first (the file lists innermost first)
    qtype: int  # gguf.GGMLQuantizationType's value
    offset: int  # bytes from the start of the file
    nbytes: int


class GGUFFile:
    """``metadata`` (key -> value: Python scalars, strings, lists) and ``tensors`` (in file
    order) of the GGUF at ``path``; `weights` dequantizes one tensor to float32."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        with open(self.path, "rb") as fh:
            if not self.path.stat().st_size:
                raise GGUFError(f"{self.path} is empty, not a GGUF file")
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._take(4) != _MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic)")
        self.version = self._scalar(4)
        if self.version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {self.version}; this reader knows 2 and 3")
        n_tensors, n_meta = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_meta):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            infos.append((name, dims, self._scalar(4), self._scalar(10)))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, qtype, offset in infos:
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
            except (ValueError, KeyError):
                raise GGUFError(f"{self.path}: tensor {name!r} has unknown type {qtype}") from None
            nbytes = int(np.prod(dims, dtype=np.int64)) // block * type_size
            if start + offset + nbytes > len(self._map):
                raise GGUFError(f"{self.path}: tensor {name!r} runs past the end of the file")
            self.tensors.append(
                TensorInfo(name, tuple(reversed(dims)), qtype, start + offset, nbytes)
            )

    def weights(self, info: TensorInfo) -> np.ndarray:
        """The tensor as float32 (a fresh array), dequantized if it is quantized."""
        from gguf import GGMLQuantizationType, dequantize

        rows = info.shape[:-1]
        raw = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        raw = raw.reshape(*rows, info.nbytes // max(1, int(np.prod(rows, dtype=np.int64))))
        out = dequantize(raw, GGMLQuantizationType(info.qtype))
        if np.may_share_memory(out, raw):  # F32 comes back as a view of the file's map
            out = out.copy()
        return out.astype(np.float32, copy=False).reshape(info.shape)

    def close(self) -> None:
        self._map.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- header parsing

    def _need(self, n: int) -> int:
        """The offset of the next ``n`` header bytes, which are then taken."""
        if self._pos + n > len(self._map):
            raise GGUFError(f"{self.path}: the header ends early (truncated file?)")
        at, self._pos = self._pos, self._pos + n
        return at

    def _take(self, n: int) -> bytes:
        at = self._need(n)
        return self._map[at : at + n]

    def _scalar(self, vtype: int) -> Any:
        scalar = _SCALARS[vtype]
        return scalar.unpack_from(self._map, self._need(scalar.size))[0]

    def _string(self) -> str:
        return self._take(self._scalar(10)).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item in _SCALARS:  # one unpack for the whole array
                scalar = _SCALARS[item]
                at = self._need(scalar.size * count)
                return list(struct.unpack_from(f"<{count}{scalar.format[-1]}", self._map, at))
            return [self._value(item) for _ in range(count)]
        if vtype not in _SCALARS:
            raise GGUFError(f"{self.path}: metadata value type {vtype} is not a GGUF type")
        return self._scalar(vtype)


# GGUF's llama tensor names -> transformers' (``blk.{i}.`` -> ``model.layers.{i}.``).
_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# GGUF metadata (``llama.`` + key) -> transformers' config keys.
_GGUF_CONFIG = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_GGUF_TOKEN_IDS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute_rotary(w: Any, heads: int) -> Any:
    """Undo llama.cpp's reordering of a q/k projection's rows for its rotary layout: per head,
    the rows of each pair (half ``i`` and half ``i + dim/2`` in transformers' layout) are
    interleaved in the GGUF."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_llama_config(gguf: GGUFFile) -> Any:
    """The transformers config of a llama-architecture GGUF, from its metadata (the keys
    transformers' own GGUF loading reads for llama)."""
    from transformers import AutoConfig

    meta = gguf.metadata
    if meta.get("general.architecture") != "llama":
        raise GGUFError(
            f"{gguf.path.name}: a {meta.get('general.architecture')!r} GGUF; arl converts llama"
        )
    kwargs = {
        hf: meta[f"llama.{key}"] for key, hf in _GGUF_CONFIG.items() if f"llama.{key}" in meta
    }
    kwargs |= {hf: meta[key] for key, hf in _GGUF_TOKEN_IDS.items() if key in meta}
    # No output layer in the file: it is the input embedding's (transformers' rule too).
    kwargs["tie_word_embeddings"] = all(t.name != "output.weight" for t in gguf.tensors)
    if "general.name" in meta:  # kept in config.json, as transformers' GGUF loading keeps it
        kwargs["_model_name_or_path"] = meta["general.name"]
    return AutoConfig.for_model("llama", **kwargs)


def gguf_llama_weights(gguf: GGUFFile) -> dict[str, Any]:
    """The dequantized fp32 weights (torch tensors) of a llama-architecture GGUF under
    transformers' names; a name this table does not know is refused (it would be a weight the
    converted model silently lacks)."""
    import torch

    heads = gguf.metadata["llama.attention.head_count"]
    kv_heads = gguf.metadata.get("llama.attention.head_count_kv", heads)
    out: dict[str, Any] = {}
    for t in gguf.tensors:
        layer, _, rest = t.name.partition(".")
        if t.name in _GGUF_TOP:
            name = _GGUF_TOP[t.name]
        elif layer == "blk" and rest.partition(".")[2] in _GGUF_LAYER:
            index, _, key = rest.partition(".")
            name = f"model.layers.{int(index)}.{_GGUF_LAYER[key]}"
        else:
            raise GGUFError(
                f"{gguf.path.name}: tensor {t.name!r} has no llama counterpart in arl's converter"
            )
        w = gguf.weights(t)
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _unpermute_rotary(w, heads if name.endswith("q_proj.weight") else kv_heads)
        out[name] = torch.from_numpy(w)
    return out
