"""Validation of a `Config`: each field against its annotation (`type_problems`), then the
values and the relations between them (`validation_problems`); every problem names its key."""

import math
import re
import types
from typing import Any, Literal, Union, get_args, get_origin

import attrs

from arl.config.backend import parse_backend
from arl.config.tree import Config, ConfigError, get_key
from arl.protocol.imports import ImportRefused, resolve_import, split_target, under_prefix

_PREFIX = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\.?")


def _type_problem(value: Any, tp: Any) -> str:
    """Why ``value`` does not fit the annotation ``tp`` ("" when it does)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "" if value in args else f"choose one of {', '.join(map(str, args))}"
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return ""
        inner = [a for a in args if a is not type(None)]
        if any(not _type_problem(value, a) for a in inner):
            return ""
        why = _type_problem(value, inner[0]) if len(inner) == 1 else ""
        if why.startswith("must be"):  # the right type, a refused value (nan): say that
            return why
        return f"expected {type_name(tp)}"
    if origin in (list, tuple):
        # Either sequence is taken (saved as a list); a str would pass as a list of letters.
        if type(value) not in (list, tuple):
            return f"expected {type_name(tp)}, got {_got(value)}"
        item = args[0]
        bad = [v for v in value if _type_problem(v, item)]
        if bad:
            return f"expected {type_name(tp)}, got an item {show_value(bad[0])} ({_got(bad[0])})"
        return ""
    if tp is float:
        # Exact types: a subclass (numpy.float64) would pass here and then fail to save.
        if type(value) not in (int, float):
            return f"expected float, got {_got(value)}"
        if isinstance(value, float) and math.isnan(value):
            return "must be a number, not nan"
        return ""
    if tp in (int, str, bool):
        return "" if type(value) is tp else f"expected {tp.__name__}, got {_got(value)}"
    if attrs.has(tp):
        return "" if isinstance(value, tp) else f"expected a section of type {tp.__name__}"
    return ""  # pragma: no cover - every field type is above


def _got(value: Any) -> str:
    """The type of a refused value, as a user would write it (``numpy.int64``, ``str``)."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


# Float fields where infinity means "no limit" (a timeout, a clip); every other one must be a
# finite number, and none may be nan.
_INF_MEANS_NO_LIMIT = frozenset(
    {
        "cluster.heartbeat_timeout",
        "cluster.node_start_timeout",
        "cluster.ray_placement_timeout",
        "rollout.server_start_timeout",
        "rollout.group_timeout",
        "rollout.stall_log_s",
        "actor.call_timeout",
        "actor.grad_clip",
        "actor.eps_clip_higher",
        "actor.c_clip",
        "actor.reward_clip",
        "actor.behav_imp_weight_cap",
    }
)


def _finite_problem(key: str, value: Any) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return ""
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond every float
        finite = False
    if finite or (key in _INF_MEANS_NO_LIMIT and value > 0):
        return ""
    return "must be a finite number"


def type_problems(cfg: Config) -> list[str]:
    """Every field whose value does not fit its annotation, as ``key=value: expected TYPE``.

    Types are exact (a bool is not an int, numpy.float64 is not a float), floats accept ints
    and must be finite except where infinity means no limit (`_INF_MEANS_NO_LIMIT`), lists
    and tuples hold items of their type, and each section must be its attrs class (its fields
    are not looked at otherwise).
    """
    problems: list[str] = []
    for section in attrs.fields(Config):
        value = getattr(cfg, section.name)
        why = _type_problem(value, section.type)
        if why:
            problems.append(f"{section.name}={show_value(value)}: {why}")
            continue
        problems += _section_type_problems(value, section.name)
    return problems


def _section_type_problems(section: Any, prefix: str) -> list[str]:
    """`type_problems` of one section's fields; a nested section's (``actor.lora``) in turn."""
    problems = []
    for field in attrs.fields(type(section)):
        v, key = getattr(section, field.name), f"{prefix}.{field.name}"
        why = _type_problem(v, field.type)
        if not why and attrs.has(field.type):
            problems += _section_type_problems(v, key)
            continue
        if not why and (field.type is float or field.type == float | None):
            why = _finite_problem(key, v)
        if why:
            problems.append(f"{key}={show_value(v)}: {why}")
    return problems


def validation_problems(cfg: Config) -> list[str]:
    problems: list[str] = []

    def check(key: str, ok: bool, why: str) -> None:
        if not ok:
            problems.append(f"{key}={show_value(get_key(cfg, key))}: {why}")

    def positive(*keys: str, optional: bool = False) -> None:
        for key in keys:
            v = get_key(cfg, key)
            check(key, (optional and v is None) or (v is not None and v > 0), "must be > 0")

    def within(key: str, lo: float, hi: float) -> None:
        check(key, lo <= get_key(cfg, key) <= hi, f"must be in [{lo}, {hi}]")

    # Types, choice fields included, are checked before: `type_problems`.
    for key, role in (("rollout.backend", "rollout"), ("actor.backend", "train")):
        try:
            parse_backend(get_key(cfg, key), role)  # type: ignore[arg-type]
        except ConfigError as e:
            problems.append(f"{key}: {e}")
    rollout_engine = cfg.rollout.backend.split(":")[0].strip()
    check(
        "rollout.mps_engine_percent",
        50 <= cfg.rollout.mps_engine_percent <= 100,
        "must be in [50, 100]: on an H200 the hf engine held to 30% decoded garbage (NaN "
        "log-probs, every completion at max_new_tokens) while 50% decoded correctly",
    )
    check(
        "rollout.gpu_sharing",
        cfg.rollout.gpu_sharing != "mps" or cfg.cluster.launcher == "local",
        f"mps starts a private MPS daemon on this machine, where only cluster.launcher=local "
        f"starts the nodes (here {cfg.cluster.launcher!r}); elsewhere start MPS with the "
        "scheduler (Slurm: --gres=mps) and use concurrent",
    )
    check(
        "rollout.hf_decode_attention",
        cfg.rollout.hf_decode_attention in ("auto", "sdpa") or rollout_engine == "hf",
        f"applies to the hf engine only; rollout.backend={cfg.rollout.backend!r} (a server "
        "chooses its own attention kernels)",
    )

    e = cfg.experiment
    for key in ("experiment.name", "experiment.trial"):
        v = get_key(cfg, key)
        check(key, bool(v) and "/" not in v and v not in (".", ".."), "must be a plain name")
    check("experiment.seed", e.seed >= 0, "must be >= 0")
    positive("experiment.total_train_steps")

    positive("cluster.n_nodes", optional=True)
    n_gpus = cfg.cluster.n_gpus
    check("cluster.n_gpus", n_gpus is None or n_gpus >= 0, "must be >= 0 (0: CPU) or none")
    check("cluster.controller_port", 0 <= cfg.cluster.controller_port <= 65535, "must be 0..65535")
    positive("cluster.heartbeat_interval", "cluster.heartbeat_timeout")
    positive("cluster.node_start_timeout")
    check(
        "cluster.heartbeat_timeout",
        cfg.cluster.heartbeat_timeout > cfg.cluster.heartbeat_interval,
        f"must exceed cluster.heartbeat_interval={cfg.cluster.heartbeat_interval}",
    )
    prefixes = cfg.cluster.allowed_import_prefixes
    check(
        "cluster.allowed_import_prefixes",
        bool(prefixes) and all(_PREFIX.fullmatch(p) for p in prefixes),
        "needs at least one prefix, each a dotted module name such as arl or myorg.rl",
    )
    positive("cluster.cpu_threads_per_node", optional=True)
    positive("cluster.gpu_memory_gb", optional=True)
    positive("cluster.ray_rollout_cpus", "cluster.ray_train_cpus", "cluster.ray_placement_timeout")
    check(
        "cluster.n_gpus",
        cfg.cluster.launcher != "ray" or n_gpus is not None,
        "must be set with cluster.launcher=ray: the GPUs the run takes from the Ray cluster "
        "(0: CPU only), since this host's own GPUs say nothing about the cluster's",
    )

    check(
        "transport.inline_threshold_bytes",
        cfg.transport.inline_threshold_bytes >= 0,
        "must be >= 0",
    )
    positive("transport.max_message_bytes", "transport.pull_chunk_bytes")

    positive("rollout.max_concurrent_rollouts", optional=True)
    check("rollout.max_head_offpolicyness", cfg.rollout.max_head_offpolicyness >= 0, "must be >= 0")
    optional = ("rollout.agent", "rollout.filter")  # empty: not used
    for key in ("rollout.workflow", "rollout.reward", "data.loader", *optional):
        target = get_key(cfg, key)
        if key in optional and not target:
            continue
        why = import_problem(target, prefixes)
        if why:
            problems.append(f"{key}={show_value(target)}: {why}")
    positive("rollout.server_start_timeout")
    is_agent = cfg.rollout.workflow.endswith(":AgentWorkflow")
    check(
        "rollout.agent",
        is_agent == bool(cfg.rollout.agent),
        "needs rollout.workflow=arl.workflows.agent:AgentWorkflow"
        if cfg.rollout.agent
        else f"rollout.workflow={cfg.rollout.workflow} needs an agent function, module:attribute",
    )
    check(
        "data.prompt_overflow",
        not is_agent or cfg.data.prompt_overflow == "error",
        "agent workflows need 'error' (truncating would break the turns' shared prefix)",
    )
    within("rollout.turn_discount", 0.0, 1.0)
    positive("rollout.max_consecutive_rejections")

    g = cfg.gconfig
    positive("gconfig.n_samples", "gconfig.max_new_tokens")
    check(
        "gconfig.temperature",
        g.greedy or g.temperature > 0,
        "must be > 0 for sampling (or set gconfig.greedy=true)",
    )
    check("gconfig.top_p", 0 < g.top_p <= 1, "must be in (0, 1]")
    check("gconfig.top_k", g.top_k >= 0, "must be >= 0 (0: off)")
    check("gconfig.stop_token_ids", all(t >= 0 for t in g.stop_token_ids), "ids must be >= 0")

    a = cfg.actor
    check("actor.path", bool(a.path), "must name a model")
    check("actor.lr", a.lr >= 0, "must be >= 0")
    check("actor.weight_decay", a.weight_decay >= 0, "must be >= 0")
    check("actor.adam_beta1", 0 <= a.adam_beta1 < 1, "must be in [0, 1)")
    check("actor.adam_beta2", 0 <= a.adam_beta2 < 1, "must be in [0, 1)")
    check("actor.warmup_steps", a.warmup_steps >= 0, "must be >= 0")
    within("actor.min_lr_ratio", 0.0, 1.0)
    positive("actor.adam_eps", "actor.grad_clip", "actor.ppo_n_minibatches")
    positive("actor.eps_clip", "actor.temperature")
    positive("actor.max_tokens_per_mb", optional=True)
    positive("actor.reward_clip", "actor.norm_eps")
    positive("actor.eps_clip_higher", "actor.behav_imp_weight_cap", optional=True)
    check("actor.c_clip", a.c_clip is None or a.c_clip > 1, "dual clip needs c > 1 (or none)")
    check("actor.kl_ctl", a.kl_ctl >= 0, "must be >= 0")
    within("actor.discount", 0.0, 1.0)
    within("actor.gae_lambda", 0.0, 1.0)
    check("actor.lora.rank", a.lora.rank >= 0, "must be >= 0 (0: no LoRA)")
    if a.lora.rank > 0:
        positive("actor.lora.alpha")
        check("actor.lora.dropout", 0 <= a.lora.dropout < 1, "must be in [0, 1)")
        check(
            "actor.lora.target_modules",
            bool(a.lora.target_modules) and all(a.lora.target_modules),
            "needs module names (q_proj, ...) or all-linear",
        )
    check(
        "actor.offload",
        a.offload == "none" or a.lora.rank == 0,
        "optimizer offload is for a full fine-tune: with actor.lora.rank > 0 only the adapters "
        "carry optimizer state (a few MB); set actor.offload=none",
    )
    n_seqs = cfg.data.batch_size * g.n_samples
    check(
        "actor.ppo_n_minibatches",
        n_seqs < 1 or a.ppo_n_minibatches <= n_seqs,  # n_seqs < 1 is reported below
        f"more minibatches than the {n_seqs} sequences of a step "
        "(data.batch_size x gconfig.n_samples)",
    )
    longest = cfg.data.max_prompt_len + g.max_new_tokens
    check(
        "actor.max_tokens_per_mb",
        a.max_tokens_per_mb is None or a.max_tokens_per_mb >= longest,
        f"smaller than the longest sequence, data.max_prompt_len + gconfig.max_new_tokens = "
        f"{longest}; raise it or shorten those",
    )
    if g.n_samples < 2:
        for key in ("actor.reward_norm_mean", "actor.reward_norm_std"):
            check(
                key,
                get_key(cfg, key) != "group",
                "group normalisation needs gconfig.n_samples >= 2 (or batch/none)",
            )

    check("data.path", bool(cfg.data.path), "must name a dataset")
    try:
        train_dp = parse_backend(a.backend, "train").dp
    except ConfigError:
        train_dp = 1  # reported above
    # A batch is split by whole prompt groups over the data-parallel train ranks, and a rank
    # with no group has nothing to train on.
    check(
        "data.batch_size",
        cfg.data.batch_size < 1 or cfg.data.batch_size >= train_dp,
        f"fewer prompt groups than the {train_dp} train ranks of actor.backend={a.backend}; "
        f"use data.batch_size >= {train_dp} (a multiple of it balances best) or fewer ranks",
    )
    positive("data.batch_size", "data.max_prompt_len", "weight_sync.bucket_bytes")
    positive("weight_sync.verify_tolerance")
    positive("saver.freq_steps", optional=True)
    positive("recover.freq_steps", "recover.freq_secs", optional=True)
    positive("recover.stop_grace_s")
    check("recover.retries", cfg.recover.retries >= 0, "must be >= 0 (0: never restart)")
    positive("rollout.group_timeout", "actor.call_timeout", "rollout.stall_log_s", optional=True)
    positive("evaluator.freq_steps", "evaluator.max_questions", optional=True)
    positive("evaluator.n_samples")
    check("evaluator.temperature", cfg.evaluator.temperature >= 0, "must be >= 0 (0: greedy)")
    return problems


def import_problem(target: str, prefixes: list[str] | tuple[str, ...]) -> str:
    """Why ``target`` may not be used under ``prefixes`` ("" when it may), by the import rule
    that nodes apply too (`arl.protocol.imports`). A module under a prefix is imported here,
    so that an attribute walking out of it is refused before any node starts."""
    try:
        module, _ = split_target(target)
    except ValueError:
        return "must be an import path module:attribute (dotted identifiers)"
    if not under_prefix(module, prefixes):
        return (
            f"module {module!r} is not under cluster.allowed_import_prefixes={list(prefixes)}; "
            "add its prefix there (nodes and the launcher import only from those)"
        )
    try:
        resolve_import(target, prefixes)
    except ImportRefused as e:
        return str(e).removeprefix(f"refusing to import {target!r}: ")
    except AttributeError as e:  # raised by resolve_import, naming the missing step
        return str(e).removeprefix(f"import string {target!r}: ")
    except Exception as e:  # the module itself fails to import, or the name is missing
        return f"cannot be imported: {type(e).__name__}: {e}"
    return ""


def show_value(value: Any, quote: bool = True) -> str:
    """A value as it would be written in an override (strings quoted when ``quote``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(show_value(v, quote) for v in value) + "]"
    if isinstance(value, str):
        return repr(value) if quote or not value else value
    return str(value)


def type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return " or ".join(type_name(a) for a in inner) + " or none"
    if origin in (list, tuple):
        return f"{origin.__name__}[{type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))
