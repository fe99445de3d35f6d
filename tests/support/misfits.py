"""User plug-ins that import but cannot be called as arl calls them (`rollout.reward`,
``rollout.workflow``, ``rollout.agent``, ``rollout.filter``, ``data.loader``)."""

from __future__ import annotations

from typing import Any


def no_arguments() -> float:
    """A reward, agent, filter or loader written without the parameters arl passes."""
    return 1.0


def loader_without_on_bad_row(path: str, split: str) -> tuple[list, dict]:
    """A loader missing the third parameter, ``on_bad_row``."""
    return [], {}


class Settings:
    """A class that is neither a function nor a workflow."""


SETTINGS = Settings()  # an instance that cannot be called


class TwoArgumentWorkflow:
    """A workflow whose constructor takes fewer arguments than the rollout node passes."""

    def __init__(self, tokenizer: Any, reward_fn: Any) -> None:
        self.tokenizer, self.reward_fn = tokenizer, reward_fn

    async def arun_episode(self, engine: Any, data: dict, sampling: Any = None, n: Any = None):
        """Never reached: the constructor is refused first."""
        return None


def loader_returning_rows_only(path: str, split: str, on_bad_row: str) -> list[dict]:
    """A loader that forgot the stats: rows alone."""
    return [{"messages": [{"role": "user", "content": "1 + 1?"}], "answer": "2"}]


def loader_returning_none(path: str, split: str, on_bad_row: str) -> None:
    """A loader that forgot to return."""


def loader_of_strings(path: str, split: str, on_bad_row: str) -> tuple[list[str], dict]:
    """A loader whose rows are prompts as plain strings, not dicts."""
    return ["1 + 1?", "2 + 2?"], {}
