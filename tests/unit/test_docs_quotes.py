"""Code that the docs quote is the code that runs: a quote that drifts from its source fails."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_agents_doc_quotes_the_math_agent_as_it_is():
    doc = (REPO / "docs" / "agents.md").read_text()
    source = (REPO / "arl" / "agent" / "examples" / "math_agent.py").read_text()
    quoted = re.search(r"```python\n(async def run_with_calculator.*?)```", doc, re.S)
    assert quoted, "docs/agents.md no longer quotes run_with_calculator"
    assert quoted.group(1) in source, "docs/agents.md quotes run_with_calculator as it was"
