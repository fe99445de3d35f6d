"""`arl.bench.gpu.prepare_model`'s random models: loadable as they are, and a model folder passed
as ``--tokenizer`` lends its tokenizer, never its weights."""

from __future__ import annotations

from pathlib import Path

from arl.bench.gpu import prepare_model
from arl.engines.model import validate_model_dir


def test_random_model_keeps_its_weights_when_the_tokenizer_comes_from_a_model_folder(
    tmp_path: Path,
):
    lender = tmp_path / "other-model"
    lender.mkdir()
    (lender / "model.safetensors").write_bytes(b"not these weights")
    (lender / "model.safetensors.index.json").write_text("{}")
    (lender / "config.json").write_text('{"model_type": "other"}')
    (lender / "tokenizer_config.json").write_text('{"model_max_length": 77}')
    (lender / "tokenizer.json").write_text("{}")

    path = Path(prepare_model("random", str(lender), tmp_path / "work"))
    validate_model_dir(path)
    assert (path / "tokenizer.json").exists()
    assert (path / "tokenizer_config.json").read_text() == '{"model_max_length": 77}'
    assert not (path / "model.safetensors.index.json").exists()
    assert (path / "model.safetensors").stat().st_size > 100e6  # the random SmolLM2 weights
    assert '"llama"' in (path / "config.json").read_text()


def test_random_model_without_a_tokenizer_is_a_valid_model_folder(tmp_path: Path):
    path = Path(prepare_model("random", None, tmp_path / "work"))
    assert (path / "tokenizer_config.json").read_text() == "{}"
    validate_model_dir(path)  # raises if the folder is not a usable model folder
