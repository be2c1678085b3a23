"""Anchor-selection DP: equals brute force on random matrices for every budget; jitted and fast at L = 80."""

import time

import numpy as np
import pytest

from kascade_jax.calibration.dp import brute_force, dp_all_budgets, objective, select_anchors


@pytest.mark.parametrize("num_layers", range(1, 11))
def test_dp_equals_brute_force(rng, num_layers):
    S = np.triu(rng.random((num_layers, num_layers))).astype(np.float32)
    S[rng.random(S.shape) < 0.2] *= 0.1  # some near-zero entries: more distinct optima
    best = select_anchors(S)
    assert sorted(best) == list(range(1, num_layers + 1))
    for m in range(1, num_layers + 1):
        anchors, score = best[m]
        assert len(anchors) == m and anchors[0] == 0 and list(anchors) == sorted(set(anchors))
        assert score == pytest.approx(objective(S, anchors), rel=1e-5, abs=1e-5)
        _, brute = brute_force(S, m)
        assert score == pytest.approx(brute, rel=1e-5, abs=1e-5), (m, anchors)


def test_dp_known_blocks():
    """Two blocks of identical layers: 2 anchors must be at the block starts."""
    S = np.full((6, 6), 0.2, np.float32)
    S[:3, :3] = 1.0
    S[3:, 3:] = 1.0
    S = np.triu(S)
    anchors, score = select_anchors(S)[2]
    assert anchors == (0, 3) and score == pytest.approx(6.0)
    assert select_anchors(S)[6][0] == tuple(range(6))


def test_dp_jitted_and_fast_at_80_layers(rng):
    S = np.triu(rng.random((80, 80))).astype(np.float32)
    np.fill_diagonal(S, S.max(0))  # like real scores (self-similarity 1): more anchors never hurt
    masks, scores = dp_all_budgets(S)
    masks.block_until_ready()  # compile
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        masks, scores = dp_all_budgets(S)
        masks.block_until_ready()
        times.append(time.perf_counter() - t0)
    assert min(times) < 0.1, times
    masks = np.asarray(masks)
    assert masks.sum(1).tolist() == list(range(1, 81)) and masks[:, 0].all()
    for m in (5, 40):  # spot-check against the objective, and monotone in the budget
        anchors = tuple(np.flatnonzero(masks[m - 1]))
        assert float(scores[m - 1]) == pytest.approx(objective(S, anchors), rel=1e-5)
    assert np.all(np.diff(np.asarray(scores)) >= -1e-4)


def test_dp_errors():
    with pytest.raises(ValueError, match="square"):
        select_anchors(np.zeros((3, 4)))
    with pytest.raises(ValueError, match="finite"):
        select_anchors(np.full((3, 3), np.nan))
    with pytest.raises(ValueError, match="num_anchors"):
        brute_force(np.zeros((3, 3)), 4)
    with pytest.raises(ValueError, match="layer 0"):
        objective(np.zeros((3, 3)), (1, 2))
