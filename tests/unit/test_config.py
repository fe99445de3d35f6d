"""The config tree: overrides, backend strings, validation, YAML round trips, help text."""

import attrs
import pytest

from arl.config import (
    Backend,
    Config,
    ConfigError,
    apply_overrides,
    field_keys,
    from_yaml,
    help_text,
    load_yaml,
    parse_backend,
    save_resolved,
    to_yaml,
)
from arl.config.tree import SaverConfig
from arl.config.validate import validation_problems


def test_defaults_validate_and_run_path():
    cfg = Config()
    cfg.validate()
    assert str(cfg.run_path) == "runs/arl/trial0"
    assert cfg.ref_path == cfg.actor.path
    # As many groups as eta lets run: the staleness bound, not a second cap, limits rollout.
    assert cfg.max_concurrent_rollouts == 3 * cfg.data.batch_size
    cfg.rollout.max_head_offpolicyness = 0
    assert cfg.max_concurrent_rollouts == cfg.data.batch_size
    cfg.rollout.max_concurrent_rollouts = 5
    assert cfg.max_concurrent_rollouts == 5


def test_every_field_has_help():
    for key, field in field_keys().items():
        assert field.metadata.get("help"), key
    for section in attrs.fields(Config):
        assert section.metadata.get("help"), section.name


@pytest.mark.parametrize(
    ("override", "key", "expected"),
    [
        ("actor.lr=1e-5", "actor.lr", 1e-5),
        ("actor.lr=3", "actor.lr", 3.0),
        ("actor.reward_bias=-0.25", "actor.reward_bias", -0.25),
        ("data.batch_size=16", "data.batch_size", 16),
        ("transport.pull_chunk_bytes=1e6", "transport.pull_chunk_bytes", 1_000_000),
        ("experiment.name=my-run", "experiment.name", "my-run"),
        ("stats.jsonl=false", "stats.jsonl", False),
        ("stats.jsonl=no", "stats.jsonl", False),
        ("stats.jsonl=0", "stats.jsonl", False),
        ("data.shuffle=yes", "data.shuffle", True),
        ("data.shuffle=True", "data.shuffle", True),
        ("data.shuffle=1", "data.shuffle", True),
        ("rollout.stale_sample_policy=drop", "rollout.stale_sample_policy", "drop"),
        ("actor.lr_scheduler=cosine", "actor.lr_scheduler", "cosine"),
        ("evaluator.freq_steps=none", "evaluator.freq_steps", None),
        ("evaluator.freq_steps=null", "evaluator.freq_steps", None),
        ("evaluator.freq_steps=5", "evaluator.freq_steps", 5),
        ("actor.eps_clip_higher=0.28", "actor.eps_clip_higher", 0.28),
        ("actor.behav_imp_weight_cap=None", "actor.behav_imp_weight_cap", None),
        (
            "cluster.allowed_import_prefixes=[arl.,myorg.]",
            "cluster.allowed_import_prefixes",
            ["arl.", "myorg."],
        ),
        (
            "cluster.allowed_import_prefixes=arl., myorg.",
            "cluster.allowed_import_prefixes",
            ["arl.", "myorg."],
        ),
        ("cluster.srun_args=[]", "cluster.srun_args", []),
        ("cluster.srun_args=--exclusive", "cluster.srun_args", ["--exclusive"]),
        ('cluster.srun_args=["--x=a,b", -N1]', "cluster.srun_args", ["--x=a,b", "-N1"]),
        ("gconfig.stop_token_ids=[2, 7]", "gconfig.stop_token_ids", [2, 7]),
        ("rollout.backend=sglang:d4p1t1", "rollout.backend", "sglang:d4p1t1"),
        ("rollout.server_args=--mem-fraction=0.8", "rollout.server_args", ["--mem-fraction=0.8"]),
    ],
)
def test_override_converts_to_field_type(override, key, expected):
    section, name = key.split(".")
    value = getattr(getattr(apply_overrides(Config(), [override]), section), name)
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_leave_the_input_unchanged_and_later_ones_win():
    cfg = Config()
    out = apply_overrides(cfg, ["actor.lr=1e-3", "actor.lr=2e-3", "cluster.srun_args=[a]"])
    assert out.actor.lr == 2e-3 and out.cluster.srun_args == ["a"]
    assert cfg.actor.lr == 1.7e-5 and cfg.cluster.srun_args == []


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("cluster.srun_args=[a,b", "unbalanced brackets"),
        ("cluster.srun_args=a,b]", "unbalanced brackets"),
        ("cluster.srun_args=['a,b]", "unclosed '"),
    ],
)
def test_a_malformed_list_is_refused_not_guessed(override, says):
    with pytest.raises(ConfigError, match="cluster.srun_args") as e:
        apply_overrides(Config(), [override])
    assert says in str(e.value)


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("actor.lrr=1", "actor.lr"),
        ("experiment.nmae=x", "experiment.name"),
        ("gconfig.n_sample=2", "gconfig.n_samples"),
        ("lr=1", "actor.lr"),  # bare field name
        ("acter.eps_clip=0.2", "actor.eps_clip"),
        ("rollout.eta=4", "rollout.max_head_offpolicyness"),  # the README's name for it
        ("actor.learning_rate=1e-5", "actor.lr"),
        ("actor.model=DIR", "actor.path"),
    ],
)
def test_unknown_key_names_the_nearest_valid_key(override, suggestion):
    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), [override])
    key = override.partition("=")[0]
    assert f"unknown config key '{key}'; did you mean '{suggestion}'?" in str(e.value)


def test_unknown_key_without_a_near_match_lists_sections():
    with pytest.raises(ConfigError, match="section one of experiment, cluster"):
        apply_overrides(Config(), ["zzzz.qqqq=1"])


def test_section_as_key_says_it_is_a_section():
    with pytest.raises(ConfigError, match="'actor' is a section"):
        apply_overrides(Config(), ["actor=3"])


@pytest.mark.parametrize(
    ("override", "expected_type"),
    [
        ("actor.lr=fast", "float"),
        ("actor.eps_clip=nan", "float"),
        ("data.batch_size=1.5", "int"),
        ("data.batch_size=four", "int"),
        ("stats.jsonl=maybe", "bool"),
        ("actor.dtype=float16", "auto|float32|bfloat16"),
        ("evaluator.freq_steps=often", "int or none"),
        ("gconfig.stop_token_ids=[1,x]", "list[int]"),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(override, expected_type):
    key, _, value = override.partition("=")
    with pytest.raises(ConfigError) as e:
        apply_overrides(Config(), [override])
    msg = str(e.value)
    assert f"'{key}'" in msg and f"'{value}'" in msg and f"expected {expected_type}" in msg


def test_literal_error_lists_the_choices():
    with pytest.raises(ConfigError, match="choose one of keep, drop"):
        apply_overrides(Config(), ["rollout.stale_sample_policy=discard"])


@pytest.mark.parametrize("override", ["actor.lr", "=3", "actor.lr 1e-5"])
def test_malformed_override_is_a_clear_error(override):
    with pytest.raises(ConfigError, match="not key=value"):
        apply_overrides(Config(), [override])


def test_bad_backend_override_names_the_key():
    with pytest.raises(ConfigError, match="'rollout.backend'.*hf supports only data parallel"):
        apply_overrides(Config(), ["rollout.backend=hf:t2"])
    with pytest.raises(ConfigError, match="'actor.backend'.*not a train engine"):
        apply_overrides(Config(), ["actor.backend=sglang:d2"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sglang:d4p1t1", Backend("sglang", dp=4, tp=1, pp=1)),
        ("sglang:t2d4", Backend("sglang", dp=4, tp=2, pp=1)),
        ("vllm:d2", Backend("vllm", dp=2)),
        ("vllm:t4", Backend("vllm", tp=4)),
        ("hf:d1", Backend("hf")),
        ("hf", Backend("hf")),
        ("fsdp:d4", Backend("fsdp", dp=4)),
        ("fsdp:p1d8t1", Backend("fsdp", dp=8)),
    ],
)
def test_parse_backend_valid(text, expected):
    assert parse_backend(text) == expected


def test_backend_world_size_and_canonical_string():
    b = parse_backend("sglang:t2d4")
    assert b.world_size == 8
    assert str(b) == "sglang:d4t2p1"
    assert parse_backend(str(b)) == b


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hf:t2", "hf supports only data parallelism"),
        ("hf:p2", "hf supports only data parallelism"),
        ("fsdp:d2t2", "fsdp supports only data parallelism"),
        ("fsdp:p2", "fsdp supports only data parallelism"),
        ("sglang:d2p2", "pipeline parallelism .* not supported for sglang"),
        ("vllm:p2", "pipeline parallelism .* not supported for vllm"),
    ],
)
def test_parse_backend_unsupported_parallelism(text, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_backend(text)
    assert repr(text) in str(e.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hf:x3", "unknown letter 'x'"),
        ("foo:d1", "unknown engine 'foo'"),
        ("hf:d0", "must be >= 1"),
        ("hf:d2d2", "'d' given twice"),
        ("hf:", "malformed"),
        ("hf:dd", "malformed"),
        ("hf:d-1", "malformed"),
        ("", "malformed"),
        ("sglang d4", "malformed"),
    ],
)
def test_parse_backend_garbage_shows_expected_format(text, message):
    with pytest.raises(ConfigError, match=message) as e:
        parse_backend(text)
    assert "expected ENGINE:SPEC" in str(e.value)


def test_parse_backend_role_restricts_engines():
    assert parse_backend("sglang:d2", "rollout").engine == "sglang"
    with pytest.raises(ConfigError, match="'fsdp' is not a rollout engine; use one of hf, vllm"):
        parse_backend("fsdp:d2", "rollout")
    with pytest.raises(ConfigError, match="'hf' is not a train engine; use one of fsdp"):
        parse_backend("hf:d1", "train")


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["data.batch_size=0"], "data.batch_size=0: must be > 0"),
        (["actor.eps_clip=0"], "actor.eps_clip=0.0: must be > 0"),
        (["actor.eps_clip=-0.2"], "actor.eps_clip=-0.2: must be > 0"),
        (["actor.c_clip=0.5"], "dual clip needs c > 1"),
        (["gconfig.top_p=1.5"], "gconfig.top_p=1.5: must be in (0, 1]"),
        (["gconfig.temperature=0"], "set gconfig.greedy=true"),
        (["actor.discount=1.5"], "actor.discount=1.5: must be in [0.0, 1.0]"),
        (["cluster.heartbeat_timeout=0.5"], "must exceed cluster.heartbeat_interval"),
        (["cluster.controller_port=70000"], "must be 0..65535"),
        (["cluster.allowed_import_prefixes=[]"], "needs at least one prefix"),
        (["experiment.name=a/b"], "experiment.name='a/b': must be a plain name"),
        (["rollout.workflow=arl.workflows.rlvr"], "must be an import path module:attribute"),
        (["actor.ppo_n_minibatches=17"], "more minibatches than the 16 sequences"),
        (["actor.max_tokens_per_mb=700"], "smaller than the longest sequence"),
        (["gconfig.n_samples=1"], "group normalisation needs gconfig.n_samples >= 2"),
        (["evaluator.max_questions=0"], "evaluator.max_questions=0: must be > 0"),
        (["cluster.n_gpus=-1"], "cluster.n_gpus=-1"),
        (["rollout.mps_engine_percent=30"], "rollout.mps_engine_percent=30: must be 50 or 100"),
        (["rollout.mps_engine_percent=75"], "rollout.mps_engine_percent=75: must be 50 or 100"),
        (["actor.lora.rank=-1"], "actor.lora.rank=-1: must be >= 0"),
        (["actor.lora.rank=8", "actor.lora.alpha=0"], "actor.lora.alpha=0.0: must be > 0"),
        (["actor.lora.rank=8", "actor.lora.dropout=1"], "actor.lora.dropout=1.0: must be in"),
        (["actor.lora.rank=8", "actor.lora.target_modules=[]"], "needs module names"),
        (
            ["rollout.gpu_sharing=mps", "cluster.launcher=slurm"],
            "only cluster.launcher=local starts the nodes (here 'slurm')",
        ),
    ],
)
def test_validate_reports_bad_values(overrides, problem):
    cfg = apply_overrides(Config(), overrides)
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert problem in str(e.value)


def test_auto_gpu_sharing_is_valid_under_any_launcher():
    """auto asks for MPS only where the local launcher can start it: under Slurm it means
    concurrent, so it is no error there, as mps is."""
    for launcher in ("local", "slurm"):
        overrides = ["rollout.gpu_sharing=auto", f"cluster.launcher={launcher}"]
        assert validation_problems(apply_overrides(Config(), overrides)) == []


def test_validate_catches_backend_strings_set_in_code():
    cfg = Config()
    cfg.rollout.backend = "hf:x3"
    cfg.actor.backend = "fsdp:t2"
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert "rollout.backend: backend 'hf:x3'" in str(e.value)
    assert "actor.backend: backend 'fsdp:t2'" in str(e.value)


def test_validate_catches_choices_set_in_code():
    # A recipe assigns fields directly, past the override parser's check of the choices.
    cfg = Config()
    cfg.rollout.batch_order = "fastest"
    cfg.actor.layout = "dense"
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert "rollout.batch_order='fastest': choose one of finished, submitted" in str(e.value)
    assert "actor.layout='dense': choose one of auto, packed, padded" in str(e.value)


def test_flex_decode_attention_is_refused_for_a_server_engine():
    cfg = apply_overrides(Config(), ["rollout.backend=vllm:d1", "rollout.hf_decode_attention=flex"])
    with pytest.raises(ConfigError, match="hf_decode_attention='flex': applies to the hf engine"):
        cfg.validate()
    apply_overrides(Config(), ["rollout.hf_decode_attention=flex"]).validate()
    # The default, auto, leaves a server's attention to the server.
    apply_overrides(Config(), ["rollout.backend=vllm:d1"]).validate()


def test_validate_lists_every_problem_at_once():
    cfg = apply_overrides(Config(), ["data.batch_size=0", "actor.eps_clip=0"])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert "data.batch_size" in str(e.value) and "actor.eps_clip" in str(e.value)


def test_valid_edge_values_pass():
    cfg = apply_overrides(
        Config(),
        [
            "cluster.n_gpus=0",
            "gconfig.temperature=0",
            "gconfig.greedy=true",
            "gconfig.n_samples=1",
            "actor.reward_norm_mean=batch",
            "actor.reward_norm_std=none",
            "rollout.max_head_offpolicyness=0",
            "actor.c_clip=3",
        ],
    )
    cfg.validate()  # raises ConfigError if any of these were refused
    assert cfg.gconfig.temperature == 0 and cfg.actor.c_clip == 3


def test_yaml_round_trip_preserves_every_field(tmp_path):
    cfg = apply_overrides(
        Config(),
        [
            "actor.lr=1e-5",
            "evaluator.freq_steps=none",
            "saver.freq_steps=10",
            "cluster.allowed_import_prefixes=[arl.,myorg.]",
            "gconfig.stop_token_ids=[2,7]",
            "actor.eps_clip_higher=0.28",
            "rollout.backend=sglang:d2t2",
            "weight_sync.mode=nccl",
            "experiment.name=yes",  # a YAML 1.1 boolean word must stay a string
            "data.path=null",
        ],
    )
    assert from_yaml(to_yaml(cfg)) == cfg
    path = save_resolved(cfg, tmp_path / "deep" / "config.yaml")
    assert path.is_file()
    assert load_yaml(path) == cfg


def test_from_yaml_fills_defaults_and_rejects_bad_input():
    cfg = from_yaml("actor:\n  lr: 0.001\n")
    assert cfg.actor.lr == 0.001 and cfg.actor.eps_clip == Config().actor.eps_clip
    for text, message in [
        ("actor: {lrr: 1}", "unknown keys lrr @ config.actor"),
        ("bogus: {}", "unknown keys bogus"),
        ("data: {batch_size: 1.5}", "expected int, got 1.5 @ config.data.batch_size"),
        ("stats: {jsonl: 'false'}", "expected bool"),
        ("cluster: {srun_args: -N1}", "expected a list"),
        ("rollout: {stale_sample_policy: x}", "expected one of keep, drop"),
        ("[1, 2]", "must be a mapping"),
        ("actor: [", "does not parse"),
    ]:
        with pytest.raises(ConfigError, match=message):
            from_yaml(text)


def test_help_text_lists_every_field_with_type_default_and_help():
    text = help_text()
    for key, field in field_keys().items():
        assert f"  {key} (" in text, key
        assert field.metadata["help"] in text
    assert "actor.lr (float, 1.7e-05): peak learning rate" in text
    assert "evaluator.freq_steps (int or none, none):" in text
    assert "cluster.allowed_import_prefixes (list[str], [arl.]):" in text
    assert "rollout.stale_sample_policy (keep|drop, keep):" in text


def test_help_text_shows_the_given_config_values():
    cfg = apply_overrides(Config(), ["actor.lr=0.5"])
    assert "actor.lr (float, 0.5):" in help_text(cfg)


@pytest.mark.parametrize(
    "hf_export, freq_steps, due_steps",
    [(True, 2, [2, 4]), (True, None, []), (False, 2, []), (False, None, [])],
)
def test_saver_exports_every_freq_steps_only_with_hf_export(hf_export, freq_steps, due_steps):
    saver = SaverConfig(hf_export=hf_export, freq_steps=freq_steps)
    assert [step for step in range(1, 6) if saver.due(step)] == due_steps
