"""GSM8K loading (real file and malformed rows), arith generation, StatefulLoader resume."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from arl.config import Config, apply_overrides
from arl.data.arith import make_arith
from arl.data.gsm8k import DatasetError, build_messages, gsm8k_gold, load_gsm8k
from arl.data.loader import StatefulLoader
from arl.preflight import InputError, check_data

GOOD = {
    "question": "Tom has 3 apples and buys 1,200 more. How many?",
    "answer": "3+1200\n#### 1,203",
}


def test_load_real_gsm8k_splits(gsm8k_dir):
    train, train_stats = load_gsm8k(str(gsm8k_dir), "train")
    test, test_stats = load_gsm8k(str(gsm8k_dir), "test")
    assert (len(train), len(test)) == (7473, 1319)
    assert train_stats.skipped == test_stats.skipped == 0
    row = test[0]
    assert row["question"] and "####" in row["answer"]
    assert row["messages"] == build_messages(row["question"])
    assert gsm8k_gold(row["answer"]).lstrip("-").replace(".", "").isdigit()


def test_gold_strips_commas_and_needs_marker():
    assert gsm8k_gold(GOOD["answer"]) == "1203"
    with pytest.raises(DatasetError, match="no '#### <number>'"):
        gsm8k_gold("the answer is 5")
    with pytest.raises(DatasetError):
        gsm8k_gold("#### ")


def test_build_messages_asks_for_boxed_answer():
    msgs = build_messages("What is 1+1?")
    assert msgs[0]["role"] == "user"
    assert msgs[0]["content"].startswith("What is 1+1?")
    assert "\\boxed{}" in msgs[0]["content"] and "step by step" in msgs[0]["content"]


def _write_malformed(tmp_path: Path) -> Path:
    lines = [
        json.dumps(GOOD),
        "{not json",
        json.dumps({"question": "q only"}),
        json.dumps({"question": "q", "answer": ""}),
        json.dumps({"question": "q", "answer": "no marker 5"}),
        json.dumps(["a", "list"]),
        "",  # blank lines are not rows
        json.dumps({"question": "Second?", "answer": "x\n#### 7", "extra": 1}),
    ]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    rows, stats = load_gsm8k(str(_write_malformed(tmp_path)), "train")
    assert [r["question"] for r in rows] == [GOOD["question"], "Second?"]
    assert rows[1]["extra"] == 1
    assert (stats.kept, stats.skipped) == (2, 5)
    assert stats.reasons == {
        "bad JSON": 1,
        "missing key 'answer'": 1,
        "empty or non-text 'answer'": 1,
        "answer has no '#### <number>'": 1,
        "not a JSON object": 1,
    }


def test_malformed_row_refused_with_file_and_line(tmp_path):
    directory = _write_malformed(tmp_path)
    with pytest.raises(DatasetError, match=r"train\.jsonl:2: bad JSON"):
        load_gsm8k(str(directory), "train", on_bad_row="error")


def test_missing_split_file_and_path_errors(tmp_path):
    _write_malformed(tmp_path)
    with pytest.raises(DatasetError, match=r"no test\.jsonl .*\['train'\]"):
        load_gsm8k(str(tmp_path), "test")
    with pytest.raises(DatasetError, match="is a file"):
        load_gsm8k(str(tmp_path / "train.jsonl"), "train")
    with pytest.raises(ValueError, match="on_bad_row='maybe'"):
        load_gsm8k(str(tmp_path), "train", on_bad_row="maybe")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "train.jsonl").write_text("{bad\n")
    with pytest.raises(DatasetError, match="no usable rows"):
        load_gsm8k(str(tmp_path / "empty"), "train")


def test_hub_id_without_datasets_names_the_extra_and_a_local_directory(monkeypatch):

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "datasets" else real_find_spec(name, *a),
    )
    with pytest.raises(DatasetError) as e:
        load_gsm8k("openai/gsm8k", "train")
    assert "pip install -e '.[gsm8k]'" in str(e.value) and "data.path=DIR" in str(e.value)


def test_arith_rows_and_disjoint_splits():
    train = make_arith(2000, seed=1, split="train")
    test = make_arith(144, seed=2, split="test")
    for row in train[:50] + test[:50]:
        a, b = (int(x) for x in row["question"][len("What is ") : -1].split(" * "))
        assert 10 <= a <= 99 and 2 <= b <= 9
        assert row["answer"] == str(a * b)
        assert "\\boxed{}" in row["messages"][0]["content"]
    train_q = {r["question"] for r in train}
    test_q = {r["question"] for r in test}
    assert len(test_q) == 144, "the test split should use every test pair once"
    assert len(train_q) == 576, "2000 train rows cycle through all 576 train pairs"
    assert not train_q & test_q
    assert make_arith(10, seed=3, split="train") == make_arith(10, seed=3, split="train")
    assert make_arith(10, seed=3, split="train") != make_arith(10, seed=4, split="train")
    with pytest.raises(ValueError, match="split='val'"):
        make_arith(1, 0, "val")


def test_loader_epochs_are_permutations():
    rows = list(range(10))
    loader = StatefulLoader(rows, batch_size=3, shuffle=True, seed=5)
    assert loader.batches_per_epoch == 3
    epoch0 = [loader.next_batch() for _ in range(3)]
    epoch1 = [loader.next_batch() for _ in range(3)]
    assert loader.epoch == 1
    flat0, flat1 = sum(epoch0, []), sum(epoch1, [])
    assert len(set(flat0)) == 9 and len(set(flat1)) == 9  # one row dropped per epoch
    assert flat0 != flat1
    unshuffled = StatefulLoader(rows, batch_size=4, shuffle=False, drop_last=False)
    assert [unshuffled.next_batch() for _ in range(4)] == [
        [0, 1, 2, 3],
        [4, 5, 6, 7],
        [8, 9],
        [0, 1, 2, 3],
    ]


def test_loader_resume_gives_the_same_batch_order():
    rows = [{"i": i} for i in range(23)]
    straight = StatefulLoader(rows, batch_size=4, seed=11)
    expected = [straight.next_batch() for _ in range(20)]

    first = StatefulLoader(rows, batch_size=4, seed=11)
    for _ in range(7):  # crosses an epoch boundary (5 batches per epoch)
        first.next_batch()
    state = first.state_dict()
    resumed = StatefulLoader(rows, batch_size=4, seed=11)
    resumed.load_state_dict(state)
    assert [resumed.next_batch() for _ in range(13)] == expected[7:]

    with pytest.raises(ValueError, match="seed=11 but this loader has 12"):
        StatefulLoader(rows, batch_size=4, seed=12).load_state_dict(state)


def test_loader_rejects_impossible_batches():
    with pytest.raises(ValueError, match="cannot fill one batch"):
        StatefulLoader([1, 2], batch_size=3)
    with pytest.raises(ValueError, match="batch_size=0"):
        StatefulLoader([1, 2], batch_size=0)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from arl.engines.model import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct"))


def _workflow(tokenizer, max_prompt_len: int, overflow: str):
    from arl.engines.base import SamplingParams
    from arl.workflows.rlvr import RLVRWorkflow

    async def reward(text: str, row: dict) -> float:
        return 0.0

    return RLVRWorkflow(
        tokenizer, reward, SamplingParams(), max_prompt_len=max_prompt_len, prompt_overflow=overflow
    )


def test_prompt_over_max_prompt_len_is_a_clear_error_or_truncated(smollm2_tokenizer):
    from arl.workflows.rlvr import PromptTooLong

    row = {"messages": build_messages("What is 17 * 4? " * 40)}
    full = _workflow(smollm2_tokenizer, 4096, "error").prompt_ids(row)
    assert len(full) > 64
    with pytest.raises(PromptTooLong) as info:
        _workflow(smollm2_tokenizer, 64, "error").prompt_ids(row)
    assert str(info.value) == (
        f"prompt of {len(full)} tokens exceeds data.max_prompt_len=64; raise it or set "
        "data.prompt_overflow=truncate"
    )
    wf = _workflow(smollm2_tokenizer, 64, "truncate")
    # Left-truncated: the end of the prompt (the generation prompt) is kept, and it is counted.
    assert wf.prompt_ids(row) == full[-64:]
    assert wf.truncated_prompts == 1
    assert _workflow(smollm2_tokenizer, len(full), "error").prompt_ids(row) == full  # at the limit
    with pytest.raises(ValueError, match="prompt_overflow='drop'"):
        _workflow(smollm2_tokenizer, 64, "drop")


def test_row_without_messages_names_its_keys(smollm2_tokenizer):
    with pytest.raises(KeyError, match=r"no 'messages' \(keys: \['answer', 'question'\]\)"):
        _workflow(smollm2_tokenizer, 64, "error").prompt_ids(GOOD)


def test_a_hub_id_offline_fails_in_one_line_naming_a_local_copy(tmp_path):
    """Offline, ``data.path=openai/gsm8k`` says how to point at a local directory instead."""
    pytest.importorskip("datasets")
    script = (
        "from arl.data.gsm8k import DatasetError, load_gsm8k\n"
        "try:\n    load_gsm8k('openai/gsm8k', 'train')\n"
        "except DatasetError as e:\n    print(e)\n"
    )
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HOME": str(tmp_path),  # an empty cache: nothing to fall back on
    }
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    msg = out.stdout.strip()
    assert out.returncode == 0 and msg, out.stderr[-2000:]
    assert "\n" not in msg
    assert "data.path='openai/gsm8k'" in msg and "HF_HUB_OFFLINE is set" in msg
    assert "data.path=DIR" in msg and "train.jsonl and test.jsonl" in msg


def test_an_unreachable_hub_fails_at_once_unless_a_cached_copy_may_load(tmp_path):
    """No offline flag, but nothing listens at the hub's address: one line saying so, and none
    of `datasets`' retry warnings. A copy in the hub's cache counts as one `datasets` may load."""
    pytest.importorskip("datasets")
    script = (
        "from arl.data.gsm8k import DatasetError, load_gsm8k\n"
        "try:\n    load_gsm8k('openai/gsm8k', 'train')\n"
        "except DatasetError as e:\n    print(e)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HTTP", "http"))}
    env.update(HF_HOME=str(tmp_path), HF_ENDPOINT="http://127.0.0.1:9")  # discard: refused

    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0 and out.stdout.strip(), out.stderr[-2000:]
    msg, err = out.stdout.strip(), out.stderr
    assert "data.path='openai/gsm8k' is not a local directory, and the hub is not reachable" in msg
    assert "data.path=DIR" in msg and "WARNING" not in err
    # (With a copy in the hub's cache, `datasets` is asked and retries for ~20 s: not run here.)
    (tmp_path / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)
    from arl.data import gsm8k

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(tmp_path))
        mp.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
        assert gsm8k._cached("openai/gsm8k") and not gsm8k._cached("openai/other")


def test_a_local_directory_is_read_without_the_hub(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps(GOOD) + "\n")
    rows, stats = load_gsm8k(str(tmp_path), "test")
    assert [r["question"] for r in rows] == [GOOD["question"]] and stats.source.endswith(
        "test.jsonl"
    )
    with pytest.raises(DatasetError, match=r"no train.jsonl in .*splits there: \['test'\]"):
        load_gsm8k(str(tmp_path), "train")


@pytest.mark.parametrize(
    ("loader", "problem"),
    [
        ("loader_returning_rows_only", "the loader returned [{'messages'"),
        ("loader_returning_none", "the loader returned None (NoneType), not (rows, stats)"),
        ("loader_of_strings", "the loader's rows hold '1 + 1?' (str), not only dicts"),
    ],
)
def test_a_loader_returning_another_shape_is_one_input_error(loader, problem):
    cfg = apply_overrides(
        Config(),
        [
            f"data.loader=tests.support.misfits:{loader}",
            "cluster.allowed_import_prefixes=[arl.,tests.]",
            "evaluator.freq_steps=none",
        ],
    )
    with pytest.raises(InputError) as e:
        check_data(cfg)
    assert problem in str(e.value)
    assert "a loader returns (rows, stats): rows a list of dicts" in str(e.value)


def test_an_empty_split_file_says_it_is_empty_and_what_a_row_is(tmp_path):
    (tmp_path / "train.jsonl").write_text("")
    with pytest.raises(DatasetError) as e:
        load_gsm8k(str(tmp_path), "train")
    assert "train.jsonl: no usable rows (it is empty); a row is a JSON object" in str(e.value)
    (tmp_path / "train.jsonl").write_text('{"question": "1 + 1?"}\n')
    with pytest.raises(DatasetError, match=r"all 1 malformed: \{\"missing key 'answer'\": 1\}"):
        load_gsm8k(str(tmp_path), "train")
    with pytest.raises(
        DatasetError, match=r"or load with on_bad_row='skip' \(data.on_bad_row=skip"
    ):
        load_gsm8k(str(tmp_path), "train", on_bad_row="error")
