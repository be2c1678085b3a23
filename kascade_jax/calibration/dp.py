"""Anchor selection by dynamic programming (paper Algorithm 1, official `_pick_k_layers`), jitted, all budgets at once.

Objective: over anchor sets A with 0 in A and |A| = M, maximise sum_l S[anchor(l)][l], where anchor(l) is the
largest anchor <= l and S[a][b] (a <= b) is the importance-weighted layer similarity (`stats.layer_scores`).
With seg(i, j) = sum_{l=i}^{j-1} S[i][l] (anchor i serves layers i..j-1):
    F_1[j] = seg(0, j),   F_m[j] = max_{i<j} F_{m-1}[i] + seg(i, j),   best(M) = F_M[L].
One `lax.scan` over m computes every F_m and its argmax table, a second one backtracks all budgets M = 1..L
together, so a single O(L^3) call answers every budget (L = 80: well under a millisecond of arithmetic).
Unlike the paper's form, S[0][0] is counted once, so the returned score is exactly the objective.

Deliberately not here: how S is measured (`stats.py`) or which M to use (the caller picks; default 5).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def dp_all_budgets(S):
    """S [L, L] (upper triangle used) -> (anchor_masks [L, L] bool: row M-1 = the best set of M anchors,
    scores [L] fp32: its objective), for every M = 1..L."""
    S = jnp.asarray(S, jnp.float32)
    L = S.shape[0]
    rows, cols = jnp.arange(L)[:, None], jnp.arange(L + 1)[None, :]
    upper = jnp.where(jnp.arange(L)[:, None] <= jnp.arange(L)[None, :], S, 0.0)
    csum = jnp.concatenate([jnp.zeros((L, 1), jnp.float32), jnp.cumsum(upper, axis=1)], axis=1)  # [L, L+1]
    seg = jnp.where(cols > rows, csum - jnp.take_along_axis(csum, rows, axis=1), -jnp.inf)  # [L (i), L+1 (j)]
    f1 = seg[0]  # [L+1]; f1[0] = -inf: one anchor must serve at least layer 0

    def extend(f_prev, _):
        cand = f_prev[:L, None] + seg  # [i, j]: last anchor i, next segment starts at j
        return jnp.max(cand, axis=0), (jnp.max(cand, axis=0), jnp.argmax(cand, axis=0).astype(jnp.int32))

    _, (fs, paths) = jax.lax.scan(extend, f1, None, length=L - 1)  # m = 2..L
    fs = jnp.concatenate([f1[None], fs])  # [M-1, j]
    paths = jnp.concatenate([jnp.zeros((1, L + 1), jnp.int32), paths])
    budgets = jnp.arange(1, L + 1)

    def back(carry, m):  # m runs L..2; every budget M >= m takes one step back
        cur, masks = carry  # cur [M-1]: where the (m+1)-th segment starts
        prev = paths[m - 1, cur]
        active = m <= budgets
        masks = masks.at[jnp.arange(L), prev].max(active)
        return (jnp.where(active, prev, cur), masks), None

    masks0 = jnp.zeros((L, L), bool).at[:, 0].set(True)
    (_, masks), _ = jax.lax.scan(back, (jnp.full((L,), L, jnp.int32), masks0), jnp.arange(L, 1, -1))
    return masks, fs[:, L]


def objective(S, anchors) -> float:
    """sum_l S[anchor(l)][l] in float64 for one anchor set (must contain 0)."""
    S = np.asarray(S, np.float64)
    anchors = sorted(anchors)
    if not anchors or anchors[0] != 0:
        raise ValueError(f"anchors must contain layer 0, got {anchors}")
    total, a = 0.0, 0
    for layer in range(S.shape[0]):
        if layer in anchors:
            a = layer
        total += S[a, layer]
    return total


def select_anchors(S) -> dict[int, tuple[tuple[int, ...], float]]:
    """{M: (anchors, objective)} for every budget M = 1..L, from the jitted DP."""
    S = np.asarray(S, np.float32)
    if S.ndim != 2 or S.shape[0] != S.shape[1] or S.shape[0] < 1:
        raise ValueError(f"S must be a square [L, L] matrix, got shape {S.shape}")
    if not np.all(np.isfinite(S)):
        raise ValueError("S must be finite")
    masks, scores = jax.device_get(dp_all_budgets(S))
    return {m + 1: (tuple(int(i) for i in np.flatnonzero(masks[m])), float(scores[m])) for m in range(S.shape[0])}


def brute_force(S, num_anchors: int) -> tuple[tuple[int, ...], float]:
    """Exhaustive search over anchor sets of size num_anchors containing 0 (tests; C(L-1, M-1) sets)."""
    L = np.asarray(S).shape[0]
    if not 1 <= num_anchors <= L:
        raise ValueError(f"num_anchors must lie in [1, {L}], got {num_anchors}")
    best = max(((0,) + c for c in itertools.combinations(range(1, L), num_anchors - 1)),
               key=lambda a: objective(S, a))
    return best, objective(S, best)
