"""Benchmark jax_flash against cuDNN, XLA and Pallas Mosaic GPU (see `python -m jax_flash.benchmark --help`).

    python examples/03_benchmark.py --dtypes bf16 --head-dims 128 --json bench.json --plot bench.png
"""

import sys

from jax_flash.benchmark import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
