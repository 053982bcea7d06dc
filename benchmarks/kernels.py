"""Run `tqserve bench kernels` without the CLI: python benchmarks/kernels.py [--quick] [--json out.json]."""

import sys

from tqserve.bench.kernels import main

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
