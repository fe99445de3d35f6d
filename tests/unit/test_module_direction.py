"""One direction from the command line to the processes: no module below the CLI imports it.

`arl.launch` parses, places and supervises; the run, the supervisor, the trainer and the
benchmarks take what they need from `arl.recipe`, `arl.control.placement` and `arl.run`.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = REPO / "arl" / "launch.py"


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_no_module_but_the_cli_imports_the_cli():
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "arl").rglob("*.py"))
        if path != CLI and "arl.launch" in _imported_modules(path)
    ]
    assert offenders == [], f"these modules import arl.launch: {offenders}"


def test_importing_the_run_and_the_supervisor_leaves_the_cli_unimported():
    code = (
        "import sys\n"
        "import arl.run, arl.supervisor, arl.trainer, arl.recipe, arl.control.placement\n"
        "import arl.bench.e2e, arl.bench.sync, arl.bench.loop\n"
        "print('arl.launch' in sys.modules)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "False"


def test_agent_never_imports_workflows():
    """`arl.workflows` builds on `arl.agent` (the agent workflow drives its client), not back."""
    offenders = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "arl" / "agent").rglob("*.py"))
        if any(
            m == "arl.workflows" or m.startswith("arl.workflows.") for m in _imported_modules(path)
        )
    ]
    assert offenders == [], f"these agent modules import arl.workflows: {offenders}"
