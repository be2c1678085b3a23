"""Output error measures of the kernel tests (one definition each; the tests import them as `_row_err`)."""

import numpy as np


def row_err_global(a, r):
    """The largest RMS error of a row (one sequence, one head) over the RMS of the whole reference output; the
    output must be finite. Decode tests: one row per (sequence, head)."""
    a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
    assert np.all(np.isfinite(a))
    return float(np.sqrt(np.mean((a - r) ** 2, axis=-1)).max() / np.sqrt(np.mean(r ** 2)))


def row_err_relative(out, ref):
    """The largest per-row (query, head) RMS error over head_dim, relative to that row's RMS in the reference (floored
    at 1/8 of the whole output's RMS, for rows whose output is near zero). Prefill tests."""
    o, r = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    row = np.sqrt(np.mean(r ** 2, axis=-1))
    return float((np.sqrt(np.mean((o - r) ** 2, axis=-1)) / np.maximum(row, np.sqrt(np.mean(r ** 2)) / 8)).max())
