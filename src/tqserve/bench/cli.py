"""`tqserve bench <kind>`: throughput (engine vs transformers) or kernels (attention and store)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    kinds = ("throughput", "kernels")
    if not argv or argv[0] not in kinds:
        print(f"usage: tqserve bench {{{'|'.join(kinds)}}} [options]", file=sys.stderr)
        return 2
    if argv[0] == "throughput":
        from tqserve.bench.throughput import main as run
    else:
        from tqserve.bench.kernels import main as run
    return run(argv[1:]) or 0
