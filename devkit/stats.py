"""The statistics every figure of the tests and the benchmarks is computed with.

`percentile(values, q)` is the q-th percentile (q from 0 to 100) with linear interpolation
between the closest ranks (numpy's default), or None when there are no values.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100, linear interpolation), or None for no values."""
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))
