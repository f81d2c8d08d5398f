"""matplotlib for the benchmarks' plots, when it is installed (an optional dependency: pip install '.[examples]')."""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note on stderr) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib not installed: no plot (pip install '.[examples]')", file=sys.stderr)
        return None
    return plt
