"""Pallas prefill kernels (interpret mode on CPU; `-m gpu` at 8K on the H200) against the pure-JAX references."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from kernels_pallas import prefill as P
from kernels_pallas import reference
from tests.jitted import jitted
from tests.kernels_pallas.errors import row_err_relative as _row_err

R = jitted(reference)  # the references under jit: fewer, larger compiles (tests/jitted.py)

SEED = 20251  # fixed: whether a planted error is detected must not depend on the draw


@pytest.fixture(autouse=True)
def _fp32_reference_matmuls():
    """On a GPU, fp32 matmuls default to TF32 (~5e-4 relative): the references here must run in full fp32 (the
    kernels' bf16/fp16 dots accumulate in fp32 either way)."""
    with jax.default_matmul_precision("float32"):
        yield


def _inputs(rng, b, t, hq, kvh, d, max_len, dtype, peaky=False):
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, max_len, kvh, d)).astype(np.float32)
    v = rng.standard_normal((b, max_len, kvh, d)).astype(np.float32)
    if peaky:  # a few keys every query loves, and sharper logits overall
        hot = rng.choice(max_len, size=max(2, max_len // 50), replace=False)
        k[:, hot] += 2.0 * q.mean(axis=(1, 2))[:, None, None, :] / (np.abs(q.mean(axis=(1, 2))).mean() + 1e-6)
        q *= 2.5
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype))


# Bounds on _row_err: a few times the largest error measured at this file's fixed seeds in interpret mode (bf16
# 4.3e-3, fp16 ~5e-4, fp32 ~5e-6; a 3% error in the softmax scale of a kernel gives 5e-2 to 8e-2).
_OUT_TOL = {"bfloat16": 1.5e-2, "float16": 2e-3, "float32": 5e-5}


def _tol(dtype):
    return _OUT_TOL[jnp.dtype(dtype).name]


def _check_idx(idx, counts, scores, rtol=2e-4):
    """idx is a top-`counts` set of the reference scores up to (near-)ties: distinct, eligible, same sorted values."""
    idx, counts, scores = np.asarray(idx), np.asarray(counts), np.asarray(scores, np.float64)
    b, h, nt, kmax = idx.shape
    ranks = np.arange(kmax)
    cnt = np.broadcast_to(counts[:, None, :, None], idx.shape)
    assert np.all(idx[ranks >= cnt] == -1), "ranks past the count must be -1"
    valid = ranks < cnt
    assert np.all(idx[valid] >= 0)
    picked = np.take_along_axis(scores, np.maximum(idx, 0), axis=-1)
    assert np.all(np.isfinite(picked[valid])), "selected an ineligible key"
    srt = np.sort(np.where(valid, idx, -1 - ranks), axis=-1)
    assert np.all((np.diff(srt, axis=-1) != 0)), "duplicate indices"
    mine = -np.sort(-np.where(valid, picked, -np.inf), axis=-1)
    best = -np.sort(-scores, axis=-1)[..., :kmax]
    best = np.where(valid, best, -np.inf)
    fin = np.isfinite(best)
    np.testing.assert_allclose(mine[fin], best[fin], rtol=rtol, atol=1e-6)
    return float(np.mean([set(np.asarray(x)[:c]) == set(np.asarray(y)[:c]) for x, y, c in zip(
        idx.reshape(-1, kmax), R.select_topk_reference(jnp.asarray(scores, jnp.float32), jnp.asarray(cnt[..., 0]), kmax)
        .reshape(-1, kmax), cnt[..., 0].reshape(-1))]))


def _case(seed, b, t, hq, kvh, d, tile, dtype, peaky, frac, min_k, q_start, kv_len, max_len, dense_out, interpret,
          **extra):
    rng = np.random.default_rng(seed)
    q, k, v = _inputs(rng, b, t, hq, kvh, d, max_len, dtype, peaky)
    q_start = jnp.asarray(q_start, jnp.int32)
    kv_len = jnp.asarray(kv_len, jnp.int32)
    k_max = R.max_budget(max_len, frac, min_k)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, dense_out=dense_out, **extra)
    out, idx, counts = P.anchor_prefill(q, k, v, q_start, kv_len, kv_len, tile, impl="pallas", interpret=interpret, **kw)
    rc = R.prefill_counts(q_start, kv_len, kv_len, t, tile, frac, min_k)
    np.testing.assert_array_equal(np.asarray(counts), np.asarray(rc))
    scores, _ = R.pooled_scores_prefill_reference(q, k, q_start, kv_len, tile)
    exact = _check_idx(idx, counts, scores)
    # Output: against the reference on the kernel's own indices (a near-tie swap would otherwise move it).
    if dense_out:
        ref_out = R.attention_reference(q, k, v, q_start, kv_len)
    else:
        ref_out = R.sparse_prefill_reference(q, k, v, q_start, kv_len, idx, jnp.arange(kvh), tile)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    err = _row_err(out, ref_out)
    print(f"{jnp.dtype(dtype).name} dense_out={dense_out}: exact-set fraction {exact:.4f}, per-row error {err:.2e}")
    assert err < _tol(dtype), err
    return q, k, v, q_start, kv_len, idx, counts, exact


# ------------------------------------------------------------------------------------------ CI tier (interpret)

CI_CASES = [  # (tile, group, q_len, dtype, peaky, dense_out)
    (16, 3, 100, jnp.bfloat16, False, False),
    (32, 4, 150, jnp.float16, True, False),
    (64, 4, 200, jnp.bfloat16, False, True),
]


@pytest.mark.parametrize("tile,group,t,dtype,peaky,dense_out", CI_CASES)
def test_anchor_and_reuse_interpret(tile, group, t, dtype, peaky, dense_out):
    kvh, d, b = 2, 64, 2
    seed = SEED + tile + group
    q_start = [0, tile]  # the second sequence's chunk starts one tile in
    max_len = t + tile + 7
    kv_len = [t - 5, t + tile - 11]  # ragged: padding queries at the end of both sequences
    q, k, v, qs, kl, idx, counts, exact = _case(seed, b, t, kvh * group, kvh, d, tile, dtype, peaky, 0.25, 8, q_start,
                                                kv_len, max_len, dense_out, True)
    assert exact > 0.9


def _random_indices(rng, qs, kl, kvh, nt, tile, kmax):
    """Random distinct keys strictly before each tile (random counts <= kmax), -1 past the counts."""
    b = len(qs)
    idx = np.full((b, kvh, nt, kmax), -1, np.int32)
    counts = np.zeros((b, nt), np.int32)
    for bi in range(b):
        for ti in range(nt):
            elig = max(0, min(int(qs[bi]) + ti * tile, int(kl[bi])))
            c = min(elig, int(rng.integers(0, kmax + 1)))
            counts[bi, ti] = c
            for h in range(kvh):
                idx[bi, h, ti, :c] = rng.choice(elig, size=c, replace=False) if c else []
    return jnp.asarray(idx), jnp.asarray(counts)


def test_reuse_random_indices_interpret():
    """Reuse on arbitrary (not top-k) index sets, batch 2, ragged, tile 32, group 3, with -1 gaps past the counts."""
    rng = np.random.default_rng(SEED + 1)
    b, t, kvh, g, d, tile = 2, 90, 2, 3, 64, 32
    max_len = 140
    q, k, v = _inputs(rng, b, t, kvh * g, kvh, d, max_len, jnp.bfloat16)
    qs = jnp.asarray([32, 0], jnp.int32)
    kl = jnp.asarray([122, 80], jnp.int32)
    idx, counts = _random_indices(rng, [32, 0], [122, 80], kvh, -(-t // tile), tile, 40)
    hm = jnp.asarray([1, 1], jnp.int32)  # a non-identity head map
    out = P.reuse_prefill(q, k, v, qs, kl, idx, counts, hm, tile, impl="pallas", interpret=True)
    ref_out = R.sparse_prefill_reference(q, k, v, qs, kl, idx, hm, tile)
    assert _row_err(out, ref_out) < _tol(jnp.bfloat16)


REUSE_VARIANTS = [  # (tile, group, tuning overrides): every launch order / row split / index prefetch
    (16, 4, "reuse_order=head_major,reuse_rows=32,reuse_block_k=16"),  # 2 sub-groups per tile, many blocks
    (32, 4, "reuse_order=head_major,reuse_rows=64,reuse_prefetch=true,reuse_block_k=32"),
    (64, 2, "reuse_order=tile_major,reuse_rows=64,reuse_prefetch=true,reuse_block_k=16"),  # rows cap < tile x group
    (32, 3, "reuse_order=head_major,reuse_rows=16,reuse_block_k=64"),  # cap below the tile: one tile per program
]


@pytest.mark.parametrize("tile,group,spec", REUSE_VARIANTS)
def test_reuse_tuning_variants_interpret(tile, group, spec):
    """The reuse tuning options change launch order / work split only: output equals the reference."""
    rng = np.random.default_rng(SEED + 11 + tile + group)
    tuning = P.tuning_from_string(spec)
    b, kvh, d = 2, 2, 64
    t = 2 * tile + 9  # a partial last tile
    max_len = t + tile + 5
    qs, kl = [tile, 0], [t + tile - 3, t - 6]  # chunk at an offset; ragged with padding queries
    q, k, v = _inputs(rng, b, t, kvh * group, kvh, d, max_len, jnp.float32)
    idx, counts = _random_indices(rng, qs, kl, kvh, -(-t // tile), tile, 3 * tile // 2)
    hm = jnp.asarray([1, 0], jnp.int32)
    qs, kl = jnp.asarray(qs, jnp.int32), jnp.asarray(kl, jnp.int32)
    out = P.reuse_prefill(q, k, v, qs, kl, idx, counts, hm, tile, impl="pallas", interpret=True, tuning=tuning)
    assert _row_err(out, R.sparse_prefill_reference(q, k, v, qs, kl, idx, hm, tile)) < _tol(jnp.float32)


def test_anchor_reuse_rows_and_cudnn_flag_interpret():
    """Anchor pipeline with a reuse row split different from the anchor layout (q repacked), and anchor layer 0 with
    anchor0_cudnn + chunk_at_zero: off a GPU that flag must fall back to the Triton/interpret dense pass."""
    tuning = P.tuning_from_string("reuse_order=head_major,reuse_rows=32,anchor0_cudnn=true")
    t = 80
    for dense_out in (False, True):
        _, _, _, _, _, idx, _, exact = _case(SEED + 21, 1, t, 8, 2, 64, 16, jnp.bfloat16, False, 0.25, 8, [0],
                                             [t - 3], t, dense_out, True, tuning=tuning, chunk_at_zero=True)
        assert exact > 0.9


def test_anchor0_external_lse_path_interpret(monkeypatch):
    """The anchor0_cudnn glue (slice, stats transpose, pack_lse, scores, select) end to end on CPU, with a stand-in for
    the cuDNN call that follows its interface: stats [batch, q_heads, q_len] fp32, natural log."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    calls = []

    def fake_cudnn(q, k, v, bias, mask, q_seqlen, kv_seqlen, *, scale, mask_type, return_residual):
        assert bias is None and mask is None and return_residual and mask_type == fa.MaskType.PADDING_CAUSAL
        assert k.shape[1] == q.shape[1] and np.all(np.asarray(q_seqlen) == q.shape[1])
        calls.append(1)
        out, lse = R.attention_reference(q, k, v, jnp.zeros_like(kv_seqlen), kv_seqlen, scale=scale, return_lse=True)
        return out, jnp.transpose(lse, (0, 2, 1))

    monkeypatch.setattr(fa, "dot_product_attention", fake_cudnn)
    monkeypatch.setattr(P, "cudnn_lse_ok", lambda *a: True)
    t = 75
    _, _, _, _, _, idx, _, exact = _case(SEED + 22, 2, t, 8, 2, 64, 16, jnp.bfloat16, True, 0.25, 8, [0, 0],
                                         [t - 2, t - 20], t + 9, True, True,
                                         tuning=P.PrefillTuning(anchor0_cudnn=True), chunk_at_zero=True)
    assert calls and exact > 0.9


def test_pack_lse_matches_dense_pass_interpret():
    """pack_lse (the cuDNN LSE adapter) on the reference natural-log LSE == the kernels' own base-2 packed LSE."""
    rng = np.random.default_rng(SEED + 31)
    b, t, kvh, g, d, tile = 2, 70, 2, 4, 64, 16
    q, k, v = _inputs(rng, b, t, kvh * g, kvh, d, t, jnp.float32)
    qs, kl = jnp.zeros((b,), jnp.int32), jnp.asarray([t, t - 9], jnp.int32)
    lay = P._layout(q, k, tile)
    lse2, _ = P._dense_pass(P._pack_q(q, lay), k, v, qs, kl, lay, 1 / np.sqrt(d), with_out=False,
                            tuning=P.DEFAULT_TUNING, interpret=True)
    _, lse_ref = R.attention_reference(q, k, v, qs, kl, return_lse=True)  # [b, t, q_heads], natural log
    mine = np.asarray(P.pack_lse(lse_ref, lay))
    real = np.isfinite(mine)
    assert real.sum() == b * t * kvh * g  # exactly the real rows are finite
    np.testing.assert_allclose(mine[real], np.asarray(lse2)[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,kvh,d,dtype", [(14, 2, 64, jnp.bfloat16), (12, 2, 128, jnp.float16),
                                            (8, 8, 64, jnp.float32)])
def test_dense_prefill_at_an_offset_interpret(hq, kvh, d, dtype):
    """dense_prefill (the flash pass with its output) equals causal dense attention for a chunk after the first,
    ragged lengths included; padding rows are finite."""
    rng = np.random.default_rng(SEED + 11)
    b, t, max_len = 2, 96, 320
    q, k, v = _inputs(rng, b, t, hq, kvh, d, max_len, dtype, peaky=True)
    qs, kl = jnp.asarray([128, 192], jnp.int32), jnp.asarray([224, 250], jnp.int32)
    out = P.dense_prefill(q, k, v, qs, kl, impl="pallas", interpret=True)
    want = R.attention_reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), qs, kl)
    for bi in range(b):
        n = int(kl[bi] - qs[bi])  # valid rows of this sequence's chunk
        assert _row_err(out[bi, :n], want[bi, :n]) < _tol(dtype)
        assert np.all(np.isfinite(np.asarray(out[bi, n:], np.float32)))
    assert _row_err(P.dense_prefill(q, k, v, qs, kl, impl="reference")[0], want[0]) < _tol(dtype)  # 96 valid rows


def test_dense_prefill_triton_lowering_verifies_for_sm90(triton_sm90_modules):
    q = jax.ShapeDtypeStruct((2, 4096, 14, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 16384, 2, 64), jnp.bfloat16)
    i32 = jax.ShapeDtypeStruct((2,), jnp.int32)
    jax.jit(lambda q, k, v, qs, kl: P.dense_prefill(q, k, v, qs, kl, impl="pallas")).trace(
        q, k, k, i32, i32).lower(lowering_platforms=("cuda",))
    assert len(triton_sm90_modules) == 1


def test_tuning_errors():
    for spec, match in (("reuse_order=diagonal", "reuse_order"), ("reuse_rows=48", "reuse_rows"),
                        ("reuse_block_k=100", "reuse_block_k"), ("reuse_stages=0", "reuse_stages"),
                        ("select_nb=3", "select_nb"), ("reuse_warps=3", "warps"), ("nope=1", "field=value"),
                        ("select_cand=100", "select_cand"), ("select_cand=8", "select_cand"),
                        ("reuse_rows=big", "integer"),
                        ("reuse_prefetch=maybe", "true/false"), ("reuse_rows", "field=value")):
        with pytest.raises(ValueError, match=match):
            P.tuning_from_string(spec)
    q = jnp.ones((1, 32, 4, 64), jnp.bfloat16)
    k = jnp.ones((1, 32, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="chunk_at_zero"):
        P.anchor_prefill(q, k, k, jnp.asarray([32], jnp.int32), jnp.asarray([64], jnp.int32), 64, 32, topk_frac=0.1,
                         min_k=4, k_max=8, dense_out=True, chunk_at_zero=True)


@pytest.mark.parametrize("spec", ["select_nb=8,select_block=32",
                                  "select_nb=4,select_block=32,select_cand=16,select_range=true"])
def test_select_exact_ties_interpret(spec):
    """Duplicated keys give exactly tied pooled scores: the select must still return exactly `count` distinct keys."""
    rng = np.random.default_rng(SEED + 2)
    b, t, kvh, g, d, tile = 1, 64, 1, 4, 64, 16
    q, k, v = _inputs(rng, b, t, kvh * g, kvh, d, t, jnp.float32)
    k = k.at[:, 8:40].set(k[:, 0:1])  # 32 identical keys (before the last tiles): massive exact ties
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    tuning = P.tuning_from_string(spec)  # non-default select paths: 8-way small blocks; 4-way with candidates
    out, idx, counts = P.anchor_prefill(q, k, v, qs, kl, kl, tile, topk_frac=0.2, min_k=4, k_max=16, impl="pallas",
                                        interpret=True, tuning=tuning)
    scores, _ = R.pooled_scores_prefill_reference(q, k, qs, kl, tile)
    _check_idx(idx, counts, scores, rtol=1e-5)


@pytest.mark.parametrize("spec,peaky", [("select_cand=16,select_block=16", False),
                                        ("select_cand=32,select_nb=2,select_block=64,select_range=true", True),
                                        ("select_range=true,select_block=32", False)])
def test_select_candidates_interpret(spec, peaky):
    """select_cand: full-row passes until the bracket holds <= cap keys, then passes over the compacted candidates.
    Batch 2 with a chunk at an offset and ragged lengths, so rows of every size (some below the cap from the start)."""
    t, tile = 150, 16
    *_, exact = _case(SEED + 51, 2, t, 4, 1, 64, tile, jnp.float32, peaky, 0.3, 4, [0, tile], [t - 4, t + 5],
                      t + tile + 8, True, True, tuning=P.tuning_from_string(spec))
    assert exact > 0.9


def _block_groups(row, n, kb):
    """The n selected blocks of one idx row (lanes j kb .. j kb + kb - 1 hold b kb + 0 .. kb - 1, -1 after)."""
    row = np.asarray(row)
    assert np.all(row[n * kb:] == -1), "lanes past the count must be -1"
    groups = row[: n * kb].reshape(n, kb)
    assert np.all(groups[:, 0] % kb == 0) and np.all(groups == groups[:, :1] + np.arange(kb)), groups
    return set((groups[:, 0] // kb).tolist())


@pytest.mark.parametrize("kb", [1, 8, 16])
def test_select_blocks_reference_matches_numpy(kb):
    """reference.select_blocks_reference against a brute-force block Top-k on random integer pooled scores (exact
    sums, exact ties in one row): ragged kv_len with tiles past it, a chunk at an offset that is not a multiple of kb,
    forced sink / window keys, min_k above the early tiles' prefixes. kb = 1 is the key select."""
    rng = np.random.default_rng(SEED + 61)
    b, h, tile, t, max_len, frac, min_k = 3, 2, 32, 160, 200, 0.25, 40
    qs, kl = jnp.asarray([0, 32, 12], jnp.int32), jnp.asarray([150, 101, 90], jnp.int32)
    tile_start, eligible = R.prefill_eligible(qs, kl, t, tile)
    k_max = R.max_budget(max_len, frac, min_k)
    counts = jnp.minimum(R.prefill_counts(qs, kl, kl, t, tile, frac, min_k), k_max)
    scores = rng.integers(0, 1000, (b, h, tile_start.shape[1], max_len)).astype(np.float32)
    scores[:, 1, 2] = 7.0  # equal scores: ties between blocks, lowest first
    forced = np.asarray(R.forced_prefill_mask(tile_start, eligible, max_len, 2, 5))[:, None]
    scores = np.where(forced, R.FORCED_SCORE, scores)
    scores = np.where(np.arange(max_len) < np.asarray(eligible)[:, None, :, None], scores, -np.inf)
    idx, cnt = R.select_blocks_reference(jnp.asarray(scores), counts, eligible, k_max, kb)
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    assert idx.shape == (b, h, tile_start.shape[1], -(-k_max // kb) * kb)
    partial = 0
    for bi, hi, ti in np.ndindex(idx.shape[:3]):
        e, c = int(eligible[bi, ti]), int(counts[bi, ti])
        sc = scores[bi, hi, ti]
        blocks = [sc[x * kb:(x + 1) * kb][np.isfinite(sc[x * kb:(x + 1) * kb])].sum() for x in range(-(-e // kb))]
        n = min(-(-c // kb), len(blocks))
        want = sorted(range(len(blocks)), key=lambda x: (-blocks[x], x))[:n]
        assert cnt[bi, ti] == n * kb
        assert _block_groups(idx[bi, hi, ti], n, kb) == set(want), (bi, hi, ti)
        partial += any((x + 1) * kb > e for x in want)
    assert partial > 0 or kb == 1  # a block with ineligible keys was selected somewhere
    if kb == 1:
        plain = R.select_topk_reference(jnp.asarray(scores), counts[:, None], k_max)
        np.testing.assert_array_equal(idx, np.asarray(plain))
        np.testing.assert_array_equal(cnt, np.asarray(counts))


@pytest.mark.parametrize("pool", ["gqa", "all"])
def test_anchor_key_blocks_interpret(pool):
    """key_block=16: the Pallas select on block scores picks the reference's blocks (the same sets per tile), with
    the same counts and output; ragged kv_len (a tile past it), a chunk at an offset that is no multiple of 16, and
    min_k above most prefixes, so the partial blocks at a tile start or at kv_len are selected."""
    rng = np.random.default_rng(SEED + 62)
    b, t, kvh, g, d, tile, kb = 2, 96, 2, 2, 64, 32, 16
    max_len = 40 + t + 8
    q, k, v = _inputs(rng, b, t, kvh * g, kvh, d, max_len, jnp.float32, peaky=True)
    qs, kl = jnp.asarray([0, 40], jnp.int32), jnp.asarray([60, 110], jnp.int32)
    kw = dict(topk_frac=0.5, min_k=60, k_max=R.max_budget(max_len, 0.5, 60), pool=pool, key_block=kb)
    def run(impl):  # (jitted: the eager reference alone takes seconds)
        return jax.jit(lambda *a: P.anchor_prefill(*a, tile, impl=impl, interpret=True, **kw))(q, k, v, qs, kl, kl)

    (o_r, i_r, c_r), (o_p, i_p, c_p) = run("reference"), run("pallas")
    np.testing.assert_array_equal(np.asarray(c_p), np.asarray(c_r))
    assert i_p.shape == i_r.shape and i_r.shape[-1] % kb == 0
    i_p, i_r, c_r = np.asarray(i_p), np.asarray(i_r), np.asarray(c_r)
    for bi, hi, ti in np.ndindex(i_r.shape[:3]):
        n = c_r[bi, ti] // kb
        assert _block_groups(i_p[bi, hi, ti], n, kb) == _block_groups(i_r[bi, hi, ti], n, kb), (bi, hi, ti)
    assert _row_err(o_p, o_r) < _tol(jnp.float32)


def test_block_rows_ignore_unwritten_keys():
    """_block_rows (the Pallas path's block sums) reads only each tile's eligible keys (the score kernels leave the
    rest unwritten: NaN here) and equals reference.block_scores on the eligible blocks, padded to whole select
    blocks; a window's padding tiles past the chunk have none."""
    rng = np.random.default_rng(SEED + 64)
    b, t, kvh, tile, kb, block_s, chunk = 2, 96, 2, 32, 16, 32, 2
    q, k, _ = _inputs(rng, b, t, 4, kvh, 64, 150, jnp.float32)
    lay = P._layout(q, k, tile)
    qs, kl = jnp.asarray([0, 40], jnp.int32), jnp.asarray([60, 130], jnp.int32)
    for c in range(2):  # tiles 0-1, then tile 2 and a padding tile
        t_ids = c * chunk + np.arange(chunk)
        e = np.minimum(np.asarray(qs)[:, None] + t_ids * tile, np.asarray(kl)[:, None])
        e = np.where(t_ids < lay.n_tiles, e, 0)  # [batch, chunk] eligible keys
        sc = rng.random((b, kvh, chunk, 150)).astype(np.float32)
        mine = np.asarray(P._block_rows(jnp.asarray(np.where(np.arange(150) < e[:, None, :, None], sc, np.nan)),
                                        jnp.asarray([c], jnp.int32), qs, kl, lay, chunk, kb, block_s))
        want = np.asarray(R.block_scores(jnp.asarray(np.where(np.arange(150) < e[:, None, :, None], sc, -np.inf)), kb))
        assert mine.shape[-1] == block_s and want.shape[-1] == 10
        fin = np.isfinite(want)
        assert np.array_equal(fin.sum(-1), np.broadcast_to(-(-e[:, None, :] // kb), fin.shape[:-1]))
        np.testing.assert_allclose(mine[..., :10][fin], want[fin], rtol=1e-6)


def test_key_blocks_triton_lowering_verifies_for_sm90(triton_sm90_modules):
    """The anchor pipeline with key_block=16 (the select on block rows) lowers for CUDA; its Triton modules verify."""
    q = jax.ShapeDtypeStruct((1, 2048, 14, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 2048, 2, 64), jnp.bfloat16)
    i32 = jax.ShapeDtypeStruct((1,), jnp.int32)
    f = lambda q, k, v, qs, kl: P.anchor_prefill(q, k, v, qs, kl, kl, 32, topk_frac=0.1, min_k=128, k_max=205,
                                                 impl="pallas", key_block=16)
    jax.jit(f).trace(q, k, k, i32, i32).lower(lowering_platforms=("cuda",))
    assert len(triton_sm90_modules) >= 3  # LSE pass, pooled scores, select (+ reuse)


def test_reuse_expanded_blocks_interpret():
    """reuse_prefill on expanded blocks of 16 (partial blocks at the tile start and past kv_len included) equals
    sparse_prefill_reference; a key_block that does not divide the tile or the idx width is refused."""
    rng = np.random.default_rng(SEED + 63)
    b, t, kvh, g, d, tile, kb = 2, 80, 2, 3, 64, 32, 16
    max_len = t + 24 + 8
    q, k, v = _inputs(rng, b, t, kvh * g, kvh, d, max_len, jnp.bfloat16)
    qs, kl = jnp.asarray([24, 0], jnp.int32), jnp.asarray([t + 24 - 3, 50], jnp.int32)
    n_tiles, n_blk = -(-t // tile), 4
    _, eligible = R.prefill_eligible(qs, kl, t, tile)
    blk = np.full((b, kvh, n_tiles, n_blk), -1, np.int32)
    counts = np.zeros((b, n_tiles), np.int32)
    for bi, ti in np.ndindex(b, n_tiles):
        nb = -(-int(eligible[bi, ti]) // kb)  # every block with an eligible key, the last one partial
        c = min(nb, int(rng.integers(1, n_blk + 1)))
        counts[bi, ti] = c * kb
        for h in range(kvh):
            blk[bi, h, ti, :c] = np.sort(rng.choice(nb, size=c, replace=False))[::-1] if c else []
    idx, counts = R.expand_blocks(jnp.asarray(blk), kb), jnp.asarray(counts)
    hm = jnp.asarray([1, 0], jnp.int32)
    out = jax.jit(lambda *a: P.reuse_prefill(*a, tile, impl="pallas", interpret=True, key_block=kb))(
        q, k, v, qs, kl, idx, counts, hm)
    want = jax.jit(lambda *a: R.sparse_prefill_reference(*a, tile))(q, k, v, qs, kl, idx, hm)
    assert _row_err(out, want) < _tol(jnp.bfloat16)
    with pytest.raises(ValueError, match="key_block"):
        P.reuse_prefill(q, k, v, qs, kl, idx[..., :-8], counts, hm, tile, key_block=kb)
    with pytest.raises(ValueError, match="key_block"):
        P.reuse_prefill(q, k, v, qs, kl, idx, counts, hm, tile, key_block=64)
    with pytest.raises(ValueError, match="key_block"):
        P.anchor_prefill(q, k, v, qs, kl, kl, tile, topk_frac=0.5, min_k=8, k_max=32, key_block=12)


def test_reference_impl_matches_pieces():
    rng = np.random.default_rng(SEED + 3)
    q, k, v = _inputs(rng, 1, 48, 4, 2, 64, 48, jnp.float32)
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), 48, jnp.int32)
    out, idx, counts = P.anchor_prefill(q, k, v, qs, kl, kl, 16, topk_frac=0.5, min_k=4, k_max=24, impl="reference")
    scores, _ = R.pooled_scores_prefill_reference(q, k, qs, kl, 16)
    _check_idx(idx, counts, scores)
    ref_out = R.sparse_prefill_reference(q, k, v, qs, kl, idx, jnp.arange(2), 16)
    assert _row_err(out, ref_out) < 1e-6


def test_auto_impl_on_cpu_is_the_reference():
    rng = np.random.default_rng(SEED + 4)
    q, k, v = _inputs(rng, 1, 32, 4, 2, 64, 40, jnp.float32)
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), 32, jnp.int32)
    idx = np.full((1, 2, 2, 8), -1, np.int32)  # tile 0 selects nothing, tile 1 selects 8 of its 16 prefix keys
    idx[0, :, 1] = rng.permutation(16)[:8]
    idx, cnt, hm = jnp.asarray(idx), jnp.asarray([[0, 8]], jnp.int32), jnp.asarray([1, 0], jnp.int32)
    out = P.reuse_prefill(q, k, v, qs, kl, idx, cnt, hm, 16)  # impl="auto" on CPU
    assert _row_err(out, R.sparse_prefill_reference(q, k, v, qs, kl, idx, hm, 16)) < 1e-6


def test_error_paths():
    q = jnp.ones((1, 32, 4, 64), jnp.bfloat16)
    k = jnp.ones((1, 32, 2, 64), jnp.bfloat16)
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), 32, jnp.int32)
    idx = jnp.zeros((1, 2, 1, 8), jnp.int32)
    cnt = jnp.zeros((1, 1), jnp.int32)
    hm = jnp.arange(2, dtype=jnp.int32)
    kw = dict(topk_frac=0.1, min_k=4, k_max=8)
    with pytest.raises(ValueError, match="tile_size"):
        P.reuse_prefill(q, k, k, qs, kl, idx, cnt, hm, 48)
    with pytest.raises(ValueError, match="head_dim"):
        P.anchor_prefill(q[..., :32], k[..., :32], k[..., :32], qs, kl, kl, 32, impl="pallas", **kw)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        P.anchor_prefill(q[:, :, :3], k, k, qs, kl, kl, 32, **kw)
    with pytest.raises(ValueError, match="dtype"):
        P.anchor_prefill(q.astype(jnp.int8), k.astype(jnp.int8), k.astype(jnp.int8), qs, kl, kl, 32, impl="pallas", **kw)
    with pytest.raises(ValueError, match="cache dtype"):
        P.anchor_prefill(q, k.astype(jnp.float16), k.astype(jnp.float16), qs, kl, kl, 32, impl="pallas", **kw)
    with pytest.raises(ValueError, match="idx must be"):
        P.reuse_prefill(q, k, k, qs, kl, idx[:, :, :0], cnt, hm, 32)
    with pytest.raises(ValueError, match="counts must be"):
        P.reuse_prefill(q, k, k, qs, kl, idx, cnt[:, :0], hm, 32)
    with pytest.raises(ValueError, match="head_map_row"):
        P.reuse_prefill(q, k, k, qs, kl, idx, cnt, hm[:1], 32)
    with pytest.raises(ValueError, match="pre_softmax"):
        P.anchor_prefill(q, k, k, qs, kl, kl, 32, pool="pre_softmax", impl="pallas", **kw)
    with pytest.raises(ValueError, match="pool"):
        P.anchor_prefill(q, k, k, qs, kl, kl, 32, pool="mean", **kw)
    with pytest.raises(ValueError, match="impl"):
        P.reuse_prefill(q, k, k, qs, kl, idx, cnt, hm, 32, impl="cuda")
    with pytest.raises(ValueError, match="topk_frac"):
        P.anchor_prefill(q, k, k, qs, kl, kl, 32, topk_frac=1.5, min_k=4, k_max=8)
    with pytest.raises(ValueError, match="k_max"):
        P.anchor_prefill(q, k, k, qs, kl, kl, 32, topk_frac=0.1, min_k=4, k_max=0)
    with pytest.raises(ValueError, match="q_start"):
        P.reuse_prefill(q, k, k, qs[:0], kl, idx, cnt, hm, 32)


# ------------------------------------------------------------------------------------------ GPU tier (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("dense_out", [False, True])
def test_gpu_8k(peaky, dense_out):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    t = 8192
    q, k, v, qs, kl, idx, counts, exact = _case(SEED, 1, t, 32, 8, 128, 32, jnp.bfloat16, peaky, 0.1, 128, [0], [t], t,
                                                dense_out, False)
    print(f"8K peaky={peaky} dense_out={dense_out}: exact-set fraction {exact:.4f}")
    assert exact > 0.9
    hm = jnp.asarray([3, 3, 0, 1, 2, 7, 6, 5], jnp.int32)
    out = P.reuse_prefill(q, k, v, qs, kl, idx, counts, hm, 32, impl="pallas")
    assert _row_err(out, R.sparse_prefill_reference(q, k, v, qs, kl, idx, hm, 32)) < _tol(jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_ragged_batch_fp16_d64():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    _, _, _, _, _, _, _, exact = _case(SEED + 5, 2, 1000, 12, 4, 64, 16, jnp.float16, True, 0.2, 32, [0, 512],
                                       [990, 1400], 1600, False, False)
    assert exact > 0.9


@pytest.mark.gpu
def test_gpu_cudnn_lse_convention():
    """cuDNN's softmax statistics, as returned by cudnn_attention_lse, are the natural-log LSE of the scaled logits
    (models/README.md); the other conventions are printed so a failure says which one cuDNN uses."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    rng = np.random.default_rng(SEED + 41)
    b, t, kvh, g, d = 2, 2048, 8, 4, 128
    q, k, v = _inputs(rng, b, t, kvh * g, kvh, d, t + 64, jnp.bfloat16)
    qs, kl = jnp.zeros((b,), jnp.int32), jnp.asarray([t, t - 300], jnp.int32)  # ragged: padding queries in seq 1
    scale = 1 / np.sqrt(d)
    assert P.cudnn_lse_ok(q, k)
    out, lse = jax.jit(lambda q, k, v, kl: P.cudnn_attention_lse(q, k, v, kl, scale))(q, k, v, kl)
    ref_out, ref_lse = R.attention_reference(q, k, v, qs, kl, return_lse=True)
    lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
    real = (np.arange(t)[None, :] < np.asarray(kl)[:, None])[:, :, None] & np.ones_like(lse, bool)
    for name, conv in (("natural", lse), ("log2", lse / P._LOG2E), ("unscaled", lse * scale)):
        print(f"cuDNN lse read as {name}: max |diff| real rows {np.max(np.abs(conv - ref_lse)[real]):.3e}, "
              f"padding rows {np.max(np.abs(conv - ref_lse)[~real]) if (~real).any() else 0:.3e}")
    np.testing.assert_allclose(lse[real], ref_lse[real], atol=5e-3, rtol=0)
    np.testing.assert_allclose(lse[~real], ref_lse[~real], atol=5e-3, rtol=0)  # padding queries see all valid keys
    assert _row_err(out, ref_out) < _tol(jnp.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
def test_gpu_anchor0_cudnn_8k(peaky):
    """Anchor layer 0 through cuDNN (output + LSE): same index sets as the reference, dense output within bf16."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    t = 8192
    tuning = P.PrefillTuning(anchor0_cudnn=True)
    *_, exact = _case(SEED + 7, 1, t, 32, 8, 128, 32, jnp.bfloat16, peaky, 0.1, 128, [0], [t], t, True, False,
                      tuning=tuning, chunk_at_zero=True)
    print(f"anchor0 cuDNN 8K peaky={peaky}: exact-set fraction {exact:.4f}")
    assert exact > 0.9


@pytest.mark.gpu
def test_gpu_anchor0_cudnn_ragged_fp16():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    tuning = P.PrefillTuning(anchor0_cudnn=True)
    *_, exact = _case(SEED + 8, 2, 1000, 12, 4, 64, 16, jnp.float16, True, 0.2, 32, [0, 0], [990, 700], 1100, True,
                      False, tuning=tuning, chunk_at_zero=True)
    assert exact > 0.9


GPU_SPECS = [  # every option of the benchmark sweeps, compiled for the GPU (orthogonal kernels share a spec)
    "reuse_order=head_major,reuse_prefetch=true,reuse_block_k=64,select_cand=2048,select_range=true,lse_block_k=128,"
    "lse_stages=2",
    "reuse_order=head_major,reuse_prefetch=true,reuse_block_k=32,reuse_rows=64,reuse_stages=4,select_cand=4096,"
    "select_nb=8,lse_block_k=128,lse_stages=3",
    "select_range=true",
    "reuse_prefetch=true,reuse_block_k=64,reuse_rows=64",
    "reuse_order=head_major,reuse_block_k=32,reuse_stages=5",
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", GPU_SPECS)
def test_gpu_tuning_variants_8k(spec):
    """Every tuning option the benchmark sweeps, compiled for the GPU: anchor indices and outputs as the reference."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    t = 8192
    tuning = P.tuning_from_string(spec)
    peaky = "select_nb=8" in spec
    q, k, v, qs, kl, idx, counts, exact = _case(SEED + 9, 1, t, 32, 8, 128, 32, jnp.bfloat16, peaky, 0.1, 128, [0],
                                                [t], t, False, False, tuning=tuning)
    print(f"{spec} (peaky={peaky}): exact-set fraction {exact:.4f}")
    assert exact > 0.9
    hm = jnp.asarray([3, 3, 0, 1, 2, 7, 6, 5], jnp.int32)
    out = P.reuse_prefill(q, k, v, qs, kl, idx, counts, hm, 32, impl="pallas", tuning=tuning)
    assert _row_err(out, R.sparse_prefill_reference(q, k, v, qs, kl, idx, hm, 32)) < _tol(jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_dense_attention_chunk_at_an_offset():
    """kernels_pallas.dense.dense_attention sends a prefill chunk at an offset to dense_prefill on the GPU."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    from kernels_pallas.dense import dense_attention

    rng = np.random.default_rng(SEED + 12)
    q, k, v = _inputs(rng, 4, 4096, 14, 2, 64, 16384, jnp.bfloat16, peaky=True)
    qs, kl = jnp.full((4,), 8192, jnp.int32), jnp.asarray([12288, 12000, 11000, 12288], jnp.int32)
    out = jax.jit(lambda *a: dense_attention(*a, phase="prefill", chunk_at_zero=False))(q, k, v, qs, kl)
    want = R.attention_reference(q[:1], k[:1], v[:1], qs[:1], kl[:1])
    assert _row_err(out[:1], want) < _tol(jnp.bfloat16)
