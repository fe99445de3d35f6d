"""`Config.validate` checks the type of every field a recipe sets directly, before its values.

A recipe assigns fields in Python, past the override parser's conversions: a wrong type must be
one clear problem in the one `ConfigError`, never a raw TypeError inside validation or a crash
on a node after ``--dry-run`` passed.
"""

import math

import pytest

from arl.config import Config, ConfigError, apply_overrides, from_yaml, to_yaml, type_problems


def _set(cfg: Config, key: str, value: object) -> Config:
    section, _, name = key.partition(".")
    if name:
        setattr(getattr(cfg, section), name, value)
    else:
        setattr(cfg, section, value)
    return cfg


def _problems(**values: object) -> str:
    cfg = Config()
    for key, value in values.items():
        _set(cfg, key.replace("__", "."), value)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    return str(e.value)


@pytest.mark.parametrize(
    ("key", "value", "problem"),
    [
        ("data.batch_size", 2.5, "data.batch_size=2.5: expected int"),
        ("data.batch_size", "4", "data.batch_size='4': expected int"),
        ("data.batch_size", True, "data.batch_size=true: expected int"),  # a bool is no int
        ("actor.lr", "fast", "actor.lr='fast': expected float"),
        ("actor.lr", True, "actor.lr=true: expected float"),
        ("gconfig.temperature", None, "gconfig.temperature=none: expected float"),
        ("gconfig.stop_token_ids", 5, "gconfig.stop_token_ids=5: expected list[int]"),
        ("gconfig.stop_token_ids", [1, "2"], "gconfig.stop_token_ids=[1,'2']: expected list[int]"),
        ("gconfig.greedy", 1, "gconfig.greedy=1: expected bool"),
        ("experiment.name", 5, "experiment.name=5: expected str"),
        ("actor", None, "actor=none: expected a section of type ActorConfig"),
        ("cluster.n_gpus", 1.0, "cluster.n_gpus=1.0: expected int or none"),
        ("rollout.group_timeout", "1h", "rollout.group_timeout='1h': expected float or none"),
        ("rollout.batch_order", "fastest", "choose one of finished, submitted"),
        # Named by its key, not as the engine spec's field (bf16 is torch's short name).
        ("rollout.dtype", "bf16", "rollout.dtype='bf16': choose one of auto, bfloat16, float16"),
        # A str is no list: it used to be checked, and shown, as its characters.
        (
            "cluster.allowed_import_prefixes",
            "arl.",
            "cluster.allowed_import_prefixes='arl.': expected list[str]",
        ),
    ],
)
def test_a_wrong_type_set_in_code_is_one_named_problem(key, value, problem):
    cfg = _set(Config(), key, value)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = str(e.value)
    assert msg.startswith("invalid config:\n  ")
    assert problem in msg
    assert len(msg.splitlines()) == 2  # only that problem: the value checks were skipped


def test_every_type_problem_is_listed_at_once_and_value_checks_are_skipped():
    msg = _problems(
        actor__lr="fast",
        data__batch_size="4",
        gconfig__temperature=None,
        gconfig__stop_token_ids=5,
        experiment__name=5,
        actor__eps_clip=-1.0,  # a value problem: not reported while types are wrong
    )
    lines = msg.splitlines()[1:]
    assert len(lines) == 5, msg
    for key in ("actor.lr", "data.batch_size", "gconfig.temperature", "gconfig.stop_token_ids"):
        assert any(line.strip().startswith(key + "=") for line in lines), (key, msg)
    assert "experiment.name=5: expected str" in msg
    assert "eps_clip" not in msg


def test_fields_of_a_replaced_section_are_not_looked_at():
    msg = _problems(actor=None, data__batch_size=2.5)
    assert msg.splitlines()[1:] == [
        "  actor=none: expected a section of type ActorConfig",
        "  data.batch_size=2.5: expected int, got float",
    ]


def test_an_override_on_a_replaced_section_is_a_config_error():
    cfg = _set(Config(), "actor", None)
    with pytest.raises(ConfigError, match="section actor must be of type ActorConfig, got none"):
        apply_overrides(cfg, ["actor.lr=1e-5"])


@pytest.mark.parametrize(
    ("key", "value", "why"),
    [
        ("actor.lr", math.inf, "must be a finite number"),
        ("actor.lr", -math.inf, "must be a finite number"),
        ("actor.reward_clip", -math.inf, "must be a finite number"),  # inf: unclipped; -inf no
        ("actor.lr", 10**400, "must be a finite number"),  # an int no float can hold
        ("gconfig.temperature", math.nan, "must be a number, not nan"),
        ("actor.eps_clip_higher", math.nan, "must be a number, not nan"),  # float | None
        ("cluster.heartbeat_timeout", math.nan, "must be a number, not nan"),
    ],
)
def test_non_finite_floats_are_refused(key, value, why):
    msg = _problems(**{key.replace(".", "__"): value})
    assert f"{key}={value}: {why}" in msg


@pytest.mark.parametrize(
    "key",
    ["cluster.heartbeat_timeout", "cluster.node_start_timeout", "rollout.group_timeout"]
    + ["actor.grad_clip", "actor.reward_clip", "actor.call_timeout"],
)
def test_infinity_is_no_limit_where_a_limit_may_be_off(key):
    cfg = _set(Config(), key, math.inf)
    assert type_problems(cfg) == []
    cfg.validate()
    assert type_problems(from_yaml(to_yaml(cfg))) == []


def test_a_refused_type_is_named_beside_the_value():
    import numpy as np

    msg = _problems(data__batch_size=np.int64(8), actor__lr=np.float64(1e-5))
    assert "data.batch_size=8: expected int, got numpy.int64" in msg
    assert "actor.lr=1e-05: expected float, got numpy.float64" in msg


@pytest.mark.parametrize("override", ["actor.lr=inf", "gconfig.temperature=-inf"])
def test_non_finite_float_overrides_are_refused_at_validate(override):
    cfg = apply_overrides(Config(), [override])
    with pytest.raises(ConfigError, match="must be a finite number"):
        cfg.validate()


def test_right_types_pass_ints_count_as_floats_and_tuples_as_lists():
    cfg = Config()
    cfg.actor.lr = 1  # an int where a float is expected
    cfg.rollout.group_timeout = None
    cfg.gconfig.stop_token_ids = [2, 3]
    assert type_problems(cfg) == []
    cfg.validate()
    cfg.gconfig.stop_token_ids = (2, 3)  # saved as a list
    cfg.cluster.allowed_import_prefixes = ("arl.", "mine.")
    assert type_problems(cfg) == []
    cfg.validate()
    assert from_yaml(to_yaml(cfg)).gconfig.stop_token_ids == [2, 3]


def test_every_default_and_yaml_round_trip_has_the_right_types():
    assert type_problems(Config()) == []
    assert type_problems(from_yaml(to_yaml(Config()))) == []
