"""Paged decode kernels (kernels_pallas/paged.py) against the contiguous references.

CPU tier: interpret mode at tiny shapes, ragged kv_len, page sizes 16 and 64, pages scattered at random over a pool
with spare (dirty) pages, bf16 and fp32, peaky inputs so that the Top-k matters. The references are the contiguous
ones on the same K/V laid out contiguously (not the gather path of paged.py), so the page mapping is what is tested.
Outputs: every (sequence, head) row's RMS error within a few times the measured noise of the output's RMS (bf16
1e-2, measured <= 4.6e-3; fp32 1e-5, measured <= 9.4e-7), fixed seeds; dense and reuse decode on Gaussian inputs
(no dominant keys), where a 3% softmax-scale error or one dropped index shows (checked by planting each).
Dirty rows: the default `DecodeTuning.paged_mask="none"` reads unattended rows as they are (the cache keeps them
finite, models/paged.py); "v" / "kv" mask them, so inf/NaN there must not leak.
GPU tier (`-m gpu`): 32 q heads, 8 kv heads, d 128, 32K, batch 8, page sizes 16 and 64.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from kernels_pallas import decode as dec
from kernels_pallas import paged
from kernels_pallas import reference
from tests.jitted import jitted
from tests.kernels_pallas.errors import row_err_global as _row_err

ref = jitted(reference)  # the references under jit: fewer, larger compiles (tests/jitted.py)

SEED = 0


def _paged_inputs(seed, b, s, hq, kvh, d, ps, dtype, spare=3, peaky=True):
    """Contiguous q, k, v [batch, s, ...] plus the same K/V scattered over pages of a shuffled pool."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, 1, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    qm = q.reshape(b, kvh, hq // kvh, d).mean(axis=2)
    if peaky:  # a few keys aligned with the group's mean query (they take most of the attention)
        for bi in range(b):
            for h in range(kvh):
                k[bi, rng.integers(0, s, 5), h] = 3.0 * qm[bi, h]
    kv_len = rng.integers(s // 3, s + 1, size=b).astype(np.int32)
    kv_len[0] = s
    max_pages = s // ps
    n = b * max_pages + spare
    perm = rng.permutation(n)
    kp = rng.standard_normal((n, ps, kvh, d)).astype(np.float32)  # dirty pool: unused pages hold noise
    vp = rng.standard_normal((n, ps, kvh, d)).astype(np.float32)
    table = np.full((b, max_pages), -1, np.int32)
    for bi in range(b):
        used = -(-int(kv_len[bi]) // ps)
        for j in range(used):
            page = perm[bi * max_pages + j]
            table[bi, j] = page
            kp[page] = k[bi, j * ps:(j + 1) * ps]
            vp[page] = v[bi, j * ps:(j + 1) * ps]
        k[bi, kv_len[bi]:] = 0.0  # contiguous padding differs from the pool's noise: it must never be read
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(kp), cast(vp), jnp.asarray(table), jnp.asarray(kv_len)


CASES = [(16, jnp.bfloat16, 1e-2), (64, jnp.float32, 1e-5)]


@pytest.mark.parametrize("ps,dtype,tol", CASES)
@pytest.mark.parametrize("block", [128, 16])  # 128: blocks over several pages (gather); 16: within a page
def test_dense_decode_interpret(ps, dtype, tol, block):
    q, k, v, kp, vp, table, kv_len = _paged_inputs(SEED, 3, 128, 4, 2, 64, ps, dtype, peaky=False)
    out = paged.dense_decode(q, kp, vp, table, kv_len, interpret=True,
                             tuning=dec.DecodeTuning(stream_block=block))
    want = ref.attention_reference(q, k, v, kv_len - 1, kv_len)
    assert out.shape == want.shape and out.dtype == q.dtype
    assert _row_err(out, want) < tol


@pytest.mark.parametrize("ps,dtype,tol", CASES)
def test_reuse_decode_interpret(ps, dtype, tol):
    q, k, v, kp, vp, table, kv_len = _paged_inputs(SEED + 1, 3, 128, 6, 2, 64, ps, dtype, peaky=False)
    rng = np.random.default_rng(SEED + 1)
    k_max = 40
    idx = np.full((3, 2, k_max), -1, np.int32)
    counts = np.zeros(3, np.int32)
    for bi in range(3):
        c = min(int(rng.integers(5, k_max + 1)), int(kv_len[bi]))
        counts[bi] = c
        for h in range(2):
            idx[bi, h, :c] = rng.choice(int(kv_len[bi]), c, replace=False)
    hm = jnp.asarray([1, 0], jnp.int32)
    out = paged.reuse_decode(q, kp, vp, table, kv_len, jnp.asarray(idx), jnp.asarray(counts), hm, interpret=True)
    want = ref.sparse_decode_reference(q, k, v, kv_len, jnp.asarray(idx), hm)
    assert _row_err(out, want) < tol


@pytest.mark.parametrize("ps,dtype,tol,dense_out", [c + (i == 1,) for i, c in enumerate(CASES)])
def test_anchor_decode_interpret(ps, dtype, tol, dense_out):
    q, k, v, kp, vp, table, kv_len = _paged_inputs(SEED + 2, 2, 128, 4, 2, 64, ps, dtype)
    kw = dict(topk_frac=0.2, min_k=8, k_max=ref.max_budget(128, 0.2, 8), dense_out=dense_out)
    out, idx, counts = paged.anchor_decode(q, kp, vp, table, kv_len, interpret=True, **kw)
    want, ref_idx, ref_counts = dec.anchor_decode(q, k, v, kv_len, impl="reference", **kw)
    np.testing.assert_array_equal(counts, ref_counts)
    scores = np.asarray(ref.pooled_scores_decode_reference(q, k, kv_len))
    idx, ref_idx = np.asarray(idx), np.asarray(ref_idx)
    for bi in range(idx.shape[0]):
        for h in range(idx.shape[1]):
            c = int(counts[bi])
            assert np.all(idx[bi, h, c:] == -1)
            mine, theirs = set(idx[bi, h, :c].tolist()), set(ref_idx[bi, h, :c].tolist())
            if mine != theirs:  # only near-ties may differ (bf16 / fused fp32 pooling)
                sc = scores[bi, h]
                gap = sc[sorted(theirs - mine)].max() - sc[sorted(mine - theirs)].min()
                assert gap <= 1e-3 * abs(sc[sorted(theirs)].min()), (bi, h, mine ^ theirs)
    assert _row_err(out, want) < tol


def test_non_power_of_two_length_interpret():
    """s = 80 over pages of 16 (5 pages): a 64-key block spans 4 pages and the last one is re-read at a clamped
    offset (block 128 caps to 64); dense decode and anchor decode (logits + reuse) against the references."""
    q, k, v, kp, vp, table, kv_len = _paged_inputs(SEED + 4, 3, 80, 4, 2, 64, 16, jnp.float32)
    tuning = dec.DecodeTuning(stream_block=128)
    out = paged.dense_decode(q, kp, vp, table, kv_len, interpret=True, tuning=tuning)
    assert _row_err(out, ref.attention_reference(q, k, v, kv_len - 1, kv_len)) < 1e-5
    kw = dict(topk_frac=0.25, min_k=8, k_max=ref.max_budget(80, 0.25, 8))
    out, _, counts = paged.anchor_decode(q, kp, vp, table, kv_len, interpret=True, tuning=tuning, **kw)
    want, _, ref_counts = dec.anchor_decode(q, k, v, kv_len, impl="reference", **kw)
    np.testing.assert_array_equal(counts, ref_counts)
    assert _row_err(out, want) < 1e-5


def test_anchor_decode_short_select_interpret():
    """The short-row select (`DecodeTuning.short_select_max`) through the page table: the index sets and output of
    the four-launch select (80 keys in a 128-key block, pool all, forced keys)."""
    q, k, v, kp, vp, table, kv_len = _paged_inputs(SEED + 5, 3, 80, 4, 2, 64, 16, jnp.float32)
    kw = dict(topk_frac=0.25, min_k=8, k_max=ref.max_budget(80, 0.25, 8), pool="all", sinks=1, window=2,
              interpret=True)
    out, idx, counts = paged.anchor_decode(q, kp, vp, table, kv_len, tuning=dec.DecodeTuning(short_select_max=128),
                                           **kw)
    out4, idx4, counts4 = paged.anchor_decode(q, kp, vp, table, kv_len, **kw)
    np.testing.assert_array_equal(counts, counts4)
    for a, b in zip(np.asarray(idx)[:, 0], np.asarray(idx4)[:, 0]):
        assert set(a[a >= 0].tolist()) == set(b[b >= 0].tolist())
    assert _row_err(out, out4) < 1e-5


@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("impl,mask", [("interpret", "kv"), ("interpret", "v"), ("reference", "kv")])
def test_stale_inf_nan_in_dirty_pages_never_leak(poison, impl, mask):
    """Masked loads on dirty pages: a previous owner's inf/NaN past kv_len (in the last page of each sequence, and
    in every unused page, page 0 included) must not reach the output."""
    rng = np.random.default_rng(SEED + 5)
    b, s, kvh, d, ps = 3, 128, 2, 64, 16
    q = rng.standard_normal((b, 1, 4, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    kv_len = jnp.asarray([128, 37, 70], jnp.int32)  # the last two end inside a page
    n = b * (s // ps) + 3
    perm = rng.permutation(n)
    kp = np.full((n, ps, kvh, d), poison, np.float32)  # every row not written below is poison
    vp = np.full((n, ps, kvh, d), poison, np.float32)
    tb = np.full((b, s // ps), -1, np.int32)
    used = set()
    for bi in range(b):
        m = int(kv_len[bi])
        for j in range(-(-m // ps)):
            page = tb[bi, j] = perm[bi * (s // ps) + j]
            used.add(int(page))
            rows = min(ps, m - j * ps)  # the last page: only the rows below kv_len are real
            kp[page, :rows], vp[page, :rows] = k[bi, j * ps:j * ps + rows], v[bi, j * ps:j * ps + rows]
        k[bi, m:], v[bi, m:] = 0.0, 0.0
    if 0 not in used:  # make sure a clamped -1 lands on poison
        assert not np.isfinite(kp[0]).any()
    kw = dict(impl="pallas", interpret=True) if impl == "interpret" else dict(impl="reference")
    args = (jnp.asarray(q), jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tb), kv_len)
    for block in (16, 64):  # within a page (one load) and over four pages (gathered rows)
        out = paged.dense_decode(*args, tuning=dec.DecodeTuning(stream_block=block, paged_mask=mask), **kw)
        assert _row_err(out, ref.attention_reference(q, k, v, kv_len - 1, kv_len)) < 1e-5
    akw = dict(topk_frac=0.25, min_k=8, k_max=ref.max_budget(128, 0.25, 8))
    out, _, _ = paged.anchor_decode(*args, **akw, **kw, tuning=dec.DecodeTuning(paged_mask=mask))
    want, _, _ = dec.anchor_decode(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), kv_len, impl="reference", **akw)
    assert _row_err(out, want) < 1e-5


@pytest.mark.parametrize("poison", [np.nan, np.inf])
@pytest.mark.parametrize("mask", ["kv", "v"])
def test_reuse_decode_masked_slots_on_poison(poison, mask):
    """Reuse decode reads its masked slots (past counts, ids >= kv_len) at position 0: for a sequence with kv_len 0
    and no page (-1, clamped to page 0) that row is a previous owner's inf/NaN, and V must read as 0 there (p = 0,
    but 0 x inf = NaN). The other sequence's real rows sit on two pages of the same poisoned pool."""
    rng = np.random.default_rng(SEED + 6)
    ps, kvh, d = 16, 2, 64
    kp, vp = np.full((9, ps, kvh, d), poison, np.float32), np.full((9, ps, kvh, d), poison, np.float32)
    k, v = np.zeros((2, 64, kvh, d), np.float32), np.zeros((2, 64, kvh, d), np.float32)
    k[0, :20], v[0, :20] = rng.standard_normal((2, 20, kvh, d))
    tb = np.full((2, 4), -1, np.int32)
    tb[0, :2] = [3, 5]
    for j, page in enumerate((3, 5)):
        rows = slice(j * ps, min((j + 1) * ps, 20))
        kp[page, :rows.stop - rows.start], vp[page, :rows.stop - rows.start] = k[0, rows], v[0, rows]
    q = jnp.asarray(rng.standard_normal((2, 1, 4, d)), jnp.float32)
    kv_len, counts, hm = jnp.asarray([20, 0], jnp.int32), jnp.asarray([5, 5], jnp.int32), jnp.asarray([1, 0])
    idx = np.full((2, kvh, 8), -1, np.int32)
    idx[0, :, :5] = [[0, 3, 17, 19, 25], [19, 1, 16, 2, 40]]  # 25 and 40 are past kv_len: masked
    idx = jnp.asarray(idx)
    out = paged.reuse_decode(q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(tb), kv_len, idx, counts, hm,
                             interpret=True, tuning=dec.DecodeTuning(paged_mask=mask))
    want = ref.sparse_decode_reference(q, jnp.asarray(k), jnp.asarray(v), kv_len, idx, hm)
    assert _row_err(out, want) < 1e-5  # the empty sequence's output is zeros, as the reference's


def _clean_and_poisoned(rng, poison=(np.nan, np.inf)):
    """Sequence 0 owns page 0 and holds poison in all its rows; sequences 1 and 2 own clean pages (their rows, zeros
    past kv_len, as a page zeroed when handed out); every other page of the pool is poison (NaN and inf in turn)."""
    b, s, kvh, d, ps = 3, 128, 2, 64, 16
    q = rng.standard_normal((b, 1, 4, d)).astype(np.float32)
    k = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, s, kvh, d)).astype(np.float32)
    kv_len = np.array([20, 37, 70], np.int32)  # the clean two end inside a page, -1 entries after it
    n = 2 + 3 + 5 + 4
    kp = np.resize(np.asarray(poison, np.float32), n)[:, None, None, None] * np.ones((ps, kvh, d), np.float32)
    vp = kp.copy()
    tb = np.full((b, s // ps), -1, np.int32)
    tb[0, :2] = [0, 9]
    tb[1, :3] = [7, 2, 11]
    tb[2, :5] = [4, 13, 1, 5, 8]
    for bi in (1, 2):
        m = int(kv_len[bi])
        k[bi, m:], v[bi, m:] = 0.0, 0.0
        for j in range(-(-m // ps)):
            kp[tb[bi, j]], vp[tb[bi, j]] = k[bi, j * ps:(j + 1) * ps], v[bi, j * ps:(j + 1) * ps]
    to = jnp.asarray
    return to(q), to(k), to(v), to(kp), to(vp), to(tb), to(kv_len)


def test_unmasked_reads_only_the_sequences_own_pages():
    """paged_mask="none" (no masked loads): a -1 entry reads the sequence's own first page, so inf/NaN in another
    sequence's pages (page 0 included) and in free pages never reaches a sequence whose own pages are finite (the
    invariant models/paged.py keeps). Dense decode (blocks within a page and over four pages: the kernel the anchor
    layers share) and reuse decode (its masked slots)."""
    rng = np.random.default_rng(SEED + 7)
    q, k, v, kp, vp, tb, kv_len = _clean_and_poisoned(rng)
    args, kw = (q, kp, vp, tb, kv_len), dict(impl="pallas", interpret=True)
    clean = slice(1, 3)
    for block in (16, 64):
        out = paged.dense_decode(*args, tuning=dec.DecodeTuning(stream_block=block), **kw)
        assert _row_err(out[clean], ref.attention_reference(q, k, v, kv_len - 1, kv_len)[clean]) < 1e-5
    idx = np.full((3, 2, 16), -1, np.int32)  # 10 slots counted, -1 past them
    for bi in range(3):
        for h in range(2):
            idx[bi, h, :8] = rng.choice(int(kv_len[bi]), 8, replace=False)
    idx[:, :, 8:10] = [100, 120]  # ids past kv_len (on -1 entries): masked
    counts, hm = jnp.full((3,), 10, jnp.int32), jnp.asarray([1, 0])
    out = paged.reuse_decode(*args, jnp.asarray(idx), counts, hm, **kw)
    want = ref.sparse_decode_reference(q, k, v, kv_len, jnp.asarray(idx), hm)
    assert _row_err(out[clean], want[clean]) < 1e-5


def test_unmasked_needs_finite_rows_past_kv_len():
    """Documents the contract of paged_mask="none": a NaN in the sequence's own last page past kv_len reaches its
    output (0 x NaN in P.V), which is why the engine zeroes every page it hands out (models/paged.py zero_pages)
    and "v" / "kv" exist for dirty pages."""
    q, k, v, kp, vp, tb, kv_len = _clean_and_poisoned(np.random.default_rng(SEED + 7), poison=(0.0,))
    vp = vp.at[tb[1, 2], int(kv_len[1]) % 16:].set(jnp.nan)  # sequence 1's last page, past kv_len
    args, kw = (q, kp, vp, tb, kv_len), dict(impl="pallas", interpret=True, tuning=dec.DecodeTuning(stream_block=16))
    assert np.isnan(np.asarray(paged.dense_decode(*args, **kw)[1])).all()
    masked = paged.dense_decode(*args, **kw | dict(tuning=dec.DecodeTuning(stream_block=16, paged_mask="v")))
    assert _row_err(masked[1:], ref.attention_reference(q, k, v, kv_len - 1, kv_len)[1:]) < 1e-5


def test_paged_mask_setting_is_checked():
    with pytest.raises(ValueError, match="paged_mask must be one of none, v, kv, got 'k'"):
        dec.DecodeTuning(paged_mask="k")


def test_gather_pages_and_errors():
    q, k, v, kp, vp, table, kv_len = _paged_inputs(SEED + 3, 2, 64, 4, 2, 64, 16, jnp.float32)
    view = np.asarray(paged.gather_pages(kp, table))
    for bi in range(2):
        n = int(kv_len[bi])
        np.testing.assert_array_equal(view[bi, :n], np.asarray(k)[bi, :n])
    with pytest.raises(ValueError, match="page_table must be"):
        paged.dense_decode(q, kp, vp, table[:1], kv_len)
    with pytest.raises(ValueError, match="head_dim must agree"):
        paged.dense_decode(q[..., :32], kp, vp, table, kv_len)
    with pytest.raises(ValueError, match="Pallas paged decode supports head_dim"):
        paged.dense_decode(q[..., :32], kp[..., :32], vp[..., :32], table, kv_len, interpret=True)
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        paged.dense_decode(q, kp[:, :12], vp[:, :12], table, kv_len)


@pytest.mark.gpu
@pytest.mark.parametrize("ps,mask", [(16, "none"), (64, "none"), (64, "v"), (64, "kv")])
def test_paged_kernels_gpu(ps, mask):
    """Realistic shapes on the GPU: 32/8 heads, d 128, 32K, batch 8, bf16, Triton lowering (no interpret); inputs
    made on the device (peaky keys planted), pages a random permutation of the pool, ragged kv_len."""
    import jax

    tuning = dec.DecodeTuning(paged_mask=mask)
    s, b, hq, kvh, d = 32768, 8, 32, 8, 128
    kq, kk, kv, kp_, kt = jax.random.split(jax.random.PRNGKey(SEED), 5)
    q = jax.random.normal(kq, (b, 1, hq, d), jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, kvh, d), jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, kvh, d), jnp.bfloat16)
    qm = q.astype(jnp.float32).reshape(b, kvh, hq // kvh, d).mean(axis=2)
    pos = jax.random.randint(kp_, (b, kvh, 16), 0, s)
    k = k.at[jnp.arange(b)[:, None, None], pos, jnp.arange(kvh)[None, :, None]].set(
        jnp.broadcast_to(3.0 * qm[:, :, None, :], (b, kvh, 16, d)).astype(jnp.bfloat16))
    mp = s // ps
    n = b * mp + 5
    table = jax.random.permutation(kt, n).astype(jnp.int32)[:b * mp].reshape(b, mp)
    to_pool = lambda x: jnp.zeros((n, ps, kvh, d), x.dtype).at[table.reshape(-1)].set(  # noqa: E731
        x.reshape(b * mp, ps, kvh, d))
    kp, vp = to_pool(k), to_pool(v)
    kv_len = jnp.asarray(np.random.default_rng(SEED).integers(s // 2, s + 1, b), jnp.int32)
    out = paged.dense_decode(q, kp, vp, table, kv_len, impl="pallas", tuning=tuning)
    assert _row_err(out, ref.attention_reference(q, k, v, kv_len - 1, kv_len)) < 1e-2
    kw = dict(topk_frac=0.1, min_k=128, k_max=ref.max_budget(s, 0.1, 128))
    for dense_out in (False, True):
        o, idx, counts = paged.anchor_decode(q, kp, vp, table, kv_len, impl="pallas", dense_out=dense_out,
                                             tuning=tuning, **kw)
        o_c, idx_c, counts_c = dec.anchor_decode(q, k, v, kv_len, impl="pallas", dense_out=dense_out, **kw)
        np.testing.assert_array_equal(counts, counts_c)
        a, c = np.asarray(idx).reshape(-1, idx.shape[-1]), np.asarray(idx_c).reshape(-1, idx.shape[-1])
        same = np.mean([set(x[x >= 0].tolist()) == set(y[y >= 0].tolist()) for x, y in zip(a, c)])
        assert same >= 0.99
        assert _row_err(o, o_c) < 1e-2
    hm = jnp.arange(kvh, dtype=jnp.int32)[::-1]
    o = paged.reuse_decode(q, kp, vp, table, kv_len, idx, counts, hm, impl="pallas", tuning=tuning)
    assert _row_err(o, dec.reuse_decode(q, k, v, kv_len, idx, counts, hm, impl="pallas")) < 1e-2


def test_triton_modules_verify_for_sm90(triton_sm90_modules):
    """Lower the paged kernels for CUDA on the CPU and verify the Triton modules (catches GPU-only lowering errors,
    e.g. the page-table gather, without a GPU)."""
    import jax

    verified = triton_sm90_modules
    b, kvh, g, d, ps, mp, n = 2, 2, 4, 128, 16, 40, 100
    q = jax.ShapeDtypeStruct((b, 1, kvh * g, d), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((n, ps, kvh, d), jnp.bfloat16)
    pt = jax.ShapeDtypeStruct((b, mp), jnp.int32)
    kv = jax.ShapeDtypeStruct((b,), jnp.int32)
    idx = jax.ShapeDtypeStruct((b, kvh, 100), jnp.int32)
    lower = lambda fn, *a: jax.jit(fn).trace(*a).lower(lowering_platforms=("cuda",))  # noqa: E731
    for mask in dec.PAGED_MASKS:  # none (the default), v, kv: the same kernels, K / V loads masked or not
        tu, tu16 = dec.DecodeTuning(paged_mask=mask), dec.DecodeTuning(stream_block=16, paged_mask=mask)
        lower(lambda q, k, v, t, l: paged.dense_decode(q, k, v, t, l, impl="pallas", tuning=tu), q, pool, pool, pt, kv)
        lower(lambda q, k, v, t, l: paged.dense_decode(q, k, v, t, l, impl="pallas", tuning=tu16),
              q, pool, pool, pt, kv)
        lower(lambda q, k, v, t, l, i, c: paged.reuse_decode(q, k, v, t, l, i, c, jnp.arange(kvh), impl="pallas",
                                                             tuning=tu), q, pool, pool, pt, kv, idx, kv)
        lower(lambda q, k, v, t, l: paged.anchor_decode(q, k, v, t, l, topk_frac=0.1, min_k=16, k_max=64,
                                                        impl="pallas", tuning=tu), q, pool, pool, pt, kv)
        # the anchor on an fp8 K copy's pages (decode_score_fp8): the stream pass widens fp8 rows (to bf16 here)
        pool8, mult = jax.ShapeDtypeStruct(pool.shape, jnp.float8_e4m3fn), jax.ShapeDtypeStruct((b,), jnp.float32)
        tuw = dec.DecodeTuning(paged_mask=mask, stream_fp8_f16=False)
        lower(lambda q, k, v, t, l, k8, m: paged.anchor_decode(q, k, v, t, l, topk_frac=0.1, min_k=16, k_max=64,
                                                               impl="pallas", tuning=tuw, score_keys=(k8, m)),
              q, pool, pool, pt, kv, pool8, mult)
        tu8 = dec.DecodeTuning(paged_mask=mask, stream_fp8_f16=True)  # ... widened to float16 (the default)
        lower(lambda q, k, v, t, l, k8, m: paged.anchor_decode(q, k, v, t, l, topk_frac=0.1, min_k=16, k_max=64,
                                                               impl="pallas", tuning=tu8, score_keys=(k8, m)),
              q, pool, pool, pt, kv, pool8, mult)
    # per setting: dense (gather, in-page); reuse; anchor = stream + the short select (the default at 640 keys; the
    # four-launch select does not read the cache: test_decode lowers it) + reuse; the same anchor on fp8 K pages,
    # widened to bf16 and to float16
    assert len(verified) == 3 * (2 + 1 + 3 + 3 + 3)


def _check_fp8_pages(ps, s, hq, d, interpret, tuning=dec.DEFAULT_TUNING):
    """The fp8 K copy through the page table (the same table as K): the contiguous copy's selection and output,
    and the reference path the same; a mult of the pool's length (not the batch's) is refused."""
    q, k, v, kp, vp, table, kv_len = _paged_inputs(SEED + 5, 2, s, hq, 2, d, ps, jnp.bfloat16)
    k8, _, mult = ref.fp8_decode_keys(k, kv_len)
    k8p = np.zeros(kp.shape, np.float32)  # unused pages: zeros (an fp8 pool is zeroed when handed out)
    tab = np.asarray(table)
    for bi in range(tab.shape[0]):
        for j in range(tab.shape[1]):
            if tab[bi, j] >= 0:
                k8p[tab[bi, j]] = np.asarray(k8[bi, j * ps:(j + 1) * ps].astype(jnp.float32))
    k8p = jnp.asarray(k8p, jnp.float8_e4m3fn)
    kw = dict(topk_frac=0.2, min_k=8, k_max=ref.max_budget(s, 0.2, 8))
    want, want_idx, _ = dec.anchor_decode(q, k, v, kv_len, impl="reference", score_keys=(k8, mult), **kw)
    for impl in ("pallas", "reference"):
        out, idx, counts = paged.anchor_decode(q, kp, vp, table, kv_len, interpret=interpret and impl == "pallas",
                                               impl=impl, score_keys=(k8p, mult), tuning=tuning, **kw)
        scores = np.asarray(ref.pooled_scores_decode_reference(ref.fp8_decode_q(q, mult), k8.astype(k.dtype),
                                                               kv_len))
        for bi in range(2):
            for h in range(2):
                c = int(counts[bi])
                mine, theirs = set(np.asarray(idx[bi, h, :c]).tolist()), set(np.asarray(want_idx[bi, h, :c]).tolist())
                if mine != theirs:  # only near-ties may differ (fused fp32 pooling on a GPU)
                    sc = scores[bi, h]
                    gap = sc[sorted(theirs - mine)].max() - sc[sorted(mine - theirs)].min()
                    assert gap <= 1e-3 * abs(sc[sorted(theirs)].min()), (bi, h, mine ^ theirs)
        assert _row_err(out, want) < 1e-2
    with pytest.raises(ValueError, match=r"mult must have shape \[batch\]=\(2,\)"):
        paged.anchor_decode(q, kp, vp, table, kv_len, impl="reference", score_keys=(k8p, jnp.ones(kp.shape[0])),
                            **kw)


@pytest.mark.parametrize("ps", [16, 64])
@pytest.mark.parametrize("f16", [False, True])
def test_anchor_decode_fp8_score_keys_interpret(ps, f16):
    _check_fp8_pages(ps, 128, 4, 64, interpret=True, tuning=dec.DecodeTuning(stream_fp8_f16=f16))


@pytest.mark.gpu
@pytest.mark.parametrize("mask", dec.PAGED_MASKS)
@pytest.mark.parametrize("f16", [False, True])
def test_anchor_decode_fp8_score_keys_gpu(mask, f16):
    _check_fp8_pages(64, 8192, 32, 128, interpret=False, tuning=dec.DecodeTuning(paged_mask=mask,
                                                                                  stream_fp8_f16=f16))

