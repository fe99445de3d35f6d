"""arl's GGUF reader and llama converter (`arl.engines.gguf_file`) against gguf-py's reader and
transformers' own GGUF loading, on a small llama written here the way llama.cpp writes one
(q/k rows reordered for its rotary layout, 2-D weights quantized to Q8_0, norms in F32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from arl.engines.gguf_file import GGUFError, GGUFFile, gguf_llama_config, gguf_llama_weights

HEADS, KV_HEADS = 4, 2
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_order(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved row by row."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def write_llama_gguf(path: Path, extra_tensor: str | None = None) -> dict[str, torch.Tensor]:
    """A random 2-layer llama as a GGUF at ``path``; returns its transformers weights."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    state = LlamaForCausalLM(config).state_dict()
    w = GGUFWriter(str(path), "llama")
    w.add_name("tiny test llama")
    w.add_block_count(2)
    w.add_context_length(128)
    w.add_embedding_length(64)
    w.add_feed_forward_length(96)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(16)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(256)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_array("test.strings", ["a", "ünï", ""])  # kinds of values the reader must walk past
    w.add_array("test.floats", [0.5, -1.25])
    w.add_bool("test.flag", True)
    for name, tensor in state.items():
        if name == "lm_head.weight":  # tied: a GGUF without output.weight
            continue
        if name in _TOP:
            gname = _TOP[name]
        else:
            _, _, index, rest = name.split(".", 3)
            gname = f"blk.{index}.{_LAYER[rest]}"
        a = tensor.numpy().astype(np.float32)
        if gname.endswith(("attn_q.weight", "attn_k.weight")):
            a = _llama_cpp_order(a, HEADS if "attn_q" in gname else KV_HEADS)
        if a.ndim == 2:
            w.add_tensor(
                gname, quantize(a, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0
            )
        else:
            w.add_tensor(gname, a)
    if extra_tensor:
        w.add_tensor(extra_tensor, np.ones(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return state


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_llama_gguf(path)


def test_the_reader_gives_gguf_pys_metadata_and_tensors(llama_gguf):
    from gguf import GGUFReader, dequantize

    path, _ = llama_gguf
    theirs = GGUFReader(path)
    with GGUFFile(path) as ours:
        fields = {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
        assert ours.metadata.keys() == fields.keys()
        for key, value in fields.items():
            assert ours.metadata[key] == value, key
        assert ours.metadata["test.strings"] == ["a", "ünï", ""]
        assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
        for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
            got, want = ours.weights(mine), dequantize(ref.data, ref.tensor_type)
            assert got.dtype == np.float32 and got.flags.writeable
            np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=mine.name)


def test_the_converter_gives_transformers_own_config_and_weights(llama_gguf):
    from transformers import AutoModelForCausalLM

    path, original = llama_gguf
    ref = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    with GGUFFile(path) as gguf:
        config = gguf_llama_config(gguf)
        state = gguf_llama_weights(gguf)
    theirs = ref.state_dict()
    assert set(theirs) - set(state) == {"lm_head.weight"}  # tied: the embedding's
    for name, tensor in state.items():
        assert torch.equal(tensor, theirs[name]), name
    skip = ("dtype", "quantization_config")
    want = {k: v for k, v in ref.config.to_diff_dict().items() if k not in skip}
    assert config.to_diff_dict() == want
    # The q/k rows are back in transformers' order: the originals, up to Q8_0's rounding.
    for name in (
        "model.layers.1.self_attn.q_proj.weight",
        "model.layers.1.self_attn.k_proj.weight",
    ):
        assert torch.allclose(state[name], original[name], atol=2e-3), name
    assert torch.equal(state["model.norm.weight"], original["model.norm.weight"])  # F32: exact


def test_a_tensor_the_converter_does_not_know_is_named(tmp_path):
    path = tmp_path / "extra.gguf"
    write_llama_gguf(path, extra_tensor="rope_freqs.weight")
    with GGUFFile(path) as gguf, pytest.raises(GGUFError, match="'rope_freqs.weight' has no llama"):
        gguf_llama_weights(gguf)


def test_files_that_are_not_gguf_or_are_cut_short_are_named(llama_gguf, tmp_path):
    path, _ = llama_gguf
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + path.read_bytes()[4:])
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(bad)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="is empty, not a GGUF file"):
        GGUFFile(tmp_path / "empty.gguf")
    data = path.read_bytes()
    for cut in (200, len(data) - 100):  # inside the header; inside the last tensor's data
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match="ends early|past the end"):
            GGUFFile(short)
