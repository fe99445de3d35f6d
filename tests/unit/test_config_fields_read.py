"""Every config field reaches what it names: each is read, by its attribute name, somewhere in
arl's code outside `arl.config` (nested sections included, no exceptions). A field nothing reads
is a knob that silently does nothing: wire it to its consumer or remove it.

A method or property of the config classes that derives a value from fields (`Config.run_path`,
`ActorConfig.prox_in_update`) passes its reads on: its fields count as read where code outside
`arl.config` reads it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import attrs

from arl.config.tree import field_keys

ARL = Path(__file__).resolve().parents[2] / "arl"


def _attribute_reads() -> set[str]:
    """Names read as ``.name`` in arl outside arl/config (tokens: comments and docstrings do
    not count)."""
    names: set[str] = set()
    for path in ARL.rglob("*.py"):
        if path.relative_to(ARL).parts[0] == "config":
            continue
        prev = None
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.NAME and prev is not None and prev.string == ".":
                names.add(tok.string)
            if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
                prev = tok
    return names


def _config_methods() -> dict[str, set[str]]:
    """Each method or property of the config tree's classes: the attribute names it reads."""
    tree = ast.parse((ARL / "config" / "tree.py").read_text())
    out: dict[str, set[str]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
            reads = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
            out.setdefault(fn.name, set()).update(reads)
    return out


def _unread(keys: dict[str, attrs.Attribute]) -> list[str]:
    reads = _attribute_reads()
    for method, its_reads in _config_methods().items():
        if method in reads:
            reads |= its_reads
    return [key for key, field in keys.items() if field.name not in reads]


def test_every_config_field_is_read_outside_the_config_package():
    unread = _unread(field_keys())
    assert unread == [], f"config fields nothing outside arl/config reads: {unread}"


def test_a_field_nothing_outside_the_config_package_reads_is_reported():
    @attrs.define(kw_only=True)
    class Extra:
        knob_nobody_reads: int = 0

    keys = {**field_keys(), "extra.knob_nobody_reads": attrs.fields(Extra)[0]}
    assert _unread(keys) == ["extra.knob_nobody_reads"]
