"""Rules declared on the fields, and plug-in names checked against their registries: a plug-in
registered in its own registry (an engine, a weight-sync mode, a launcher) is accepted by
validation and listed by --help without an edit to arl.config; workflows are told apart by
class, and rollout.workflow_args must be keywords the workflow takes."""

import pytest

import arl.control.launchers
import arl.engines.spec
import arl.weights
from arl.config import Config, ConfigError, apply_overrides, from_yaml, help_text, to_yaml

PLUGINS = [  # registry, the config key that names one, how the key is written
    (arl.engines.spec.ENGINES, "rollout.backend", "{}:d1"),
    (arl.weights.MODES, "weight_sync.mode", "{}"),
    (arl.control.launchers.LAUNCHERS, "cluster.launcher", "{}"),
]


@pytest.mark.parametrize(("registry", "key", "form"), PLUGINS)
def test_a_plugin_registered_in_its_registry_only_is_accepted(monkeypatch, registry, key, form):
    value = form.format("mine")
    with pytest.raises(ConfigError, match=f"{key}.*'mine'"):
        apply_overrides(Config(), [f"{key}={value}"]).validate()
    monkeypatch.setitem(registry, "mine", next(iter(registry.values())))
    apply_overrides(Config(), [f"{key}={value}"]).validate()
    line = next(ln for ln in help_text().splitlines() if ln.startswith(f"  {key} ("))
    assert "mine" in line  # --help lists the registry's names


def test_an_unknown_plugin_name_lists_the_registered_ones():
    cfg = apply_overrides(Config(), ["cluster.launcher=slrum", "weight_sync.mode=ncll"])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert "cluster.launcher='slrum': choose one of local, slurm, ray, attach" in str(e.value)
    assert "weight_sync.mode='ncll': choose one of auto, ipc_buffer, ipc, nccl" in str(e.value)


def test_help_shows_the_bounds_a_rule_declares():
    text = help_text()
    assert (
        "gconfig.top_p (float, 1.0): nucleus sampling probability mass; must be in (0, 1]" in text
    )
    assert "actor.c_clip (float or none, none):" in text and "must be > 1 or none" in text


AGENT = [
    "rollout.agent=arl.agent.examples.math_agent:run",
    "cluster.allowed_import_prefixes=[arl.,tests.]",
]


def test_a_subclass_of_the_agent_workflow_is_the_agent_workflow():
    sub = [
        "rollout.workflow=tests.support.agents:NotedAgentWorkflow",
        "rollout.workflow_args={note: x}",
    ]
    apply_overrides(Config(), [*AGENT, *sub]).validate()
    with pytest.raises(ConfigError, match="rollout.agent=.*or a subclass of it"):
        apply_overrides(Config(), AGENT).validate()  # the default RLVR workflow takes no agent
    with pytest.raises(ConfigError, match="data.prompt_overflow='truncate': agent workflows"):
        apply_overrides(Config(), [*AGENT, *sub, "data.prompt_overflow=truncate"]).validate()


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ("{max_turns: 4}", "RLVRWorkflow takes no keyword argument max_turns; it takes none"),
        ("{n_samples: 2}", "n_samples set by arl from their config keys"),
        ("{on: 1}", "keys must be str, got true (bool); quote it"),
        ("{start: [1, {day: 2024-01-01}]}", "expected plain data, got 2024-01-01 (datetime.date)"),
    ],
)
def test_workflow_args_the_workflow_cannot_take_are_refused(args, problem):
    cfg = apply_overrides(Config(), [f"rollout.workflow_args={args}"])
    with pytest.raises(ConfigError, match="rollout.workflow_args=") as e:
        cfg.validate()
    assert problem in str(e.value)


def test_workflow_args_round_trip_through_yaml():
    cfg = apply_overrides(Config(), ["rollout.workflow_args={note: x, depth: [1, 2]}"])
    assert cfg.rollout.workflow_args == {"note": "x", "depth": [1, 2]}
    assert from_yaml(to_yaml(cfg)) == cfg


MISFITS = "cluster.allowed_import_prefixes=[arl.,tests.]"


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        (
            "rollout.reward=tests.support.misfits:no_arguments",
            "rollout.reward='tests.support.misfits:no_arguments': arl calls it with "
            "(completion, data), but its signature is () (too many positional arguments)",
        ),
        (
            "rollout.reward=tests.support.misfits:SETTINGS",
            "is not callable (an object of type Settings); arl calls it with (completion, data)",
        ),
        ("rollout.filter=tests.support.misfits:no_arguments", "arl calls it with (report)"),
        (
            "data.loader=tests.support.misfits:loader_without_on_bad_row",
            "arl calls it with (path, split, on_bad_row), but its signature is (path, split)",
        ),
        (
            "rollout.workflow=tests.support.misfits:TwoArgumentWorkflow",
            "arl calls it with (tokenizer, reward_fn, sampling, n_samples=..., max_prompt_len=..., "
            "prompt_overflow=...), but its signature is (tokenizer, reward_fn)",
        ),
        (
            "rollout.workflow=tests.support.misfits:Settings",
            "class Settings has no arun_episode method",
        ),
        (
            "rollout.workflow=tests.support.misfits:SETTINGS",
            "is not callable (an object of type Settings)",
        ),
    ],
)
def test_a_plugin_that_cannot_take_the_arguments_arl_passes_is_refused(override, problem):
    cfg = apply_overrides(Config(), [override, MISFITS])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert problem in str(e.value)


def test_an_agent_that_cannot_take_client_and_data_is_refused():
    cfg = apply_overrides(
        Config(),
        [
            "rollout.workflow=arl.workflows.agent:AgentWorkflow",
            "rollout.agent=tests.support.misfits:no_arguments",
            MISFITS,
        ],
    )
    with pytest.raises(ConfigError, match=r"rollout.agent=.*arl calls it with \(client, data\)"):
        cfg.validate()
    good = [*AGENT, "rollout.workflow=arl.workflows.agent:AgentWorkflow"]
    apply_overrides(Config(), good).validate()  # the example agent takes (client, data)
