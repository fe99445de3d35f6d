"""`arl.preflight.check_prompts`: a ``data.max_prompt_len`` that most prompts cannot fit is
refused before launch, by a lower bound that never refuses a run that would fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from arl.data.arith import build_arith_messages
from arl.preflight import InputError, check_model, check_prompts
from arl.recipe import load_recipe

ARITH = Path(__file__).resolve().parents[2] / "recipes" / "arith.py"


@pytest.fixture(scope="module")
def model_dir():
    return check_model(load_recipe(str(ARITH)))  # the recipe's model, resolved offline


def _rows(n: int, question: str = "What is 12 * 34?") -> list[dict]:
    return [{"question": question, "messages": build_arith_messages(question)} for _ in range(n)]


def _cfg(max_prompt_len: int, overflow: str = "error"):
    cfg = load_recipe(str(ARITH))
    cfg.data.max_prompt_len, cfg.data.prompt_overflow = max_prompt_len, overflow
    return cfg


def test_a_limit_most_prompts_exceed_is_refused_naming_the_setting_and_the_longest(model_dir):
    with pytest.raises(InputError) as e:
        check_prompts(_cfg(5), model_dir, _rows(10))
    msg = str(e.value)
    assert msg.startswith("data.max_prompt_len=5: 10 of the first 10 prompts are longer")
    assert "data.prompt_overflow=truncate" in msg


def test_prompts_that_fit_a_minority_over_truncation_and_other_rows_pass(model_dir):
    check_prompts(_cfg(128), model_dir, _rows(10))  # the recipe's own limit
    long = _rows(1, "What is " + " + ".join(["123456"] * 40) + "?")
    check_prompts(_cfg(40), model_dir, _rows(3) + long)  # one of four over: its rollouts fail
    with pytest.raises(InputError, match="1 of the first 1 prompts"):
        check_prompts(_cfg(40), model_dir, long)
    check_prompts(_cfg(5, overflow="truncate"), model_dir, _rows(10))  # cut, never refused
    check_prompts(_cfg(5), model_dir, [{"question": "q"}] * 10)  # the workflow builds prompts
    check_prompts(_cfg(5), "/nonexistent", _rows(10))  # no tokenizer.json: the nodes decide
