"""results/accuracy/tail_probe.py's attention variants on random inputs: the tail estimate is exact when every block
holds one key (a block of one unselected key is that key), a budget of every key is dense, and the probed rows are
the only ones that change."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import AttentionInputs

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "results" / "accuracy"))
tail_probe = pytest.importorskip("tail_probe")


def _inputs(t=200, valid=190, hq=4, kvh=2, d=16, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (1, t, hq, d), jnp.float32)
    k = jax.random.normal(kk, (1, t, kvh, d), jnp.float32) * 2.0  # peaked scores: a Top-k loses real mass
    v = jax.random.normal(kv, (1, t, kvh, d), jnp.float32)
    n = jnp.asarray([valid], jnp.int32)
    return AttentionInputs(q=q, k_cache=k, v_cache=v, q_start=jnp.zeros(1, jnp.int32), kv_len=n, seq_len=n,
                           phase="prefill")


def _attend(inputs, **kw):
    return np.asarray(tail_probe.TailProbe(**kw).attend(0, inputs, None)[0])


def test_tail_with_one_key_blocks_is_dense_and_the_plain_topk_is_not():
    x = _inputs()
    dense = _attend(x, rows=6, variant="dense")
    topk = _attend(x, rows=6, variant="topk", frac=0.1, min_k=8)
    tail1 = _attend(x, rows=6, variant="topk+tail", frac=0.1, min_k=8, block=1)
    tail16 = _attend(x, rows=6, variant="topk+tail", frac=0.1, min_k=8, block=16)
    rows = slice(190 - 6, 190)
    np.testing.assert_allclose(tail1[0, rows], dense[0, rows], atol=2e-5)
    np.testing.assert_allclose(_attend(x, rows=6, variant="topk+tailm", frac=0.1, min_k=8, block=1)[0, rows],
                               dense[0, rows], atol=2e-5)
    err = lambda a: float(np.abs(a[0, rows] - dense[0, rows]).max())  # noqa: E731
    assert err(topk) > 1e-2 and err(tail16) > 1e-4  # the Top-k loses mass; 16-key means only estimate it
    for a in (topk, tail1, tail16):  # rows before the probed ones stay dense
        np.testing.assert_array_equal(a[0, : 190 - 6], dense[0, : 190 - 6])


def test_a_budget_of_every_key_is_dense_with_or_without_the_tail():
    x = _inputs(seed=1)
    dense = _attend(x, rows=4, variant="dense")
    for var in ("topk", "topk+tail", "topk+tailb", "topk+tailm"):
        np.testing.assert_allclose(_attend(x, rows=4, variant=var, frac=1.0, min_k=8), dense, atol=2e-5)
    # tailb: blocks holding a selected key carry no tail term. One-key blocks: exact; one block of every key (it
    # holds the selection): the plain Top-k
    np.testing.assert_allclose(_attend(x, rows=4, variant="topk+tailb", frac=0.1, min_k=8, block=1), dense,
                               atol=2e-5)
    np.testing.assert_allclose(_attend(x, rows=4, variant="topk+tailb", frac=0.1, min_k=8, block=256),
                               _attend(x, rows=4, variant="topk", frac=0.1, min_k=8), atol=2e-5)


def test_tail_is_exact_when_each_block_repeats_one_key():
    """Blocks of 16 copies of one key and value (a word repeated, as in fwe): the unselected copies' count-weighted
    mean is exact at any block size, while the Top-k alone drops their mass."""
    x = _inputs(t=192, valid=192, seed=2)
    rep = lambda a: jnp.repeat(a[:, ::16], 16, axis=1)  # noqa: E731
    x = AttentionInputs(q=x.q, k_cache=rep(x.k_cache), v_cache=rep(x.v_cache), q_start=x.q_start, kv_len=x.kv_len,
                        seq_len=x.seq_len, phase="prefill")
    rows = slice(192 - 4, 192)
    dense = _attend(x, rows=4, variant="dense")[0, rows]
    topk = _attend(x, rows=4, variant="topk", frac=0.1, min_k=8)[0, rows]
    for var in ("topk+tail", "topk+tailm"):  # the unselected copies' mean, or all the block's keys' mean
        np.testing.assert_allclose(_attend(x, rows=4, variant=var, frac=0.1, min_k=8, block=16)[0, rows], dense,
                                   atol=2e-5)
    assert float(np.abs(topk - dense).max()) > 1e-2


def test_sampled_tail_is_dense_at_stride_one_and_exact_when_the_stride_repeats_one_key():
    """topk+samp adds every stride-th unselected key weighted by the stride: at stride 1 that is every key (dense);
    when each run of `stride` keys repeats one key and value, the sample stands exactly for its run (the last row,
    which sees whole runs), while the same keys unweighted (topk+stride) and the Top-k alone are off."""
    x = _inputs(seed=3)
    dense = _attend(x, rows=4, variant="dense")
    for var in ("topk+samp", "topk+stride"):
        np.testing.assert_allclose(_attend(x, rows=4, variant=var, frac=0.1, min_k=8, stride=1), dense, atol=2e-5)
    x = _inputs(t=192, valid=192, seed=4)
    rep = lambda a: jnp.repeat(a[:, ::16], 16, axis=1)  # noqa: E731
    x = AttentionInputs(q=x.q, k_cache=rep(x.k_cache), v_cache=rep(x.v_cache), q_start=x.q_start, kv_len=x.kv_len,
                        seq_len=x.seq_len, phase="prefill")
    last = slice(191, 192)
    dense = _attend(x, rows=1, variant="dense")[0, last]
    samp = _attend(x, rows=1, variant="topk+samp", frac=0.1, min_k=8, stride=16)[0, last]
    np.testing.assert_allclose(samp, dense, atol=2e-5)
    for var in ("topk", "topk+stride"):
        assert float(np.abs(_attend(x, rows=1, variant=var, frac=0.1, min_k=8, stride=16)[0, last] - dense).max()) > 1e-2


def test_budget_multiples_and_variant_names():
    x = _inputs(seed=5)
    np.testing.assert_allclose(_attend(x, rows=4, variant="top1.5k", frac=0.1, min_k=8),
                               _attend(x, rows=4, variant="topk", frac=0.15, min_k=8), atol=1e-6)
    assert tail_probe.check_variant("top2.5k") == "top2.5k"
    with pytest.raises(ValueError, match="unknown variant 'topx'"):
        tail_probe.check_variant("topx")


def test_variants_flag_is_checked_before_the_model_loads(tmp_path, capsys):
    for bad, msg in (("topk,dense", "must start with dense"), ("dense,topq", "unknown variant 'topq'"),
                     ("dense", "at least one more")):
        with pytest.raises(SystemExit, match=msg):
            tail_probe.main([f"--variants={bad}", f"--out={tmp_path}"])


def test_topp_takes_the_fewest_keys_holding_the_mass_and_reports_its_budget():
    """toppP: per row and KV head the smallest Top-count whose pooled mass reaches P (at least min_k), so P close
    to 1 is dense and a P below the Top-k's own mass needs fewer keys than it; the budget is recorded."""
    x = _inputs(seed=6)
    dense = _attend(x, rows=4, variant="dense")
    tail_probe._BUDGETS.clear()
    np.testing.assert_allclose(_attend(x, rows=4, variant="topp0.999999", frac=0.1, min_k=1), dense, atol=1e-4)
    jax.effects_barrier()
    assert tail_probe._BUDGETS and max(tail_probe._BUDGETS) > 0.5
    tail_probe._BUDGETS.clear()
    low = _attend(x, rows=4, variant="topp0.3", frac=0.1, min_k=1)
    jax.effects_barrier()
    assert 0 < max(tail_probe._BUDGETS) < 0.3 and float(np.abs(low - dense).max()) > 1e-2
    # min_k binds: a tiny P with min_k = every key is dense again
    np.testing.assert_allclose(_attend(x, rows=4, variant="topp0.01", frac=0.1, min_k=400), dense, atol=2e-5)
    assert tail_probe.fixed_budget("top1.5k", 0.1, 20) == pytest.approx(0.15)
    assert tail_probe.fixed_budget("topk+samp", 0.1, 20) == pytest.approx(0.15)
    assert tail_probe.fixed_budget("topp0.9", 0.1, 20) is None and tail_probe.check_variant("topp0.95") == "topp0.95"
    with pytest.raises(ValueError, match="unknown variant 'topp1.5'"):
        tail_probe.check_variant("topp1.5")
