"""``python -m arl.launch`` as a user runs it: exit codes, output, errors without tracebacks."""

import os
import socket
import subprocess
import sys
from pathlib import Path

from arl.config import from_yaml

REPO = Path(__file__).resolve().parents[2]


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "arl.launch", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=None if env is None else {**os.environ, **env},
    )


def _resolved_yaml(stdout: str) -> str:
    return stdout.split("# resolved config\n", 1)[1].split("# placement plan", 1)[0]


def test_dry_run_on_this_machine_exits_0():
    r = launch("recipes/gsm8k.py", "--dry-run", "actor.lr=1e-5")  # GPUs detected with torch
    assert r.returncode == 0, r.stderr
    assert from_yaml(_resolved_yaml(r.stdout)).actor.lr == 1e-5
    assert "# placement plan: 2 nodes on " in r.stdout


def test_dry_run_prints_resolved_config_and_plan():
    r = launch("recipes/gsm8k.py", "--dry-run", "actor.lr=1e-5", "cluster.n_gpus=0")
    assert r.returncode == 0, r.stderr
    cfg = from_yaml(_resolved_yaml(r.stdout))
    assert cfg.actor.lr == 1e-5
    assert cfg.experiment.name == "gsm8k-grpo"
    assert "# placement plan: 2 nodes on CPU" in r.stdout
    assert "rollout  0     hf" in r.stdout and "train    0     fsdp" in r.stdout


def test_dry_run_plan_follows_backend_overrides():
    r = launch(
        "recipes/gsm8k.py",
        "--dry-run",
        "rollout.backend=sglang:d2t2",
        "actor.backend=fsdp:d4",
        "cluster.n_gpus=8",
        "cluster.launcher=slurm",  # the plan of an allocation's GPUs, not this host's
        "data.batch_size=8",  # the recipe's CPU batch (2) is fewer groups than 4 train ranks
    )
    assert r.returncode == 0, r.stderr
    assert "6 nodes on 8 GPUs" in r.stdout
    assert "cuda:2  2,3" in r.stdout


def test_recipe_defaults():
    r = launch("recipes/gsm8k.py", "--dry-run", "cluster.n_gpus=0")
    cfg = from_yaml(_resolved_yaml(r.stdout))
    cfg.validate()
    assert (cfg.gconfig.n_samples, cfg.rollout.max_head_offpolicyness) == (4, 2)
    assert cfg.actor.use_decoupled_loss and cfg.actor.eps_clip == 0.4
    assert (cfg.actor.reward_bias, cfg.actor.reward_scaling) == (-0.5, 10.0)
    assert (cfg.actor.reward_norm_mean, cfg.actor.reward_norm_std) == ("group", "group")
    assert (cfg.actor.adv_norm_mean, cfg.actor.adv_norm_std) == ("batch", "batch")
    assert cfg.data.path == "openai/gsm8k"
    assert (cfg.experiment.total_train_steps, cfg.data.batch_size) == (3, 2)  # the CPU preset


def test_the_cpu_preset_follows_the_placement_plan_and_overrides_win():
    def steps(*args: str) -> tuple[int, int]:
        r = launch("recipes/arith.py", "--dry-run", *args)
        assert r.returncode == 0, r.stderr
        cfg = from_yaml(_resolved_yaml(r.stdout))
        return cfg.experiment.total_train_steps, cfg.data.batch_size

    assert steps("cluster.n_gpus=0") == (6, 2)  # no GPU in the plan: recipes/arith.py cpu_preset
    # A GPU in the plan: make_config as written (slurm: the GPUs need not be this host's).
    assert steps("cluster.n_gpus=1", "cluster.launcher=slurm") == (20, 16)
    assert steps("cluster.n_gpus=0", "experiment.total_train_steps=7") == (7, 2)
    # A micro-batch budget that fits only the preset's shorter completions (128 + 48 tokens):
    # valid on CPU, refused where the plan has a GPU and make_config's 192 stand.
    assert steps("cluster.n_gpus=0", "actor.max_tokens_per_mb=180") == (6, 2)
    gpu = ("cluster.n_gpus=1", "cluster.launcher=slurm")
    r = launch("recipes/arith.py", "--dry-run", "actor.max_tokens_per_mb=180", *gpu)
    assert r.returncode == 2 and "actor.max_tokens_per_mb" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_overrides_may_come_before_the_recipe(tmp_path):
    r = launch("actor.lr=1", "recipes/arith.py", "--dry-run", "cluster.n_gpus=0")
    assert r.returncode == 0, r.stderr
    cfg = from_yaml(_resolved_yaml(r.stdout))
    assert (cfg.actor.lr, cfg.experiment.name) == (1.0, "arith-grpo")
    # A recipe path need not end in .py when it names a file; overrides on both sides apply.
    recipe = tmp_path / "arith_recipe"
    recipe.write_text((REPO / "recipes" / "arith.py").read_text())
    r = launch("actor.lr=2", str(recipe), "data.batch_size=3", "--dry-run", "cluster.n_gpus=0")
    assert r.returncode == 0, r.stderr
    cfg = from_yaml(_resolved_yaml(r.stdout))
    assert (cfg.actor.lr, cfg.data.batch_size, cfg.experiment.name) == (2.0, 3, "arith-grpo")


def test_recipes_import_no_torch():
    """--help RECIPE stays fast: importing a recipe (and the launcher) leaves torch unimported."""
    script = (
        "import sys\n"
        "from arl.recipe import import_recipe\n"
        "for r in ('arith', 'gsm8k', 'gsm8k_agent'):\n"
        "    import_recipe(f'recipes/{r}.py').make_config()\n"
        "print('torch' in sys.modules)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def test_unknown_key_exits_2_with_suggestion_and_no_traceback():
    r = launch("recipes/gsm8k.py", "--dry-run", "actor.lrr=1e-5")
    assert r.returncode == 2
    assert "unknown config key 'actor.lrr'; did you mean 'actor.lr'?" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_wrong_type_and_invalid_value_exit_2():
    r = launch("recipes/gsm8k.py", "--dry-run", "data.batch_size=many")
    assert r.returncode == 2
    assert "'data.batch_size'" in r.stderr and "'many'" in r.stderr and "expected int" in r.stderr
    r = launch("recipes/gsm8k.py", "--dry-run", "actor.eps_clip=0")
    assert r.returncode == 2 and "actor.eps_clip=0.0: must be > 0" in r.stderr
    assert "Traceback" not in r.stderr


def test_unsupported_backend_and_too_few_gpus_exit_2():
    r = launch("recipes/gsm8k.py", "--dry-run", "rollout.backend=hf:t2")
    assert r.returncode == 2 and "hf supports only data parallelism" in r.stderr
    r = launch(
        "recipes/gsm8k.py",
        "--dry-run",
        "rollout.backend=vllm:d4",
        "cluster.n_gpus=2",
        "cluster.launcher=slurm",
    )
    assert r.returncode == 2 and "not enough GPUs" in r.stderr
    assert "Traceback" not in r.stderr


def test_help_lists_fields_with_and_without_recipe():
    for args in (["--help"], ["recipes/gsm8k.py", "--help"], ["-h"]):
        r = launch(*args)
        assert r.returncode == 0
        assert r.stdout.startswith("usage: python -m arl.launch RECIPE")
        assert "actor.eps_clip (float, 0.4):" in r.stdout
        assert "weight_sync.bucket_bytes (int, 268435456):" in r.stdout
    assert "experiment.name (str, gsm8k-grpo)" in launch("recipes/gsm8k.py", "--help").stdout


def test_missing_recipe_or_make_config_is_a_clear_error(tmp_path):
    r = launch("recipes/nope.py", "--dry-run")
    assert r.returncode == 2 and "recipe 'recipes/nope.py' not found" in r.stderr
    bad = tmp_path / "bad.py"
    bad.write_text("X = 1\n")
    r = launch(str(bad), "--dry-run")
    assert r.returncode == 2 and "defines no make_config()" in r.stderr
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def make_config():\n    return {}\n")
    r = launch(str(wrong), "--dry-run")
    assert r.returncode == 2 and "returned dict, not arl.config.Config" in r.stderr
    for args in ([], ["actor.lr=1"]):
        r = launch(*args)
        assert r.returncode == 2 and "a recipe file is required" in r.stderr


def test_bad_arguments_exit_2():
    r = launch("recipes/gsm8k.py", "--dry-runn")
    assert r.returncode == 2 and "unknown option --dry-runn" in r.stderr
    r = launch("recipes/gsm8k.py", "--dry-run", "actor.lr")
    assert r.returncode == 2 and "not key=value" in r.stderr


def test_a_mistyped_option_is_refused_naming_the_one_meant():
    for option in ("--dryrun", "--dry_run", "--dry-run=true"):
        r = launch("recipes/arith.py", option)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.startswith(f"unknown option {option}; did you mean --dry-run?\n")


def test_a_second_recipe_is_refused_as_one_not_as_an_override():
    r = launch("recipes/arith.py", "recipes/gsm8k.py", "--dry-run")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr == (
        "error: more than one recipe given (recipes/arith.py, recipes/gsm8k.py); a run takes "
        "one recipe file, then key=value overrides\n"
    )


def test_missing_data_is_refused_before_any_node_starts(tmp_path):
    r = launch("recipes/gsm8k.py", f"data.path={tmp_path}", f"experiment.run_dir={tmp_path}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: data.path=") and f"no train.jsonl in {tmp_path}" in r.stderr
    assert "joined" not in r.stderr and "Traceback" not in r.stderr  # no node was started


def test_an_arl_cache_that_is_a_file_is_refused_before_any_node_starts(tmp_path):
    runs, cache = tmp_path / "runs", tmp_path / "cache"
    cache.write_text("not a folder")
    for given in (cache, cache / "below"):
        r = launch("recipes/arith.py", f"experiment.run_dir={runs}", env={"ARL_CACHE": str(given)})
        assert r.returncode == 2, r.stderr[-2000:]
        assert r.stderr.startswith(f"error: ARL_CACHE={given}: {given} is not a writable folder")
        assert f"({cache} is a file)" in r.stderr and "Set ARL_CACHE to a folder" in r.stderr
        assert "Traceback" not in r.stderr and not runs.exists()
    assert cache.read_text() == "not a folder"


def test_more_gpus_than_this_host_has_are_refused_for_the_local_launcher():
    import torch

    n = torch.cuda.device_count() + 1
    r = launch("recipes/arith.py", "--dry-run", f"cluster.n_gpus={n}")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.startswith(f"error: cluster.n_gpus={n}, but this host has {n - 1} visible GPU")
    assert "cluster.launcher=local starts every node here; set cluster.n_gpus=" in r.stderr
    assert "Traceback" not in r.stderr
    # Nodes started by srun (or attached, or Ray's) may run on hosts that have the GPUs.
    for launcher in ("slurm", "attach"):
        r = launch(
            "recipes/arith.py", "--dry-run", f"cluster.n_gpus={n}", f"cluster.launcher={launcher}"
        )
        assert r.returncode == 0, r.stderr
        assert f"on {n} GPU" in r.stdout


def test_n_nodes_other_than_the_plan_is_refused_before_any_node_starts():
    for n in (1, 3):  # the plan (hf:d1 + fsdp:d1) has 2 nodes
        r = launch("recipes/arith.py", "--dry-run", "cluster.n_gpus=0", f"cluster.n_nodes={n}")
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.startswith(
            f"error: cluster.n_nodes={n}, but the placement plan has 2 nodes (1 rollout from "
            "rollout.backend=hf:d1, 1 train from actor.backend=fsdp:d1); set cluster.n_nodes=2"
        ), r.stderr
        assert "Traceback" not in r.stderr
    r = launch("recipes/arith.py", "--dry-run", "cluster.n_gpus=0", "cluster.n_nodes=2")
    assert r.returncode == 0, r.stderr


def test_a_secret_file_that_cannot_be_used_is_refused_before_anything_is_written(tmp_path):
    runs = tmp_path / "runs"
    missing = tmp_path / "nonexistent"
    r = launch("recipes/arith.py", f"transport.secret_file={missing}", f"experiment.run_dir={runs}")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith(f"error: transport.secret_file={missing}: secret file ")
    assert "does not exist; create it with mode 0600" in r.stderr
    assert "Traceback" not in r.stderr and not runs.exists()  # no config.yaml, no run dir
    readable = tmp_path / "secret"
    readable.write_text("s3cret")
    readable.chmod(0o644)
    r = launch(
        "recipes/arith.py", f"transport.secret_file={readable}", f"experiment.run_dir={runs}"
    )
    assert r.returncode == 2 and f"run `chmod 600 {readable}`" in r.stderr, r.stderr[-2000:]
    assert not runs.exists()


def test_a_controller_port_in_use_is_one_error_naming_it(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = launch(
            "recipes/arith.py",
            f"cluster.controller_port={port}",
            f"experiment.run_dir={tmp_path}",
        )
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line == (
        f"error: cluster.controller_port={port}: tcp://127.0.0.1:{port} is already in use "
        "(another run or program listens there); choose another port, or "
        "cluster.controller_port=0 to pick a free one"
    )
    assert "Traceback" not in r.stderr and "joined" not in r.stderr  # no node was started


def test_no_node_attaching_is_one_error_saying_who_came_and_what_to_run(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cret")
    secret.chmod(0o600)
    attach = ["recipes/arith.py", "cluster.launcher=attach", f"experiment.run_dir={tmp_path}"]
    r = launch(*attach, "cluster.node_start_timeout=5", f"transport.secret_file={secret}")
    assert r.returncode == 1, r.stderr[-2000:]  # a run that stopped, as `the run stopped` says
    (line,) = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert line.startswith("error: the run stopped: 0 of 2 nodes connected to tcp://127.0.0.1:")
    assert " within 5s; start 2 with `arl-node --controller tcp://127.0.0.1:" in line
    assert f" --secret-file {secret}` (launch/arl.sbatch does it all)" in line
    assert "Traceback" not in r.stderr
    # Without a secret the nodes could know, attaching cannot work: refused before the wait.
    r = launch(*attach, "cluster.node_start_timeout=5")
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith("error: cluster.launcher=attach: the nodes started elsewhere must")
    assert "waiting for" not in r.stderr


def test_a_server_backend_whose_python_lacks_it_is_refused_before_any_node_starts(tmp_path):
    import importlib.util

    runs = tmp_path / "runs"
    r = launch(
        "recipes/arith.py",
        "rollout.backend=sglang:d1",
        "rollout.server_python=/no/python",
        f"experiment.run_dir={runs}",
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.startswith(
        "error: rollout.backend=sglang:d1 starts `/no/python -m sglang...`, but '/no/python' is "
        "not an executable here; install sglang for that interpreter, or set rollout.server_python"
    ), r.stderr
    if importlib.util.find_spec("vllm") is None:  # this python, which has no vllm
        r = launch(
            "recipes/arith.py",
            "rollout.backend=vllm:d1",
            f"rollout.server_python={sys.executable}",
            f"experiment.run_dir={runs}",
        )
        assert r.returncode == 2, r.stderr[-2000:]
        assert "but that python cannot import vllm; install vllm" in r.stderr
    assert "joined" not in r.stderr and "Traceback" not in r.stderr  # no node was started
    assert not runs.exists()  # nothing written


_FIRST_SPAWN = """
import os, sys
import arl.process

def spawn(*args, **kwargs):  # the first node: report what the launcher imported, and stop
    print("torch imported:", "torch" in sys.modules, flush=True)
    os._exit(0)

arl.process.spawn = spawn
sys.argv = ["arl.launch", *sys.argv[1:]]
import runpy
try:
    runpy.run_module("arl.launch", run_name="__main__")
finally:
    print("torch imported at exit:", "torch" in sys.modules, flush=True)
"""


def test_the_launcher_starts_its_nodes_before_importing_torch(tmp_path):
    """Every check before the nodes start (config, workflow, placement, weight-sync mode, memory
    plan, model, data, run directory) runs without torch, which would delay each node by its
    import; so does a dry run."""
    from tests.support.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny")  # a local folder: its safetensors are read here
    (tmp_path / "data").mkdir()
    row = '{"question": "1+1?", "answer": "#### 2"}\n'
    for split in ("train", "test"):
        (tmp_path / "data" / f"{split}.jsonl").write_text(row * 4)
    for args in (
        ["recipes/arith.py"],
        ["recipes/arith.py", f"actor.path={model}"],
        ["recipes/gsm8k.py", f"data.path={tmp_path / 'data'}"],
    ):
        r = subprocess.run(
            [sys.executable, "-c", _FIRST_SPAWN, *args, f"experiment.run_dir={tmp_path}/runs"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode == 0 and "torch imported: False" in r.stdout, (args, r.stderr)
        dry = subprocess.run(
            [sys.executable, "-c", _FIRST_SPAWN, *args, "--dry-run"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert dry.returncode == 0 and "# memory plan" in dry.stdout, dry.stderr
        assert "torch imported at exit: False" in dry.stdout  # a dry run answers at once


def test_help_applies_its_overrides_and_refuses_an_unknown_key():
    r = launch("recipes/arith.py", "--help", "actor.lr=0.25")
    assert r.returncode == 0 and "actor.lr (float, 0.25)" in r.stdout, r.stderr
    r = launch("recipes/arith.py", "--help", "actor.lrr=5")
    assert r.returncode == 2 and "unknown config key 'actor.lrr'" in r.stderr, r.stderr


def test_help_into_a_closed_pipe_ends_without_a_traceback():
    """`... --help | head -1`: the reader is gone before the launcher writes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "arl.launch", "recipes/arith.py", "--help"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # before the child has started: its first write fails
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
