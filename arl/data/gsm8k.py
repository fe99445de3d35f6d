"""GSM8K: rows from a local ``{split}.jsonl`` directory or a hub id (`datasets`), the prompt.

``data.path`` is either: a directory holding ``train.jsonl`` and ``test.jsonl``, or a hub id
such as ``openai/gsm8k`` (needs ``pip install -e '.[gsm8k]'`` and a reachable hub).

A row is the source object (keys ``question`` and ``answer``, the answer ending in
``#### <number>``) plus ``messages``, the chat prompt from `build_messages`. Malformed rows are
skipped and counted in `LoadStats`, or refused with their file and line (``on_bad_row="error"``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

PROMPT_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."


class DatasetError(ValueError):
    """A dataset could not be found or a row is malformed (with where and what to do)."""


@attrs.define
class LoadStats:
    """What loading kept and skipped, with the reasons for skipping."""

    source: str
    kept: int = 0
    skipped: int = 0
    reasons: dict[str, int] = attrs.field(factory=dict)


def gsm8k_gold(answer: str) -> str:
    """The gold number of a GSM8K answer: the text after the last ``####``, commas removed."""
    _, sep, tail = answer.rpartition("####")
    gold = tail.strip().replace(",", "")
    if not sep or not gold:
        raise DatasetError(f"GSM8K answer has no '#### <number>' at its end: {answer[-80:]!r}")
    return gold


def build_messages(question: str) -> list[dict[str, str]]:
    """Chat messages asking for step-by-step reasoning and the final answer in ``\\boxed{}``."""
    return [{"role": "user", "content": f"{question.strip()}\n{PROMPT_SUFFIX}"}]


def load_gsm8k(
    path: str, split: str, on_bad_row: str = "skip"
) -> tuple[list[dict[str, Any]], LoadStats]:
    """Load ``split`` from a directory of ``{split}.jsonl`` or, if not a directory, a hub id.

    ``on_bad_row`` is ``"skip"`` (count and drop malformed rows) or ``"error"`` (raise
    `DatasetError` naming the file and line).
    """
    if on_bad_row not in ("skip", "error"):
        raise ValueError(f"on_bad_row={on_bad_row!r}: use 'skip' or 'error'")
    local = Path(path).expanduser()
    if local.is_dir():
        file = local / f"{split}.jsonl"
        if not file.is_file():
            if file.exists() or file.is_symlink():  # there, but not a file that can be read
                raise DatasetError(f"{file} {_not_regular(file)}; a split must be a regular file")
            found = sorted(p.stem for p in local.glob("*.jsonl"))
            raise DatasetError(f"no {file.name} in {local} (splits there: {found or 'none'})")
        # Undecodable bytes become a bad row of their own line, not an error for the whole file.
        with open(file, encoding="utf-8", errors="surrogateescape") as fh:
            return _validate(_jsonl_records(fh), str(file), on_bad_row)
    if local.exists():
        raise DatasetError(f"{path} is a file; pass the directory that holds {split}.jsonl")
    return _validate(_hub_records(path, split), f"hub:{path}[{split}]", on_bad_row)


def _not_regular(file: Path) -> str:
    """What ``file`` is instead of a regular file: a FIFO, a device, a folder, a dead link."""
    import stat

    link = f"is a link to {os.readlink(file)}, which " if file.is_symlink() else ""
    try:
        mode = file.stat().st_mode
    except OSError as e:
        return f"{link or 'is a link that '}cannot be followed ({e.strerror})"
    kinds = [
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ]
    kind = next((name for test, name in kinds if test(mode)), "not a regular file")
    return f"{link or 'is '}{'is ' if link else ''}{kind}"


def _jsonl_records(lines: Iterable[str]) -> Iterable[tuple[int, Any]]:
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as exc:  # an undecodable byte, escaped by surrogateescape
            byte = ord(line[exc.start]) - 0xDC00
            yield lineno, _BadJson(f"not UTF-8: byte 0x{byte:02x} at column {exc.start + 1}")
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            yield lineno, _BadJson(str(exc))


@attrs.frozen
class _BadJson:
    error: str


def _hub_records(hub_id: str, split: str) -> Iterable[tuple[int, Any]]:
    local_hint = (
        "point data.path=DIR at a local copy (a directory holding train.jsonl and test.jsonl, "
        "keys question and answer)"
    )
    if importlib.util.find_spec("datasets") is None:
        raise DatasetError(
            f"data.path={hub_id!r} is not a local directory, and loading it from the hub needs "
            f"the `datasets` package (pip install -e '.[gsm8k]'); or {local_hint}"
        )
    from arl.engines.model import hub_reachable

    if not _cached(hub_id) and not hub_reachable():
        # Fail at once: `datasets` would retry each file for tens of seconds and log every try
        # (with a copy in its cache it may still load, so that case keeps trying).
        offline = "HF_HUB_OFFLINE is set" if _hub_offline() else "the hub is not reachable"
        raise DatasetError(
            f"data.path={hub_id!r} is not a local directory, and {offline}; {local_hint}"
        )
    import datasets

    # openai/gsm8k has two configs; "main" is the standard one.
    config = "main" if hub_id == "openai/gsm8k" else None
    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as exc:  # offline, unknown id, no such split: all end in the same advice
        offline = " (HF_HUB_OFFLINE is set)" if _hub_offline() else ""
        reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise DatasetError(
            f"data.path={hub_id!r}: loading it from the hub failed{offline} ({reason}); "
            f"{local_hint}"
        ) from exc
    return enumerate(ds, start=1)


def _cached(hub_id: str) -> bool:
    """Whether the hub's or `datasets`' cache holds a copy of ``hub_id`` (from an earlier
    download), which `datasets.load_dataset` can load without the hub."""
    from huggingface_hub import constants

    datasets_cache = os.environ.get("HF_DATASETS_CACHE") or os.path.join(
        constants.HF_HOME, "datasets"
    )
    return (Path(constants.HF_HUB_CACHE) / f"datasets--{hub_id.replace('/', '--')}").exists() or (
        Path(datasets_cache) / hub_id.replace("/", "___")
    ).exists()


def _hub_offline() -> bool:
    flags = (os.environ.get(k, "") for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
    return any(f.strip().lower() in ("1", "true", "yes", "on") for f in flags)


def _row_problem(record: Any) -> str | None:
    """Why ``record`` is not a usable GSM8K row, or None if it is."""
    if isinstance(record, _BadJson):
        return f"bad JSON ({record.error})"
    if not isinstance(record, dict):
        return f"not a JSON object ({type(record).__name__})"
    for key in ("question", "answer"):
        if key not in record:
            return f"missing key {key!r}"
        if not isinstance(record[key], str) or not record[key].strip():
            return f"empty or non-text {key!r}"
    try:
        gsm8k_gold(record["answer"])
    except DatasetError:
        return "answer has no '#### <number>'"
    return None


def _validate(
    records: Iterable[tuple[int, Any]], source: str, on_bad_row: str
) -> tuple[list[dict[str, Any]], LoadStats]:
    rows: list[dict[str, Any]] = []
    reasons: Counter[str] = Counter()
    for lineno, record in records:
        problem = _row_problem(record)
        if problem is not None:
            if on_bad_row == "error":
                raise DatasetError(
                    f"{source}:{lineno}: {problem}; fix the row or load with on_bad_row='skip' "
                    "(data.on_bad_row=skip)"
                )
            reasons[problem.split(" (")[0]] += 1
            continue
        rows.append({**record, "messages": build_messages(record["question"])})
    stats = LoadStats(source, kept=len(rows), skipped=sum(reasons.values()), reasons=dict(reasons))
    if not rows:
        found = (
            f"all {stats.skipped} malformed: {stats.reasons}" if stats.skipped else "it is empty"
        )
        raise DatasetError(
            f"{source}: no usable rows ({found}); a row is a JSON object with a text 'question' "
            "and an 'answer' ending in '#### <number>', one per line"
        )
    return rows, stats
