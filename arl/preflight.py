"""Checks of a run's inputs before any node starts: the arl cache folder, the model folders, the
dataset splits, the prompts' length against ``data.max_prompt_len``, and the interpreter of an
inference server the nodes would start on this machine.

The nodes would find the same faults, but only after every process started and loaded what it
could; here they become one `InputError` naming the setting, the file and what to do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from arl.config import Config

if TYPE_CHECKING:
    from arl.engines.spec import EngineSpec

# The package each server engine's interpreter must find (it runs ``python -m <package>...``).
SERVER_PACKAGES = {"vllm": "vllm", "sglang": "sglang"}
_FIND = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"


class InputError(RuntimeError):
    """A model, dataset or server interpreter the config names cannot be used (the message
    says which and why)."""


def check_cache() -> Path:
    """The arl cache folder (`arl.cache.cache_root`: ``$ARL_CACHE``, else ``~/.cache/arl``) must
    be a folder this user can write: the default model is converted into it and every node's
    compiled code is kept there (`arl.compile_cache`), so a file or a read-only folder there
    would stop the run in the model check with a traceback, or in the nodes."""
    from arl.cache import cache_root

    root = cache_root()
    given = os.environ.get("ARL_CACHE")
    name = f"ARL_CACHE={given}" if given else f"the arl cache {root} (ARL_CACHE unset)"
    probe = root / f".arl-write-probe-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as e:
        blocker = next((p for p in [root, *root.parents] if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file" if blocker else (e.strerror or str(e))
        raise InputError(
            f"{name}: {root} is not a writable folder ({why}); arl keeps converted models and "
            "compiled code there. Set ARL_CACHE to a folder you can write"
        ) from e
    return root


def check_model(cfg: Config) -> str:
    """Resolve and validate ``actor.path`` (and ``ref.path`` when the KL term uses it);
    returns the actor's local folder."""
    from arl.engines.model import ModelResolutionError, resolve_model

    paths = [("actor.path", cfg.actor.path)]
    if cfg.actor.kl_ctl > 0 and cfg.ref.path and cfg.ref.path != cfg.actor.path:
        paths.append(("ref.path", cfg.ref.path))
    resolved = []
    for key, value in paths:
        try:
            resolved.append(resolve_model(value))
        except ModelResolutionError as e:
            raise InputError(f"{key}={value}: {e}") from e
    return resolved[0]


def check_data(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Load the training split (and the evaluation split when evaluation is on) through
    ``data.loader``, so a missing file or an empty split is found before launch; returns them
    as `arl.data.loader.load_data` does, so the run does not load them again."""
    from arl.data.loader import load_rows

    splits = [cfg.data.train_split]
    if cfg.evaluator.freq_steps:
        splits.append(cfg.data.eval_split)
    loaded = []
    for split in splits:
        where = f"data.path={cfg.data.path} (split {split!r}, data.loader={cfg.data.loader})"
        try:
            rows = load_rows(cfg, split)
        except (ValueError, OSError, ImportError, LookupError) as e:
            # ValueError covers the loaders' DatasetError; other exceptions are bugs in a loader
            # and keep their traceback.
            local = Path(cfg.data.path).expanduser()
            if cfg.data.path.startswith(("/", ".", "~")) and not local.exists():
                # A loader may read a missing local path as a hub id and say so confusingly.
                raise InputError(f"{where}: {local} does not exist") from e
            hint = ""
            if isinstance(e, OSError):
                hint = f"; set data.path to a folder holding {split}.jsonl, or a hub dataset id"
            raise InputError(f"{where}: {_describe(e)}{hint}") from e
        if not rows:
            raise InputError(f"{where}: the split has no rows; point data.path at a dataset")
        loaded.append(rows)
    train, *rest = loaded
    return train, (rest[0][: cfg.evaluator.max_questions or None] if rest else [])


PROMPTS_CHECKED = 256  # the first rows of the training split, tokenized in a few ms


def check_prompts(cfg: Config, model_dir: str, rows: Sequence[dict]) -> None:
    """Refuse a ``data.max_prompt_len`` that most prompts cannot fit: every rollout of theirs
    would fail (`arl.workflows.rlvr` raises `PromptTooLong` under ``data.prompt_overflow=error``)
    and the run would stop after a string of failed rollouts instead of here.

    Counted on the first `PROMPTS_CHECKED` rows, as the tokens of their messages' contents
    through the model's ``tokenizer.json`` (the light ``tokenizers`` library, not transformers,
    whose import would delay every launch by seconds): a lower bound of the prompt, which the
    chat template only lengthens, so no run is refused that would have fit. Rows without chat
    ``messages`` (a workflow that builds its own prompts), a model without ``tokenizer.json``
    and ``prompt_overflow=truncate`` are not checked."""
    if cfg.data.prompt_overflow != "error":
        return
    sample = [r for r in rows[:PROMPTS_CHECKED] if isinstance(r.get("messages"), list)]
    tokenizer_file = Path(model_dir) / "tokenizer.json"
    if not sample or not tokenizer_file.is_file():
        return
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer is the nodes' to report
        return
    texts = [  # text contents only: another kind (a list of parts) has no sure lower bound
        "".join(m["content"] for m in r["messages"] if isinstance(m, dict) and _text(m))
        for r in sample
    ]
    lengths = [len(e.ids) for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    limit = cfg.data.max_prompt_len
    over = [n for n in lengths if n > limit]
    if 2 * len(over) > len(lengths):
        raise InputError(
            f"data.max_prompt_len={limit}: {len(over)} of the first {len(lengths)} prompts are "
            f"longer than that before their chat template is applied (the longest "
            f"{max(over)} tokens), so their rollouts would fail; raise data.max_prompt_len "
            "above that, or set data.prompt_overflow=truncate to keep each prompt's last tokens"
        )


def _text(message: dict) -> bool:
    return isinstance(message.get("content"), str)


def check_server(cfg: Config, engines: Sequence[EngineSpec]) -> None:
    """With ``cluster.launcher=local`` (every node on this machine), a vllm/sglang rollout
    engine's ``rollout.server_python`` must exist and find the server's package: else every
    node would start and load, and the run stop when the server exits. The package is looked up,
    not imported (an import of vllm takes seconds). Nodes elsewhere (slurm, attach, ray) may
    have another interpreter: not checked."""
    if cfg.cluster.launcher != "local":
        return
    for name in sorted({e.name for e in engines if e.is_server}):
        package = SERVER_PACKAGES.get(name, name)
        python = next(e.python for e in engines if e.name == name)  # as the node runs it
        where = f"rollout.backend={cfg.rollout.backend} starts `{python} -m {package}...`"
        todo = (
            f"install {package} for that interpreter, or set rollout.server_python to the python "
            f"of an environment that has it (e.g. a virtualenv's bin/python)"
        )
        if shutil.which(python) is None:
            raise InputError(f"{where}, but {python!r} is not an executable here; {todo}")
        try:
            found = subprocess.run(
                [python, "-c", _FIND, package], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            raise InputError(f"{where}, but running {python!r} failed ({e}); {todo}") from e
        if found.returncode == 3:
            raise InputError(f"{where}, but that python cannot import {package}; {todo}")
        if found.returncode != 0:
            tail = found.stderr.strip().splitlines()[-1:] or ["no output"]
            raise InputError(
                f"{where}, but that python fails to start (exit {found.returncode}: "
                f"{tail[0]}); {todo}"
            )


def _describe(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text += f": {e.filename}"
    if type(e).__name__ not in ("DatasetError", "ValueError"):
        text = f"{type(e).__name__}: {text}"
    return text
