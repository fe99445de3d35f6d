"""``arl-node`` and ``python -m arl.node``: the node daemon (`arl.node.daemon`), started with
compiled bytecode kept where Python would not keep it (`arl.bytecode`), before the daemon's
imports (torch) run."""

from __future__ import annotations

import sys

from arl.bytecode import cache_bytecode


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``arl-node`` console script."""
    cache_bytecode()
    from arl.node.daemon import main as daemon_main

    return daemon_main(argv)


if __name__ == "__main__":
    sys.exit(main())
