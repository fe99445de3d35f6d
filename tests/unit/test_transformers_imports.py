"""`arl.transformers_imports.defer_sklearn`: transformers' assisted-generation module imported
without scikit-learn where a release imports it at module level, and nothing done elsewhere.

The releases it acts on (5.x up to 5.2x) are not the one installed here, so the first test builds
packages laid out as they are (``transformers.utils.is_sklearn_available``,
``transformers/generation/candidate_generator.py`` with its module-level import, and a
scikit-learn whose import is recorded) and runs a fresh interpreter on them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from arl.transformers_imports import EAGER_IMPORT

ROOT = Path(__file__).resolve().parents[2]

CANDIDATE_GENERATOR = (
    "from ..utils import is_sklearn_available\n"
    + EAGER_IMPORT
    + textwrap.dedent(
        """
        def threshold(labels, scores):
            if is_sklearn_available():
                return roc_curve(labels, scores)
            return None
        """
    )
)


def _packages(root: Path) -> None:
    files = {
        "transformers/__init__.py": "",
        "transformers/utils/__init__.py": textwrap.dedent(
            """
            import importlib.util

            def is_sklearn_available():
                return importlib.util.find_spec("sklearn") is not None
            """
        ),
        "transformers/generation/__init__.py": "",
        "transformers/generation/candidate_generator.py": CANDIDATE_GENERATOR,
        # Imported by name meanwhile, as other transformers modules do.
        "transformers/generation/other.py": "from ..utils import is_sklearn_available\n",
        "sklearn/__init__.py": "import os\nos.environ['SKLEARN_IMPORTED'] = '1'\n",
        "sklearn/metrics.py": "def roc_curve(y, s):\n    return ('roc', y, s)\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _run(code: str, *paths: Path) -> str:
    """``code`` in a fresh interpreter; given ``paths``, without site-packages (``-S``), so the
    packages built there are the only transformers and scikit-learn it can find."""
    env_path = ":".join(str(p) for p in (*paths, ROOT))
    out = subprocess.run(
        [sys.executable, *(["-S"] if paths else []), "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": env_path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_eager_import_is_deferred_to_the_first_roc_curve(tmp_path: Path) -> None:
    _packages(tmp_path)
    out = _run(
        """
        import os, sys
        from arl.transformers_imports import defer_sklearn
        assert defer_sklearn() is True
        import transformers.generation.other as other
        import transformers.generation.candidate_generator as cg
        import transformers.utils as utils
        assert "sklearn" not in sys.modules and "SKLEARN_IMPORTED" not in os.environ
        # The check is transformers' own again, wherever it was imported by name.
        assert cg.is_sklearn_available is utils.is_sklearn_available
        assert other.is_sklearn_available is utils.is_sklearn_available
        assert utils.is_sklearn_available() is True
        print(cg.threshold([0, 1], [0.2, 0.9]), os.environ.get("SKLEARN_IMPORTED"))
        assert defer_sklearn() is False  # done once
        """,
        tmp_path,
    )
    assert out == "('roc', [0, 1], [0.2, 0.9]) 1"


def test_nothing_is_done_where_scikit_learn_is_missing_or_the_import_is_already_lazy(
    tmp_path: Path,
) -> None:
    _packages(tmp_path)
    (tmp_path / "sklearn").rename(tmp_path / "sklearn_gone")
    no_sklearn = _run(
        "import sys\nfrom arl.transformers_imports import defer_sklearn\n"
        "print(defer_sklearn(), 'transformers' in sys.modules)",
        tmp_path,
    )
    assert no_sklearn == "False False"
    (tmp_path / "sklearn_gone").rename(tmp_path / "sklearn")
    lazy = tmp_path / "transformers/generation/candidate_generator.py"
    lazy.write_text(CANDIDATE_GENERATOR.replace(EAGER_IMPORT, "\n"))
    assert (
        _run(
            "import sys\nfrom arl.transformers_imports import defer_sklearn\n"
            "print(defer_sklearn(), 'transformers' in sys.modules, 'sklearn' in sys.modules)",
            tmp_path,
        )
        == "False False False"
    )


def test_the_installed_transformers_still_imports_after_it() -> None:
    """On the installed transformers: whichever way it goes, the tokenizer and model classes
    import afterwards, and scikit-learn is imported only where the call did nothing."""
    out = _run(
        """
        import sys
        from arl.transformers_imports import defer_sklearn
        deferred = defer_sklearn()
        from transformers import AutoModelForCausalLM, AutoTokenizer
        print(deferred, "sklearn" in sys.modules if deferred else "-")
        """
    )
    assert out in ("True False", "False -")


def test_a_module_that_fails_to_import_changes_nothing(tmp_path: Path) -> None:
    _packages(tmp_path)
    broken = tmp_path / "transformers/generation/candidate_generator.py"
    broken.write_text(CANDIDATE_GENERATOR + "\nraise ImportError('a broken install')\n")
    out = _run(
        """
        import sys
        from arl.transformers_imports import defer_sklearn
        import transformers.utils as utils
        check = utils.is_sklearn_available
        print(defer_sklearn(), utils.is_sklearn_available is check, "sklearn" in sys.modules)
        """,
        tmp_path,
    )
    assert out == "False True False"


def _with_distributions(root: Path) -> None:
    """The fake transformers' utilities take the mapping at import, as 5.x up to 5.2x do; one
    installed distribution, ``demo``."""
    _packages(root)
    utils = root / "transformers/utils/__init__.py"
    utils.write_text(
        utils.read_text() + "\nimport importlib.metadata\n"
        "MAPPING = importlib.metadata.packages_distributions()\n"
    )
    meta = root / "demo-1.0.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n")
    (meta / "top_level.txt").write_text("demo\n")


def test_transformers_utilities_import_with_the_distributions_kept_in_the_cache(
    tmp_path: Path, monkeypatch
) -> None:
    _with_distributions(tmp_path / "pkgs")
    monkeypatch.setenv("ARL_CACHE", str(tmp_path / "cache"))
    first = _run(
        """
        import importlib.metadata as m
        original = m.packages_distributions
        from arl.transformers_imports import cached_distributions
        assert cached_distributions() is True
        import transformers.utils as u
        assert m.packages_distributions is original  # put back
        assert u.MAPPING == original(), (u.MAPPING, original())
        print(u.MAPPING["demo"], cached_distributions())
        """,
        tmp_path / "pkgs",
    )
    assert first == "['demo'] False"
    assert len(list((tmp_path / "cache" / "python").glob("distributions-*.json"))) == 1
    # A later process reads the mapping back: the scan would fail here.
    later = _run(
        """
        import importlib.metadata as m
        def scan():
            raise AssertionError("scanned again")
        m.packages_distributions = scan
        from arl.transformers_imports import cached_distributions
        assert cached_distributions() is True
        import transformers.utils as u
        print(u.MAPPING["demo"], m.packages_distributions is scan)
        """,
        tmp_path / "pkgs",
    )
    assert later == "['demo'] True"


def test_the_key_follows_the_installed_distributions(tmp_path: Path, monkeypatch) -> None:
    from arl.transformers_imports import environment_key

    monkeypatch.syspath_prepend(str(tmp_path))
    before = environment_key()
    (tmp_path / "notes.txt").write_text("not a distribution")
    assert environment_key() == before
    (tmp_path / "other-2.0.dist-info").mkdir()
    assert environment_key() != before
