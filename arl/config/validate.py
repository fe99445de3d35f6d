"""Validation of a `Config`: each field against its annotation (`type_problems`), then the
values and the relations between them (`validation_problems`); every problem names its key."""

import inspect
import math
import types
from collections.abc import Callable
from typing import Any, Literal, Union, get_args, get_origin

import attrs

from arl.config.backend import parse_backend
from arl.config.errors import ConfigError
from arl.config.rules import call_problem, import_problem
from arl.config.tree import CHECKS, Config, field_keys, get_key
from arl.protocol.imports import resolve_import


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
    if origin is dict:  # rollout.workflow_args: sent to the node, so plain data only
        if type(value) is not dict:
            return f"expected a map, got {_got(value)}"
        keys = [k for k in value if type(k) is not str]
        if keys:  # YAML reads a bare on/yes/1 as a bool or an int: quote it
            return f"keys must be str, got {show_value(keys[0])} ({_got(keys[0])}); quote it"
        bad = _not_plain(value)
        return f"expected plain data, got {show_value(bad[0])} ({_got(bad[0])})" if bad else ""
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


def _not_plain(value: Any) -> list[Any]:
    """The values inside ``value`` that are not str, int, float, bool, none, or lists and
    str-keyed maps of them (empty: it is plain data, which msgpack and YAML carry)."""
    if value is None or type(value) in (str, int, float, bool):
        return []
    if type(value) in (list, tuple):
        return [bad for v in value for bad in _not_plain(v)]
    if type(value) is dict and all(type(k) is str for k in value):
        return [bad for v in value.values() for bad in _not_plain(v)]
    return [value]


def _got(value: Any) -> str:
    """The type of a refused value, as a user would write it (``numpy.int64``, ``str``)."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _finite_problem(field: attrs.Attribute, value: Any) -> str:
    """Every float must be finite but where its rule lets infinity mean no limit (a timeout)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return ""
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond every float
        finite = False
    rule = field.metadata.get("rule")
    if finite or (getattr(rule, "inf", False) and value > 0):
        return ""
    return "must be a finite number"


def type_problems(cfg: Config) -> list[str]:
    """Every field whose value does not fit its annotation, as ``key=value: expected TYPE``.

    Types are exact (a bool is not an int, numpy.float64 is not a float), floats accept ints
    and must be finite except where the field's rule says infinity means no limit, lists
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
            why = _finite_problem(field, v)
        if why:
            problems.append(f"{key}={show_value(v)}: {why}")
    return problems


def field_problems(cfg: Config) -> list[str]:
    """Every field, nested sections included, checked by the rule declared on it
    (`arl.config.rules`); a field typed ``X | None`` that is none passes."""
    problems = []
    for key, field in field_keys().items():
        rule, value = field.metadata.get("rule"), get_key(cfg, key)
        optional = type(None) in get_args(field.type)
        if rule is None or (optional and value is None):
            continue
        why = rule.problem(value, cfg)
        if why:
            why += " or none" if optional else ""
            why += f" ({rule.note})" if rule.note else ""
            named = key if getattr(rule, "names_value", False) else f"{key}={show_value(value)}"
            problems.append(f"{named}: {why}")
    return problems


Check = Callable[[str, bool, str], None]  # (key, holds, why): a problem unless it holds


def validation_problems(cfg: Config) -> list[str]:
    """Each field by its rule (`field_problems`), then the rules between fields; types are
    checked before (`type_problems`)."""
    problems = field_problems(cfg)

    def check(key: str, ok: bool, why: str) -> None:
        if not ok:
            problems.append(f"{key}={show_value(get_key(cfg, key))}: {why}")

    r, c, a, g = cfg.rollout, cfg.cluster, cfg.actor, cfg.gconfig
    check(
        "rollout.gpu_sharing",
        r.gpu_sharing != "mps" or c.launcher == "local",
        f"mps starts a private MPS daemon on this machine, where only cluster.launcher=local "
        f"starts the nodes (here {c.launcher!r}); elsewhere start MPS with the "
        "scheduler (Slurm: --gres=mps) and use concurrent",
    )
    check(
        "rollout.hf_decode_attention",
        r.hf_decode_attention in ("auto", "sdpa") or r.backend.split(":")[0].strip() == "hf",
        f"applies to the hf engine only; rollout.backend={r.backend!r} (a server "
        "chooses its own attention kernels)",
    )
    check(
        "cluster.heartbeat_timeout",
        c.heartbeat_timeout > c.heartbeat_interval,
        f"must exceed cluster.heartbeat_interval={c.heartbeat_interval}",
    )
    check(
        "cluster.n_gpus",
        c.launcher != "ray" or c.n_gpus is not None,
        "must be set with cluster.launcher=ray: the GPUs the run takes from the Ray cluster "
        "(0: CPU only), since this host's own GPUs say nothing about the cluster's",
    )
    check(
        "gconfig.temperature",
        g.greedy or g.temperature > 0,
        "must be > 0 for sampling (or set gconfig.greedy=true)",
    )
    check(
        "actor.offload",
        a.offload == "none" or a.lora.rank == 0,
        "optimizer offload is for a full fine-tune: with actor.lora.rank > 0 only the adapters "
        "carry optimizer state (a few MB); set actor.offload=none",
    )
    _batch_rules(cfg, check)
    _workflow_rules(cfg, check)
    return problems


def _batch_rules(cfg: Config, check: Check) -> None:
    """How a step's batch splits: minibatches, micro-batch tokens, groups, train ranks."""
    a, g, batch = cfg.actor, cfg.gconfig, cfg.data.batch_size
    n_seqs = batch * g.n_samples
    check(
        "actor.ppo_n_minibatches",
        n_seqs < 1 or a.ppo_n_minibatches <= n_seqs,  # n_seqs < 1 is reported by its field
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
    for key in ("actor.reward_norm_mean", "actor.reward_norm_std"):
        check(
            key,
            g.n_samples >= 2 or get_key(cfg, key) != "group",
            "group normalisation needs gconfig.n_samples >= 2 (or batch/none)",
        )
    try:
        train_dp = parse_backend(a.backend, "train").dp
    except ConfigError:
        train_dp = 1  # reported by its field
    # A batch is split by whole prompt groups over the data-parallel train ranks, and a rank
    # with no group has nothing to train on.
    check(
        "data.batch_size",
        batch < 1 or batch >= train_dp,
        f"fewer prompt groups than the {train_dp} train ranks of actor.backend={a.backend}; "
        f"use data.batch_size >= {train_dp} (a multiple of it balances best) or fewer ranks",
    )


_AGENT_WORKFLOW = "arl.workflows.agent:AgentWorkflow"
# Constructor arguments the rollout node passes itself (`arl.node.rollout.RolloutWorker`): the
# first by position, then keywords, then (with rollout.agent, by
# `arl.control.workers.start_rollout_workers`) the agent workflow's.
_WORKFLOW_ARGS = ("tokenizer", "reward_fn", "sampling")
_WORKFLOW_KWARGS = ("n_samples", "max_prompt_len", "prompt_overflow")
_AGENT_KWARGS = ("agent", "trajectory", "turn_discount")
_PASSED_BY_ARL = (*_WORKFLOW_ARGS, *_WORKFLOW_KWARGS, *_AGENT_KWARGS)


def _workflow_rules(cfg: Config, check: Check) -> None:
    """The workflow class against the keys that configure it: ``rollout.agent`` needs the agent
    workflow (or a subclass), ``rollout.workflow_args`` only keywords its constructor takes;
    and the class itself: built as the rollout node builds it, with an ``arun_episode``."""
    r = cfg.rollout
    prefixes = cfg.cluster.allowed_import_prefixes
    if import_problem(r.workflow, prefixes):
        return  # reported by its field
    workflow = resolve_import(r.workflow, prefixes)
    if not callable(workflow):
        check("rollout.workflow", False, call_problem(workflow, _WORKFLOW_ARGS))
        return
    agent_base = resolve_import(_AGENT_WORKFLOW, ("arl.",))
    is_agent = isinstance(workflow, type) and issubclass(workflow, agent_base)
    check(
        "rollout.agent",
        is_agent == bool(r.agent),
        f"needs rollout.workflow={_AGENT_WORKFLOW} or a subclass of it"
        if r.agent
        else f"rollout.workflow={r.workflow} needs an agent function, module:attribute",
    )
    check(
        "data.prompt_overflow",
        not is_agent or cfg.data.prompt_overflow == "error",
        "agent workflows need 'error' (truncating would break the turns' shared prefix)",
    )
    ours = sorted(set(r.workflow_args) & set(_PASSED_BY_ARL))
    check(
        "rollout.workflow_args",
        not ours,
        f"{', '.join(ours)} set by arl from their config keys (gconfig, data, rollout); "
        "set those instead",
    )
    params = inspect.signature(workflow).parameters.values()
    takes = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(r.workflow_args) - set(takes) - set(_PASSED_BY_ARL))
    if any(p.kind is p.VAR_KEYWORD for p in params):
        unknown = []  # takes any keyword
    own = [t for t in takes if t not in _PASSED_BY_ARL]
    check(
        "rollout.workflow_args",
        not unknown,
        f"{r.workflow} takes no keyword argument {', '.join(unknown)}; "
        + (f"it takes {', '.join(own)}" if own else "it takes none but arl's own"),
    )
    if unknown or is_agent != bool(r.agent):
        return  # reported above
    passed = [*_WORKFLOW_KWARGS, *(_AGENT_KWARGS if r.agent else ()), *r.workflow_args]
    problem = call_problem(workflow, _WORKFLOW_ARGS, tuple(dict.fromkeys(passed)))
    check("rollout.workflow", not problem, problem)
    check(
        "rollout.workflow",
        not isinstance(workflow, type) or callable(getattr(workflow, "arun_episode", None)),
        f"class {workflow.__qualname__} has no arun_episode method; a workflow class defines "
        "async def arun_episode(self, engine, data, sampling=None, n_samples=None) "
        "(arl.workflows.base.Workflow)",
    )


def show_value(value: Any, quote: bool = True) -> str:
    """A value as it would be written in an override (strings quoted when ``quote``)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(show_value(v, quote) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {show_value(v, quote)}" for k, v in value.items()) + "}"
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
    if origin is dict:
        return "map"
    return getattr(tp, "__name__", str(tp))


CHECKS.update(types=type_problems, values=validation_problems)  # what `Config.validate` runs
