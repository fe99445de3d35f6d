"""The import rule (`arl.protocol.imports`): only objects defined under an allowed prefix.

Each escape from issue 19 is refused, by the node's `resolve_import` and by config validation
alike; legitimate strings still resolve.
"""

from __future__ import annotations

import pytest

from arl.config import Config, ConfigError, apply_overrides
from arl.protocol.imports import ImportRefused, resolve_import, under_prefix

ESCAPES = [
    "arl.control.launcher:shutil.rmtree",
    "arl.node.daemon:os.system",
    "arl.control.launcher:os.execl",
    "arl.config.tree:re.compile",
    "arl.config.files:yaml.unsafe_load",  # a module's attribute imported there
    "arl.node.daemon:asyncio",  # a module imported there, itself
    "arl.control:launcher.shutil",  # through a submodule attribute
    "arl.config:Config.__init__.__globals__",  # introspection
    "arl.bench.__main__:main",  # a dunder module would run its main on import
]


@pytest.mark.parametrize("target", ESCAPES)
def test_node_rule_refuses_objects_not_defined_under_the_prefix(target):
    with pytest.raises(ImportRefused) as info:
        resolve_import(target, ("arl.",))
    assert repr(target) in str(info.value)
    assert "allowed" in str(info.value)


def test_the_refusal_names_the_step_and_where_it_lives():
    with pytest.raises(
        ImportRefused, match=r"'arl.control.launcher:shutil' is defined in 'shutil'"
    ):
        resolve_import("arl.control.launcher:shutil.rmtree", ("arl",))


@pytest.mark.parametrize(
    ("name", "prefixes", "ok"),
    [
        ("arl", ["arl"], True),
        ("arl.x", ["arl"], True),
        ("arl.x", ["arl."], True),
        ("arl", ["arl."], True),
        ("arlfoo", ["arl"], False),
        ("arlfoo", ["arl."], False),
        ("arlfoo.x", ["arl"], False),
        ("myorg.rl.rewards", ["myorg.rl"], True),
        ("myorg.rlx", ["myorg.rl"], False),
        ("x", [""], False),
        ("x", ["."], False),
    ],
)
def test_prefixes_match_whole_dotted_components(name, prefixes, ok):
    assert under_prefix(name, prefixes) is ok


def test_a_prefix_without_a_dot_does_not_admit_a_sibling_package(tmp_path, monkeypatch):
    (tmp_path / "arlfoo.py").write_text("def f():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportRefused, match="not under the allowed prefixes"):
        resolve_import("arlfoo:f", ("arl",))


@pytest.mark.parametrize(
    "target",
    [
        "arl.workflows.rlvr:RLVRWorkflow",
        "arl.rewards.gsm8k:gsm8k_reward",
        "arl.data.gsm8k:load_gsm8k",
        "arl.filters:nonconstant_reward",
        "arl.node.rollout:RolloutWorker.setup",  # a method: defined in arl.node.rollout
    ],
)
def test_legitimate_strings_still_resolve(target):
    assert callable(resolve_import(target, ("arl",)))


@pytest.mark.parametrize("bad", ["arl", "arl:", ":f", "arl.x:a-b", "arl..x:f", "arl.x:f.", 3])
def test_malformed_strings_are_value_errors(bad):
    with pytest.raises(ValueError, match="import string"):
        resolve_import(bad, ("arl",))


@pytest.mark.parametrize("key", ["data.loader", "rollout.reward", "rollout.workflow"])
@pytest.mark.parametrize("target", ESCAPES[:3])
def test_config_validation_refuses_the_same_strings(key, target):
    cfg = apply_overrides(Config(), [f"{key}={target}"])
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    line = next(ln for ln in str(info.value).splitlines() if ln.strip().startswith(key))
    assert repr(target) in line and "is defined in" in line and "allowed" in line


def test_config_validation_refuses_a_prefix_that_is_not_a_module_name():
    cfg = apply_overrides(Config(), ["cluster.allowed_import_prefixes=[arl.,.]"])
    with pytest.raises(ConfigError, match="cluster.allowed_import_prefixes.*dotted module name"):
        cfg.validate()


def test_config_validation_names_a_missing_attribute():
    cfg = apply_overrides(Config(), ["rollout.reward=arl.rewards.gsm8k:no_such_reward"])
    with pytest.raises(ConfigError, match=r"rollout.reward=.*'arl.rewards.gsm8k:no_such_reward'"):
        cfg.validate()
