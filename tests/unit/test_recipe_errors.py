"""A recipe that fails, in any way, ends the launcher in one error line naming the file, the
line and the exception, exit 2, before any process starts (with ``--help RECIPE`` too)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from arl.config import ConfigError
from arl.recipe import import_recipe, load_recipe

REPO = Path(__file__).resolve().parents[2]

HEAD = "from arl.config import Config\n"
MAKE = "\n\ndef make_config():\n    return Config()\n"

# (name, source, the line the error must name, what the error must say)
BROKEN = [
    ("syntax", HEAD + "\ndef make_config(:\n    return Config()\n", 3, "raised SyntaxError"),
    (
        "missing_import",
        HEAD + "import nonexistent_pkg\n" + MAKE,
        2,
        "raised ModuleNotFoundError: No module named 'nonexistent_pkg'",
    ),
    ("raise_at_import", HEAD + "raise RuntimeError('no GPU here')\n" + MAKE, 2, "no GPU here"),
    (
        "raise_in_make_config",
        HEAD + "\n\ndef make_config():\n    cfg = Config()\n    return cfg.nope\n",
        6,
        "raised AttributeError: 'Config' object has no attribute 'nope'",
    ),
    (
        "failing_cpu_preset",
        HEAD + MAKE + "\n\ndef cpu_preset(cfg):\n    cfg.data.batch_size = 1 / 0\n",
        9,
        "raised ZeroDivisionError: division by zero",
    ),
    (
        "exits",
        "import sys\n" + HEAD + "sys.exit(0)\n" + MAKE,
        3,
        "called sys.exit(0) while loading (SystemExit)",
    ),
]


def launch(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "arl.launch", *args],
        cwd=cwd,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(("name", "source", "line", "says"), BROKEN, ids=[b[0] for b in BROKEN])
def test_a_failing_recipe_is_one_error_naming_file_line_and_exception(
    tmp_path, name, source, line, says
):
    recipe = tmp_path / f"{name}.py"
    recipe.write_text(source)
    args = [str(recipe), "--dry-run", "cluster.n_gpus=0"]  # no GPU: cpu_preset applies
    for argv in (args, ["--help", str(recipe)]) if name != "failing_cpu_preset" else (args,):
        r = launch(*argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"error: recipe {recipe} line {line} "), r.stderr
        assert says in r.stderr and "<frozen" not in r.stderr  # no frame of the import system
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "# resolved config" not in r.stdout and "usage:" not in r.stdout


def test_a_wrong_type_set_by_a_recipe_is_refused_by_dry_run_and_help(tmp_path):
    recipe = tmp_path / "fractional.py"
    recipe.write_text(
        HEAD + "\n\ndef make_config():\n    c = Config()\n    c.data.batch_size = 2.5\n"
        "    c.gconfig.temperature = None\n    return c\n"
    )
    for argv in ([str(recipe), "--dry-run"], ["--help", str(recipe)]):
        r = launch(*argv)
        assert r.returncode == 2, (argv, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        assert "data.batch_size=2.5: expected int" in r.stderr
        assert "gconfig.temperature=none: expected float" in r.stderr
    # An override that fixes the value is applied before the check.
    r = launch(str(recipe), "--dry-run", "data.batch_size=2", "gconfig.temperature=1")
    assert r.returncode == 0, r.stderr


def test_a_config_error_raised_by_a_recipe_names_the_recipe(tmp_path):
    recipe = tmp_path / "overrides.py"
    recipe.write_text(
        "from arl.config import Config, apply_overrides\n\n\ndef make_config():\n"
        "    return apply_overrides(Config(), ['actor.lrr=1'])\n"
    )
    with pytest.raises(ConfigError) as e:
        load_recipe(str(recipe))
    assert str(e.value).startswith(f"recipe {recipe} line 5: unknown config key 'actor.lrr'")


def test_a_recipe_imports_a_module_beside_it_from_any_working_directory(tmp_path):
    folder = tmp_path / "myrecipes"
    folder.mkdir()
    (folder / "arl_test_helpers_beside.py").write_text("BATCH = 3\n")
    (folder / "r.py").write_text(
        HEAD + "import arl_test_helpers_beside\n\n\ndef make_config():\n    c = Config()\n"
        "    c.data.batch_size = arl_test_helpers_beside.BATCH\n    return c\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = launch(str(folder / "r.py"), "--dry-run", "cluster.n_gpus=0", cwd=elsewhere)
    assert r.returncode == 0, r.stderr
    assert "  batch_size: 3\n" in r.stdout
    # In-process: the folder is on sys.path only while the recipe's code runs.
    before = list(sys.path)
    assert load_recipe(str(folder / "r.py")).data.batch_size == 3
    assert sys.path == before


def test_a_recipe_importing_another_names_both_files(tmp_path):
    (tmp_path / "base.py").write_text(HEAD + "import nonexistent_pkg\n" + MAKE)
    (tmp_path / "child.py").write_text(
        "from arl.recipe import import_recipe\n"
        f"BASE = import_recipe({str(tmp_path / 'base.py')!r})\n" + MAKE.replace("Config()", "1")
    )
    with pytest.raises(ConfigError) as e:
        import_recipe(str(tmp_path / "child.py"))
    msg = str(e.value)
    assert msg.startswith(f"recipe {tmp_path / 'child.py'} line 2: recipe {tmp_path / 'base.py'}")
    assert "line 2 raised ModuleNotFoundError" in msg
    assert "Traceback" not in msg


def test_an_error_raised_in_a_module_the_recipe_calls_names_where_it_was_raised(tmp_path):
    (tmp_path / "arl_test_helper_raises.py").write_text("def build():\n    raise KeyError('lr')\n")
    (tmp_path / "r.py").write_text(
        HEAD + "import arl_test_helper_raises\n\n\ndef make_config():\n"
        "    return arl_test_helper_raises.build()\n"
    )
    with pytest.raises(ConfigError) as e:
        load_recipe(str(tmp_path / "r.py"))
    helper = tmp_path / "arl_test_helper_raises.py"
    assert str(e.value) == (
        f"recipe {tmp_path / 'r.py'} line 6 raised KeyError: 'lr' (raised at {helper}:2)"
    )


def test_a_recipe_defining_a_dataclass_loads(tmp_path):
    """With ``from __future__ import annotations`` a dataclass looks its module up in
    sys.modules, where the recipe is registered while it runs."""
    (tmp_path / "dc.py").write_text(
        "from __future__ import annotations\n\nimport dataclasses\n\n"
        + HEAD
        + "\n\n@dataclasses.dataclass\nclass Sizes:\n    batch: int = 3\n"
        + "\n\ndef make_config():\n    c = Config()\n    c.data.batch_size = Sizes().batch\n"
        + "    return c\n"
    )
    assert load_recipe(str(tmp_path / "dc.py")).data.batch_size == 3


def test_a_recipe_file_named_like_an_override_is_still_the_recipe(tmp_path):
    recipe = tmp_path / "lr=1e-5.py"
    recipe.write_text(HEAD + MAKE)
    r = launch("lr=1e-5.py", "--dry-run", "cluster.n_gpus=0", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "# resolved config" in r.stdout


def test_a_directory_given_as_the_recipe_is_named_as_one(tmp_path):
    (tmp_path / "mine.py").write_text(HEAD + MAKE)
    with pytest.raises(
        ConfigError, match=r"is a directory, not a Python file; .*e\.g\. .*mine\.py"
    ):
        import_recipe(str(tmp_path))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"is a directory, .*holds no \.py file"):
        import_recipe(str(empty))


@pytest.mark.parametrize(
    ("source", "says"),
    [
        (HEAD + "\n\ndef make_config(name):\n    return Config()\n", "make_config() arl calls"),
        (HEAD + MAKE + "\n\ndef cpu_preset():\n    pass\n", "cpu_preset() arl calls it with (cfg)"),
        (HEAD + MAKE + "\ncpu_preset = 5\n", "cpu_preset() is not callable"),
    ],
)
def test_a_recipe_function_that_cannot_be_called_as_arl_calls_it_is_the_recipes_error(
    tmp_path, source, says
):
    (tmp_path / "r.py").write_text(source)
    with pytest.raises(ConfigError) as e:
        import_recipe(str(tmp_path / "r.py"))
    assert says in str(e.value) and "raised at" not in str(e.value)
