"""``python -m arl.launch RECIPE [key=value ...] [--dry-run] [--help]``: run a recipe.

A recipe is a Python file defining ``make_config() -> Config`` and, optionally,
``cpu_preset(cfg)``, applied when the placement plan has no GPU. Overrides are applied; the
config is validated and placed, the model and data are checked (`arl.preflight`) and the run
directory is claimed (`arl.run_dir`: one run at a time, never mixed into a finished run,
writable) before any process starts; the resolved config is saved as ``config.yaml`` in the run
directory, and the run (`arl.run`) goes on under the restart supervisor (`arl.supervisor`), on
the plan placed here. A user error ends as one ``error: ...`` line and exit
status 2. A stop is a checkpoint: SIGTERM or a first Ctrl-C during training finishes the step,
writes a recovery checkpoint and exits 143 (130), and the same command resumes from it
(`arl.ckpt.stop`); a second signal, or ``recover.stop_grace_s``, ends the run without it.
"""

import asyncio
import difflib
import logging
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

from arl.bytecode import cache_bytecode
from arl.ckpt.stop import RunStopped, StopRequest, signal_name
from arl.config import Config, ConfigError, apply_overrides, help_text, save_resolved, to_yaml
from arl.control.memory import format_memory_plan
from arl.control.placement import detect_gpus, format_plan, plan_placement
from arl.data.gsm8k import DatasetError
from arl.engines.spec import describe, engine_spec
from arl.event_loop import cancel_running
from arl.protocol.plan import Plan
from arl.recipe import apply_cpu_preset, import_recipe, load_recipe

USAGE = """\
usage: python -m arl.launch RECIPE [key=value ...] [--dry-run] [--help]

  RECIPE      a Python file defining make_config() -> arl.config.Config (e.g. recipes/gsm8k.py),
              and optionally cpu_preset(cfg), applied when the placement plan has no GPU
  key=value   override a config field (before or after RECIPE), e.g. actor.lr=1e-5
              rollout.backend=sglang:d2; lists: cluster.srun_args=[a,b]; optional fields:
              evaluator.freq_steps=none
  --dry-run   print the resolved config, the placement plan and the memory plan (what each
              GPU holds: engine weights, KV cache, trainer weights, gradients, optimizer,
              activations; host bytes with actor.offload=optimizer), then exit. A plan that
              cannot fit is refused, with or without --dry-run, naming the least change that
              fits (rollout.gpu_sharing=sleep, actor.offload=optimizer, actor.lora.rank=16)
  --help      print this text and every config field (with RECIPE: the recipe's values)
"""


def configure(path: str, overrides: list[str]) -> tuple[Config, Plan, int]:
    """The recipe's config under ``overrides``, validated and placed: (config, plan, GPUs).

    When the plan has no GPU and the recipe defines ``cpu_preset(cfg)``, the preset is applied
    to ``make_config()`` first and the overrides after it, so a command-line value always wins.
    """
    recipe = import_recipe(path)
    cfg = apply_overrides(load_recipe(path, recipe), overrides)
    try:
        cfg.validate()
        refused = None
    except ConfigError as e:
        # An override may be valid only beside the preset's values (a micro-batch budget that
        # fits its shorter completions): that is decided once the plan says CPU or GPU.
        if not hasattr(recipe, "cpu_preset"):
            raise
        refused = e
    try:
        n_gpus = detect_gpus(cfg)
        plan = plan_placement(cfg, n_gpus)
    except Exception:
        if refused is None:
            raise
        raise refused from None  # the plan of an invalid config: the config's own error
    on_gpu = any(n.gpu_ids for n in plan.nodes)
    if refused is not None and on_gpu:
        raise refused
    if hasattr(recipe, "cpu_preset") and not on_gpu:
        cfg = load_recipe(path, recipe)
        apply_cpu_preset(path, recipe, cfg)
        cfg = apply_overrides(cfg, overrides)
        cfg.validate()
        n_gpus = detect_gpus(cfg)
        plan = plan_placement(cfg, n_gpus)
    return cfg, plan, n_gpus


_OVERRIDE = re.compile(r"[A-Za-z_][\w.]*=")


def _find_recipe(positional: list[str]) -> str | None:
    """The recipe among the positional arguments, wherever it stands among the overrides: the
    first that names a file, else the first that is not ``key=value`` and ends in .py, else the
    first that is not ``key=value`` (refused then as not found), else None."""
    files = [a for a in positional if os.path.isfile(a)]  # even one named like lr=1e-5.py
    candidates = [a for a in positional if not _OVERRIDE.match(a)]
    named = [a for a in candidates if a.endswith(".py")]
    return (files or named or candidates or [None])[0]


def _share_recipe_folder(recipe: str) -> None:
    """Put the recipe's folder on this process's import path and on the nodes' (``PYTHONPATH``,
    which local and srun-started nodes inherit), as ``python recipe.py`` would: a reward or
    workflow module beside the recipe then imports on every side, not only in the launcher."""
    folder = str(Path(recipe).resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([folder, *paths])


def main(argv: list[str] | None = None) -> int:
    """The launcher; returns the process exit status."""
    args = sys.argv[1:] if argv is None else argv
    flags = {a for a in args if a.startswith("-")}
    positional = [a for a in args if not a.startswith("-")]
    unknown = flags - {"--dry-run", "--help", "-h"}
    if unknown:
        option = sorted(unknown)[0]
        close = difflib.get_close_matches(option.split("=")[0], ["--dry-run", "--help"], n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"unknown option {option}{hint}\n\n{USAGE}", file=sys.stderr)
        return 2
    recipe = _find_recipe(positional)
    overrides = list(positional)
    if recipe is not None:
        overrides.remove(recipe)  # its first occurrence, which is the one chosen
    more = [a for a in overrides if os.path.isfile(a) and not _OVERRIDE.match(a)]
    if recipe is not None and more:
        print(
            f"error: more than one recipe given ({recipe}, {', '.join(more)}); a run takes one "
            "recipe file, then key=value overrides",
            file=sys.stderr,
        )
        return 2
    if recipe is not None and os.path.isfile(recipe):
        _share_recipe_folder(recipe)
    try:
        if flags & {"--help", "-h"}:
            cfg = load_recipe(recipe) if recipe else None
            if overrides:  # shown as they would apply, and refused as a run would refuse them
                cfg = apply_overrides(cfg if cfg is not None else Config(), overrides)
            if cfg is not None:
                cfg.validate_types()  # help_text would show wrong types, or trip on them
            print(USAGE)
            print(
                "config fields: key (type, "
                + ("recipe value" if recipe else "value" if overrides else "default")
                + "): help"
            )
            print(help_text(cfg))
            return 0
        if recipe is None:
            print(f"a recipe file is required\n\n{USAGE}", file=sys.stderr)
            return 2
        cfg, plan, n_gpus = configure(recipe, overrides)
        # Built here only to refuse contradicting engine settings before any process starts;
        # the trainer builds them again with the resolved model path and node-local devices.
        engines = [engine_spec(cfg, n, cfg.actor.path) for n in plan.rollout]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--dry-run" in flags:
        print("# resolved config")
        print(to_yaml(cfg))
        where = f"{n_gpus} GPU{'s' * (n_gpus != 1)}" if n_gpus else "CPU"
        print(
            f"# placement plan: {len(plan.nodes)} nodes on {where}, launcher "
            f"{cfg.cluster.launcher}, weight sync {plan.sync_mode}"
        )
        print(format_plan(plan))
        print("# rollout engines (the model path is resolved when the run starts)")
        for node, spec in zip(plan.rollout, engines, strict=True):
            print(f"node {node.node_id}: {describe(spec)}")
        print(format_memory_plan(cfg, plan), end="")
        return 0
    logging.basicConfig(
        level=cfg.experiment.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from arl.ckpt.recovery import ResumeRefused, check_resume, read_latest, resume_keys
    from arl.control.cluster import run_security
    from arl.engines.model import ModelResolutionError
    from arl.preflight import (
        InputError,
        check_cache,
        check_data,
        check_model,
        check_prompts,
        check_server,
    )
    from arl.run_dir import RunDirError, claim_run_dir, keep_previous
    from arl.supervisor import supervise

    signals = _StopSignals(cfg.recover.stop_grace_s)
    claim = None
    try:
        # Everything a user can get wrong is checked before any node starts or any file is
        # written: the run secret, the cache folder, the model, the server's interpreter, the
        # data and its prompts' length, then the run directory (lock, earlier run, writability).
        run_security(cfg)
        check_cache()
        model_dir = check_model(cfg)
        check_server(cfg, engines)
        data = check_data(cfg)  # loaded once: the run (and its restarts) use these rows
        check_prompts(cfg, model_dir, data[0])
        claim = claim_run_dir(cfg, sync_mode=plan.sync_mode)
        log = logging.getLogger("arl.launch")
        if claim.moved_to is not None:
            log.warning("experiment.overwrite: the earlier run was moved to %s", claim.moved_to)
        if claim.resume_step is not None:
            # Refused here, as one line naming the keys, before any node starts.
            check_resume(read_latest(claim.path), resume_keys(cfg, len(plan.train), data[0]))
            log.info("resuming %s from its step-%d checkpoint", claim.path, claim.resume_step)
        resolved = to_yaml(cfg)
        kept = keep_previous(cfg.run_path / "config.yaml", resolved)
        if kept is not None:
            log.warning("the config differs from the earlier run's; that one is kept as %s", kept)
        saved = save_resolved(cfg, cfg.run_path / "config.yaml")
        log.info("resolved config saved to %s (run id %s)", saved, claim.run_id)
        return supervise(cfg, plan, claim.run_id, data, signals.stop)
    except (
        ConfigError,
        DatasetError,
        RunDirError,
        InputError,
        ModelResolutionError,
        ResumeRefused,
    ) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunStopped as e:
        again = "; run the same command to resume from it" if e.path is not None else ""
        print(f"{e}{again}", file=sys.stderr)
        return e.exit_status
    except (KeyboardInterrupt, asyncio.CancelledError):
        if signals.received is None and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            raise
        resume = ""
        state = read_latest(cfg.run_path)
        if state is not None and state.resumes(cfg.recover.mode, cfg.experiment.total_train_steps):
            resume = "; run the same command to resume from the last recovery checkpoint"
        signum = signals.received or signal.SIGINT
        why = {
            "second": " without a checkpoint (a second signal)",
            "grace": " without a checkpoint: it was not written within "
            f"recover.stop_grace_s={cfg.recover.stop_grace_s:g}s",
        }.get(signals.cut, "")
        if signum == signal.SIGTERM:
            print(
                f"stopped by SIGTERM: the run and its nodes were ended{why}{resume}",
                file=sys.stderr,
            )
            return 128 + signal.SIGTERM
        print(f"interrupted{why}{resume}", file=sys.stderr)
        return 130
    finally:
        signals.restore()
        if claim is not None:
            claim.release()


class _StopSignals:
    """SIGTERM (Slurm at a time limit or a preemption, ``timeout``, systemd) and Ctrl-C.

    During training the first one asks the trainer to stop with a checkpoint (`StopRequest`);
    before training (nothing to save yet), on a second signal, or once ``grace_s`` passed, the
    run is cancelled: its nodes are ended and its files closed, then `KeyboardInterrupt` (or
    the run's `asyncio.CancelledError`); a third signal leaves at once. A handler someone else
    installed is left alone, and so is an ignored SIGINT (a background job of a script: SIGTERM
    still stops it).
    """

    def __init__(self, grace_s: float) -> None:
        self.received: int | None = None  # the first signal
        self.cut = ""  # "second" or "grace": the run was ended without its checkpoint
        self._count = 0  # signals received
        self.stop = StopRequest(grace_s, on_expiry=self._grace_over)
        self._installed = []
        for signum, default in (
            (signal.SIGTERM, signal.SIG_DFL),
            (signal.SIGINT, signal.default_int_handler),
        ):
            if signal.getsignal(signum) is default:
                signal.signal(signum, self._on_signal)
                self._installed.append((signum, default))

    def _on_signal(self, signum: int, frame: Any) -> None:
        first = self.received is None
        if first:
            self.received = signum
        self._count += 1
        if self._count > 2:  # the teardown itself is stuck: leave now (nodes get PDEATHSIG)
            raise KeyboardInterrupt
        if first and self.stop.request(signum):
            print(
                f"{signal_name(signum)}: stopping after this step with a recovery checkpoint "
                "(signal again to end now without it)",
                file=sys.stderr,
                flush=True,
            )
            return
        if not first and not self.stop.settled:  # settled: its checkpoint is already written
            self.cut = "second"
        self._end_now()

    def _grace_over(self) -> None:
        self.cut = "grace"
        self._end_now()

    def _end_now(self) -> None:
        # In the loop the run is cancelled: a KeyboardInterrupt raised inside it would end the
        # loop before the run's teardown could end its nodes.
        if not cancel_running():
            raise KeyboardInterrupt

    def restore(self) -> None:
        """Put the previous handlers back."""
        for signum, default in self._installed:
            signal.signal(signum, default)


if __name__ == "__main__":
    cache_bytecode()  # before the config check imports torch
    try:
        sys.exit(main())
    except BrokenPipeError:  # `--help | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
