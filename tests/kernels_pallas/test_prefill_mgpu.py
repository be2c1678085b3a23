"""Mosaic GPU anchor-prefill passes (`kernels_pallas.prefill_mgpu`): Mosaic GPU interpret mode on CPU at tiny shapes,
`-m gpu` at 4K on the H200, both against the pure-JAX references."""

from __future__ import annotations

import dataclasses
import pathlib
import types

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from kernels_pallas import prefill as P
from kernels_pallas import prefill_mgpu as M
from kernels_pallas import reference
from tests.jitted import jitted
from tests.kernels_pallas.errors import row_err_relative as _row_err
from tests.kernels_pallas.test_prefill import _inputs, _tol

R = jitted(reference)  # the references under jit: fewer, larger compiles (tests/jitted.py)

SEED = 20260  # fixed: whether a planted error is detected must not depend on the draw
_LSE_TOL = 1e-4  # base-2 units; interpret mode measures ~1e-6 (fp32 exp2/log2 on identical bf16/fp16 inputs)
_OUT_TOL = {"bfloat16": 1.5e-2, "float16": 2e-3}  # as test_prefill: a few times the rounding of the output dtype
_SCORE_TOL = 1e-4  # pooled scores, per (tile, head) row relative to its RMS; interpret mode measures ~1e-6


@pytest.fixture(autouse=True)
def _fp32_reference_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture
def interp():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    gpu_callbacks.reset_gpu_interpret_mode_state()  # a kernel that raised leaves the interpreter's state behind
    yield plgpu.InterpretGPUParams()
    gpu_callbacks.reset_gpu_interpret_mode_state()


def _ref_lse2(q, k, v):
    """Reference (out, base-2 lse [1, q_heads, T]) of causal attention from position 0."""
    t = q.shape[1]
    z = jnp.zeros((q.shape[0],), jnp.int32)
    out, lse = R.attention_reference(q, k, v, z, z + t, return_lse=True)
    return out, jnp.transpose(lse, (0, 2, 1)) * M._LOG2E


def _score_err(sc, ref):
    """-inf exactly where the reference has it, and the largest per-(tile, head) RMS error over the finite keys,
    relative to that row's RMS (rows with no eligible key: tile 0)."""
    a, r = np.asarray(sc, np.float64), np.asarray(ref, np.float64)
    assert a.shape == r.shape
    fin = np.isfinite(r)
    assert np.array_equal(np.isneginf(a), ~fin), "-inf must mark exactly the keys at or after the tile start"
    a, r = np.where(fin, a, 0.0), np.where(fin, r, 0.0)
    d2, r2 = ((a - r) ** 2).sum(-1), (r ** 2).sum(-1)
    n = fin.sum(-1)
    rows = n > 0
    return float(np.sqrt(d2[rows] / n[rows]).max() / np.sqrt(r2[rows] / n[rows]).min())


def _check_flash(q, k, v, with_out, tuning=None, interpret=False):
    out, lse = M.flash_lse(q, k, v, with_out=with_out, tuning=tuning, interpret=interpret)
    ro, rl = _ref_lse2(q, k, k if v is None else v)
    lse_err = float(np.abs(np.asarray(lse) - np.asarray(rl)).max())
    out_err = _row_err(out, ro) if with_out else 0.0
    return lse, lse_err, out_err


# ------------------------------------------------------------------------------------------ interpret mode (CPU)


def test_flash_dense_bf16_d64_group2_races(interp):
    """64-key steps: the second query block takes 4 steps through the 2-deep K/V ring; race detector on."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as mi

    q, k, v = _inputs(np.random.default_rng(SEED), 1, 256, 4, 2, 64, 256, jnp.bfloat16)
    _, lse_err, out_err = _check_flash(q, k, v, True, tuning=M.MgpuTuning(block_kv=64),
                                       interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not mi.get_races().races_found
    assert lse_err < _LSE_TOL and out_err < _OUT_TOL["bfloat16"], (lse_err, out_err)


def test_flash_lse_only_takes_256_key_steps(interp):
    """The LSE-only pass steps 256 keys at a time (`lse_block_kv`) where q_len is a multiple of 256 (512: two steps
    through the 2-deep ring for the last query block), and 128 where it is not (384, here without fma_softmax)."""
    for t, tuning, tol in ((512, None, _LSE_TOL), (384, M.MgpuTuning(fma_softmax=False), _LSE_TOL)):
        q, k, v = _inputs(np.random.default_rng(SEED + t), 1, t, 4, 2, 128, t, jnp.bfloat16, peaky=True)
        _, lse_err, _ = _check_flash(q, k, v, False, tuning=tuning, interpret=interp)
        assert lse_err < tol, (t, tuning, lse_err)


def test_flash_lse_only_128_rows_a_warpgroup(interp, monkeypatch):
    """`MgpuTuning.lse_block_q=128` (the LSE-only pass with 128 query rows a warpgroup, two m64 products, 128-key
    steps): 512 tokens are two programs, the last warpgroup's four steps through the 2-deep ring, its last step on
    the diagonal; 384 tokens (no multiple of 256) keep 64 rows. Peaky logits, against the reference."""
    grids, kernel = [], plgpu.kernel
    monkeypatch.setattr(plgpu, "kernel", lambda *a, **kw: grids.append(kw["grid"]) or kernel(*a, **kw))
    for t in (512, 384):
        q, k, v = _inputs(np.random.default_rng(SEED + t + 1), 1, t, 4, 2, 128, t, jnp.bfloat16, peaky=True)
        _, lse_err, _ = _check_flash(q, k, v, False, tuning=M.MgpuTuning(lse_block_q=128), interpret=interp)
        assert lse_err < _LSE_TOL, (t, lse_err)
    assert grids == [(4, 2, 1), (4, 3, 1)]  # 256 query rows a program at 512 tokens, 128 at 384
    with pytest.raises(ValueError, match="lse_block_q must be 64 or 128, got 96"):
        M.MgpuTuning(lse_block_q=96)


@pytest.mark.parametrize("fma", [True, False])
def test_flash_fma_softmax(interp, fma):
    """`MgpuTuning.fma_softmax` (the default: the row max of the raw logits, p as one FMA a logit) and without it
    (every logit scaled before the max): the dense pass at 64-key steps (two causal steps a query block), on peaky
    logits, against the reference (the LSE-only pass: above)."""
    q, k, v = _inputs(np.random.default_rng(SEED + 7), 1, 256, 4, 2, 64, 256, jnp.bfloat16, peaky=True)
    _, lse_err, out_err = _check_flash(q, k, v, True, tuning=M.MgpuTuning(block_kv=64, fma_softmax=fma),
                                       interpret=interp)
    assert lse_err < _LSE_TOL and out_err < _OUT_TOL["bfloat16"], (lse_err, out_err)


def test_exp2_poly_matches_exp2():
    """`_exp2_poly` (FA4's software exp2) against float64 exp2 from 2**-126 to 2**(1/2): relative error under 1e-4
    (the fit's 7.5e-5), finite everywhere, -inf and anything below -126 at ~2**-126."""
    x = jnp.concatenate([jnp.linspace(-126.0, 0.5, 100001), jnp.array([-jnp.inf, -1e30, -127.5, -0.5, 0.0])])
    a = np.asarray(jax.jit(M._exp2_poly)(x.astype(jnp.float32)), np.float64)
    b = np.exp2(np.asarray(x, np.float64))
    normal = b >= 2.0 ** -125
    assert np.all(np.isfinite(a)) and np.abs(a[normal] / b[normal] - 1).max() < 1e-4
    assert np.all(a[~normal] < 3e-38)


@pytest.mark.parametrize("tile,hq,kvh,d,dtype", [(32, 14, 2, 64, jnp.bfloat16), (16, 4, 2, 128, jnp.float16)])
def test_pooled_scores(interp, tile, hq, kvh, d, dtype):
    """Group 7 at tile 32 packs one head per product (7 products per tile); group 2 at tile 16 packs both (N = 32),
    with half of each product's exp2 as the polynomial (`scores_poly_exp2_cols`; its 7.5e-5 relative error)."""
    q, k, _ = _inputs(np.random.default_rng(SEED + tile), 1, 128, hq, kvh, d, 128, dtype, peaky=(tile == 16))
    _, lse = _ref_lse2(q, k, k)
    poly = tile == 16
    sc = M.pooled_scores(q, k, lse.astype(jnp.float32), tile, interpret=interp,
                         tuning=M.MgpuTuning(scores_poly_exp2_cols=16) if poly else None)
    z = jnp.zeros((1,), jnp.int32)
    ref, _ = R.pooled_scores_prefill_reference(q, k, z, z + 128, tile)
    err = _score_err(sc, ref)
    assert err < (3e-4 if poly else _SCORE_TOL), err


def test_two_pass_chain_races_and_triton_lse_layout():
    """LSE-only flash pass (no V ring) of a 3-head fp16 d128 group -> pooled scores (3 products per tile, the K ring
    wraps: up to 3 steps of 128 keys) under the race detector; `lse_for_triton` gives the packed rows the Triton
    pipeline reads."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, interpret_pallas_call as mi

    t = 384
    q, k, v = _inputs(np.random.default_rng(SEED + 1), 1, t, 3, 1, 128, t, jnp.float16, peaky=True)
    gpu_callbacks.reset_gpu_interpret_mode_state()
    _, lse = M.flash_lse(q, k, with_out=False, interpret=plgpu.InterpretGPUParams())
    _, rl2 = _ref_lse2(q, k, v)
    lse_err = float(np.abs(np.asarray(lse) - np.asarray(rl2)).max())
    assert lse_err < _LSE_TOL, lse_err
    sc = M.pooled_scores(q, k, lse, 64, interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not mi.get_races().races_found
    gpu_callbacks.reset_gpu_interpret_mode_state()
    z = jnp.zeros((1,), jnp.int32)
    ref, _ = R.pooled_scores_prefill_reference(q, k, z, z + t, 64)
    err = _score_err(sc, ref)
    assert err < _SCORE_TOL, err
    _, rl = R.attention_reference(q, k, v, z, z + t, return_lse=True)
    want = P.pack_lse(rl, P._layout(q, k, 16))
    got = M.lse_for_triton(lse, q, k, 16)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=_LSE_TOL, rtol=0)


@pytest.mark.parametrize("case,needle", [
    (dict(b=2), "batch"), (dict(t=192), "q_len"), (dict(d=96), "head_dim"), (dict(dtype=jnp.float32), "dtype"),
    (dict(q_start=128), "q_start"), (dict(tile=8), "tile_size"),
    (dict(kv_t=256), "kv_len"), (dict(hq=3), "q_heads"),
])
def test_unsupported_raises_one_line(case, needle):
    b, t, hq, d = case.get("b", 1), case.get("t", 128), case.get("hq", 4), case.get("d", 64)
    dtype = case.get("dtype", jnp.bfloat16)
    q = jnp.zeros((b, t, hq, d), dtype)
    k = jnp.zeros((b, case.get("kv_t", t), 2, d), dtype)
    tile = case.get("tile", 16)
    assert not M.supported(q, k, tile, q_start=jnp.asarray([case.get("q_start", 0)]))
    if "q_start" in case:
        return  # (the kernels take no q_start: only the predicate sees it)
    with pytest.raises(ValueError, match=needle) as e:
        M.pooled_scores(q, k, jnp.zeros((b, hq, t), jnp.float32), tile)
    assert "\n" not in str(e.value)
    assert M.supported(jnp.zeros((1, 128, 4, 64), jnp.bfloat16), jnp.zeros((1, 128, 2, 64), jnp.bfloat16), 16)


def test_supported_under_jit():
    """Inside a jit trace, a q_start closed over as a concrete array is still host-checkable (a jnp op on it would be
    staged: session 20's GPU run failed so), and a traced one is out of the host check's scope instead of raising
    (`anchor_prefill` then takes the Triton path unless the call says chunk_at_zero)."""
    q, k = jnp.zeros((1, 128, 4, 64), jnp.bfloat16), jnp.zeros((1, 128, 2, 64), jnp.bfloat16)
    qs, bad = jnp.zeros((1,), jnp.int32), jnp.full((1,), 64, jnp.int32)
    seen = {}

    def f(x, traced):
        seen["closed"] = M.supported(q, k, 16, q_start=qs)
        seen["closed_bad"] = M.supported(q, k, 16, q_start=bad)
        seen["traced"] = M.supported(q, k, 16, q_start=traced)
        return x

    jax.jit(f)(jnp.zeros(()), qs)
    assert seen == {"closed": True, "closed_bad": False, "traced": False}, seen


@pytest.mark.parametrize("hq,kvh,d,tile,dtype", [(32, 8, 128, 32, jnp.bfloat16), (12, 2, 128, 64, jnp.float16),
                                                  (14, 2, 64, 16, jnp.bfloat16)])
def test_lowers_for_sm90(hq, kvh, d, tile, dtype):
    """The Mosaic GPU lowering on the CPU (layout inference and the dialect lowering run in Python, for sm_90a) at
    realistic shapes: shared-memory budget, wgmma shapes, TMA boxes (a swizzled d-128 Q box with the sub-group axis
    once exceeded the 5 dimensions of one copy). Interpret mode checks none of these; ptxas and the run still need
    the GPU."""
    q = jax.ShapeDtypeStruct((1, 4096, hq, d), dtype)
    k = jax.ShapeDtypeStruct((1, 4096, kvh, d), dtype)
    lse = jax.ShapeDtypeStruct((1, hq, 4096), jnp.float32)
    calls = [(lambda q, k, v: M.flash_lse(q, k, v), (q, k, k)),
             (lambda q, k, v: M.flash_lse(q, k, v, tuning=M.MgpuTuning(p_in_regs=False, block_kv=64)), (q, k, k)),
             (lambda q, k: M.flash_lse(q, k, with_out=False), (q, k)),
             # 3-deep rings: the dense pass at 128-key steps, the LSE-only pass at 256 (they fit sm_90's 227 KB of
             # shared memory only without the reduction scratch, which no reduction here needs)
             (lambda q, k, v: M.flash_lse(q, k, v, tuning=M.MgpuTuning(max_concurrent_steps=3)), (q, k, k)),
             (lambda q, k: M.flash_lse(q, k, with_out=False, tuning=M.MgpuTuning(max_concurrent_steps=3)), (q, k)),
             (lambda q, k, l: M.pooled_scores(q, k, l, tile), (q, k, lse)),
             (lambda q, k, l, f: M.pooled_scores(q, k, l, tile, first_tile=f, n_tiles=32, width=5120),
              (q, k, lse, jax.ShapeDtypeStruct((1,), jnp.int32)))]
    if hq == 32:  # the softmax variants (same layouts, other instructions): at one shape
        calls += [(lambda q, k, v: M.flash_lse(q, k, v, tuning=M.MgpuTuning(fma_softmax=False)), (q, k, k)),
                  (lambda q, k: M.flash_lse(q, k, with_out=False, tuning=M.MgpuTuning(fma_softmax=False)), (q, k)),
                  (lambda q, k: M.flash_lse(q, k, with_out=False, tuning=M.MgpuTuning(lse_block_q=128)), (q, k)),
                  (lambda q, k, l: M.pooled_scores(q, k, l, tile, tuning=M.MgpuTuning(scores_poly_exp2_cols=32)),
                   (q, k, lse))]
    for f, args in calls:
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def _ops_in_loops(module):
    """Names of the operations inside the bodies of the while loops of a lowered StableHLO module."""
    names = []

    def walk(op, inside):
        for region in op.regions:
            for block in region.blocks:
                for o in block.operations:
                    here = inside or o.operation.name == "stablehlo.while"
                    if inside:
                        names.append(o.operation.name)
                    walk(o.operation, here)

    walk(module.operation, False)
    return names


def test_anchor_packs_q_once_outside_the_window_loop(triton_sm90_modules, monkeypatch):
    """anchor_prefill with the Mosaic GPU scores packs q and the LSE before the select's loop over windows of tiles:
    packed inside the loop, XLA transposed q once per window (10.8 ms of the 8B shape's 402 ms anchor at 128K, H200,
    session 20). Lowered for CUDA on the CPU (the scope check is told the backend is a GPU)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    t, hq, kvh, d = 8192, 32, 8, 128  # the 8B shape: 8K keys make several windows of tiles
    q, k = jax.ShapeDtypeStruct((1, t, hq, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, t, kvh, d), jnp.bfloat16)
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    kw = dict(topk_frac=0.1, min_k=128, k_max=R.max_budget(t, 0.1, 128), impl="pallas")
    f = lambda q, k, v: P.anchor_prefill(q, k, v, qs, kl, kl, 32, tuning=P.PrefillTuning(anchor_backend="mgpu"),
                                         **kw)  # noqa: E731
    ops = _ops_in_loops(jax.jit(f).trace(q, k, k).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo"))
    assert "stablehlo.custom_call" in ops  # the scores kernel runs in the loop
    assert "stablehlo.transpose" not in ops, sorted(set(ops))


# ------------------------------------------------------------------------------------------ anchor_prefill wiring


def _spy(monkeypatch, *names):
    """Count the calls of prefill_mgpu functions (the fallback to Triton is silent: a test must see which ran)."""
    calls = {n: 0 for n in names}
    for n in names:
        fn = getattr(M, n)

        def wrapped(*a, _fn=fn, _n=n, **kw):
            calls[_n] += 1
            return _fn(*a, **kw)

        monkeypatch.setattr(M, n, wrapped)
    return calls


def _anchor_both(seed, b, t, hq, kvh, d, tile, dtype, dense_out, q_start, kv_len, max_len, interpret=True,
                 sinks=0, window=0, chunk_at_zero=False):
    """anchor_prefill with both backends at one shape -> (triton, mgpu) results, checked against the reference."""
    from tests.kernels_pallas.test_prefill import _check_idx

    q, k, v = _inputs(np.random.default_rng(seed), b, t, hq, kvh, d, max_len, dtype, peaky=True)
    qs, kl = jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)
    frac, min_k = 0.25, 8
    kw = dict(topk_frac=frac, min_k=min_k, k_max=R.max_budget(max_len, frac, min_k), dense_out=dense_out,
              impl="pallas", interpret=interpret, sinks=sinks, window=window, chunk_at_zero=chunk_at_zero)
    res = [P.anchor_prefill(q, k, v, qs, kl, kl, tile, tuning=P.PrefillTuning(anchor_backend=be), **kw)
           for be in ("triton", "mgpu")]
    scores, _ = R.pooled_scores_prefill_reference(q, k, qs, kl, tile, sinks=sinks, window=window)
    if dense_out:
        ref_out = lambda idx: R.attention_reference(q, k, v, qs, kl)
    else:
        ref_out = lambda idx: R.sparse_prefill_reference(q, k, v, qs, kl, idx, jnp.arange(kvh), tile)
    for out, idx, counts in res:
        _check_idx(idx, counts, scores)
        err = _row_err(out, ref_out(idx))
        assert err < _tol(dtype), err
    (o_t, i_t, c_t), (o_m, i_m, c_m) = res
    np.testing.assert_array_equal(np.asarray(c_m), np.asarray(c_t))
    same = float(np.mean(np.asarray(i_m) == np.asarray(i_t)))
    print(f"mgpu vs triton: same index fraction {same:.4f}, output row error {_row_err(o_m, o_t):.2e}")
    return res, same


@pytest.mark.parametrize("dense_out,forced", [(False, {}), (True, dict(sinks=4, window=32))])
def test_anchor_prefill_mgpu_backend_interpret(monkeypatch, interp, dense_out, forced):
    """In scope (batch 1, chunk at 0 holding every key; the cache is longer than the chunk): both Mosaic GPU passes
    run, the scores in two windows of two tiles (the score budget lowered to 16 KiB), and give the Triton backend's
    counts, the reference's Top-k sets (forced keys too) and outputs."""
    calls = _spy(monkeypatch, "flash_lse", "pooled_scores")
    monkeypatch.setattr(P, "_SCORE_CHUNK_BYTES", 16 << 10)  # rows of 1024 fp32 keys x 2 KV heads: 2 tiles a chunk
    t = 128
    _, same = _anchor_both(SEED + 60, 1, t, 4, 2, 64, 32, jnp.bfloat16, dense_out, [0], [t], t + 64, **forced)
    assert calls["flash_lse"] == 1 and calls["pooled_scores"] >= 1, calls
    assert same > 0.99, same


def test_pooled_scores_window_interpret(interp):
    """A window of tiles (traced first tile, static count and width) gives the full call's rows bit for bit; tiles
    past the last and keys past q_len are -inf."""
    t, tile = 128, 16
    q, k, _ = _inputs(np.random.default_rng(SEED + 62), 1, t, 4, 2, 64, t, jnp.bfloat16, peaky=True)
    _, lse = _ref_lse2(q, k, k)
    lse = lse.astype(jnp.float32)
    full = np.asarray(M.pooled_scores(q, k, lse, tile, interpret=interp))
    win = jax.jit(lambda f: M.pooled_scores(q, k, lse, tile, interpret=interp, first_tile=f, n_tiles=4, width=256))
    for first in (3, 6):  # 8 tiles: [3, 7) inside, [6, 10) runs two tiles past the end
        got = np.asarray(win(jnp.asarray([first], jnp.int32)))
        assert got.shape == (1, 2, 4, 256)
        n_in = min(4, 8 - first)
        np.testing.assert_array_equal(got[:, :, :n_in, :t], full[:, :, first:first + n_in])
        assert np.all(np.isneginf(got[:, :, n_in:])) and np.all(np.isneginf(got[..., t:]))
    with pytest.raises(ValueError, match="width") as e:
        M.pooled_scores(q, k, lse, tile, width=200)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("case", [dict(b=2, kv_len=[128, 120]), dict(q_start=[64])])
def test_anchor_prefill_mgpu_falls_back_interpret(monkeypatch, interp, case):
    """Out of scope (batch 2 with padding queries; a chunk at an offset): silently the Triton path, bit for bit: the
    two backends lower to the same program (compared as text, not run: running both took 8 s of the suite)."""
    calls = _spy(monkeypatch, "flash_lse", "pooled_scores")
    b, t = case.get("b", 1), 128
    q, k, v = _inputs(np.random.default_rng(SEED + 61), b, t, 4, 2, 64, t + 64, jnp.bfloat16, peaky=True)
    qs = jnp.asarray(case.get("q_start", [0] * b), jnp.int32)
    kl = jnp.asarray(case.get("kv_len", [t] * b), jnp.int32)
    kw = dict(topk_frac=0.25, min_k=8, k_max=R.max_budget(t + 64, 0.25, 8), impl="pallas", interpret=True)
    text = [jax.jit(lambda q, k, v, qs, kl, be=be: P.anchor_prefill(
        q, k, v, qs, kl, kl, 32, tuning=P.PrefillTuning(anchor_backend=be), **kw)).lower(q, k, v, qs, kl).as_text()
        for be in ("triton", "mgpu")]
    assert calls == {"flash_lse": 0, "pooled_scores": 0}, calls
    assert text[1] == text[0]


def _ran(monkeypatch):
    """Run-time spy: the number of `prefill_mgpu.pooled_scores` calls that ran (not merely traced; once per window
    of tiles)."""
    ran, fn = [], M.pooled_scores

    def wrapped(*a, **kw):
        jax.debug.callback(lambda: ran.append(1))
        return fn(*a, **kw)

    monkeypatch.setattr(M, "pooled_scores", wrapped)
    return ran


def _anchor_jits(t, max_len, tile, dense_out, interpret):
    """anchor_prefill(q, k, v, ...) of a chunk at 0 of q_len t jitted two ways: Mosaic GPU with kv_len closed over
    (a host-side constant), and with traced lengths (q_start, kv_len: how the models call it)."""
    kw = dict(topk_frac=0.25, min_k=8, k_max=R.max_budget(max_len, 0.25, 8), dense_out=dense_out, impl="pallas",
              interpret=interpret, chunk_at_zero=True)
    run = lambda q, k, v, qs, kl: P.anchor_prefill(q, k, v, qs, kl, kl, tile, tuning=P.PrefillTuning(
        anchor_backend="mgpu"), **kw)  # noqa: E731
    qs = jnp.zeros((1,), jnp.int32)
    return lambda kl: jax.jit(lambda q, k, v: run(q, k, v, qs, kl)), jax.jit(run)


def _same(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _check_traced(fns, q, k, v, ran, pad):
    """The traced-length call (`_anchor_jits`) at kv_len == q_len and at q_len - pad (a padded chunk): the Mosaic GPU
    passes run, and the results equal the call with that kv_len closed over, bit for bit."""
    concrete, traced = fns
    t = q.shape[1]
    qs = jnp.zeros((1,), jnp.int32)
    for n in (t, t - pad):
        kl = jnp.full((1,), n, jnp.int32)
        before = len(ran)
        want = concrete(kl)(q, k, v)
        n_concrete = len(ran) - before
        assert n_concrete >= 1
        _same(traced(q, k, v, qs, kl), want)
        assert len(ran) == before + 2 * n_concrete, ran


def test_anchor_prefill_mgpu_traced_kv_len_interpret(monkeypatch, interp):
    """Under jit with traced lengths (as the models call it) and chunk_at_zero, the Mosaic GPU passes run whatever
    kv_len is, padding included. Anchor layer 0 (dense_out) only, to keep the file fast (dense_out=False is lowered
    below and run in the GPU tier)."""
    ran = _ran(monkeypatch)
    t = 128
    q, k, v = _inputs(np.random.default_rng(SEED + 63), 1, t, 4, 2, 64, t + 64, jnp.bfloat16, peaky=True)
    _check_traced(_anchor_jits(t, t + 64, 32, True, True), q, k, v, ran, pad=8)


def test_anchor_prefill_mgpu_padded_chunk_interpret(monkeypatch, interp):
    """A chunk at 0 whose last rows are padding (kv_len < q_len, as the models pad a prompt to its chunk): the padding
    rows are taken out of the Mosaic GPU pooled scores (an infinite LSE), so both backends select the same keys for
    the real tiles and agree with the reference (`_anchor_both`'s checks)."""
    calls = _spy(monkeypatch, "flash_lse", "pooled_scores")
    t = 128
    (res_t, res_m), same = _anchor_both(SEED + 64, 1, t, 4, 2, 64, 32, jnp.bfloat16, False, [0], [t - 40], t + 64,
                                        chunk_at_zero=True)
    assert calls["pooled_scores"] >= 1, calls
    real = np.arange(t) < t - 40  # rows of the three tiles that hold a real query
    assert float(np.mean(np.asarray(res_m[1])[..., :3, :] == np.asarray(res_t[1])[..., :3, :])) > 0.99
    assert _row_err(res_m[0][:, real], res_t[0][:, real]) < _tol(jnp.bfloat16)


def _module_kernels(module):
    """(kernels of a lowered module: Triton kernels by their pallas_call name, Mosaic GPU ones as "mosaic_gpu",
    calls to private functions followed; how many stablehlo.case ops it holds)."""
    funcs = {str(op.attributes["sym_name"]).strip('"'): op for op in module.body.operations
             if op.operation.name == "func.func"}
    n_case = []

    def ops(regions):
        for region in regions:
            for block in region.blocks:
                yield from (o.operation for o in block.operations)

    def kernels(regions, acc):
        for o in ops(regions):
            if o.name == "stablehlo.custom_call":
                tgt = str(o.attributes["call_target_name"]).strip('"')
                acc.add("mosaic_gpu" if "mosaic_gpu" in tgt else str(o.attributes["mhlo.backend_config"]["name"])
                        .strip('"'))
            elif o.name == "func.call":
                kernels(funcs[str(o.attributes["callee"]).lstrip("@")].regions, acc)
            elif o.name == "stablehlo.case":
                n_case.append(1)
            kernels(o.regions, acc)
        return acc

    found = kernels(funcs["main"].regions, set())
    return found, len(n_case)


@pytest.mark.parametrize("dense_out", [False, True])
def test_anchor_traced_kv_len_lowers_to_mgpu(triton_sm90_modules, monkeypatch, dense_out):
    """The jitted call with traced lengths, lowered for CUDA on the CPU (the scope check told the backend is a GPU),
    takes the Mosaic GPU LSE and score kernels and no Triton LSE / score kernel, with no run-time branch (before,
    traced lengths always took Triton)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    t, hq, kvh, d = 256, 4, 2, 64
    q, k = jax.ShapeDtypeStruct((1, t, hq, d), jnp.bfloat16), jax.ShapeDtypeStruct((1, t, kvh, d), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((1,), jnp.int32)
    kw = dict(topk_frac=0.25, min_k=8, k_max=R.max_budget(t, 0.25, 8), impl="pallas", chunk_at_zero=True,
              dense_out=dense_out)
    tuning = P.PrefillTuning(anchor_backend="mgpu", anchor0_cudnn=False)  # (cuDNN does not lower without a GPU)
    f = lambda q, k, v, qs, kl: P.anchor_prefill(q, k, v, qs, kl, kl, 32, tuning=tuning, **kw)  # noqa: E731
    module = jax.jit(f).trace(q, k, k, n, n).lower(lowering_platforms=("cuda",)).compiler_ir("stablehlo")
    found, n_case = _module_kernels(module)
    assert n_case == 0 and {"mosaic_gpu", "kascade_prefill_select"} <= found, (found, n_case)
    assert not found & {"kascade_prefill_dense", "kascade_prefill_lse", "kascade_prefill_pooled_scores"}, found


def test_anchor_backend_errors():
    with pytest.raises(ValueError, match="anchor_backend must be one of") as e:
        P.PrefillTuning(anchor_backend="cuda")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="anchor_backend"):
        P.tuning_from_string("anchor_backend=mosaic")
    assert P.tuning_from_string("anchor_backend=mgpu").anchor_backend == "mgpu"


def test_auto_backend_resolves_by_device(monkeypatch):
    """"auto" (both backend fields' default) is Mosaic GPU only on a Hopper GPU outside interpret mode; Triton on this
    CPU, in interpret mode, and on another GPU; a named backend is kept as it is."""
    assert P.DEFAULT_TUNING.anchor_backend == "auto" and P.DEFAULT_TUNING.reuse_backend == "auto"
    assert P._backend("auto", interpret=False) == "triton" and P._backend("auto", interpret=True) == "triton"
    assert P._backend("mgpu", interpret=True) == "mgpu" and P._backend("triton", interpret=False) == "triton"
    monkeypatch.setattr(P.jax, "default_backend", lambda: "gpu")
    for cc, want in (("9.0", "mgpu"), ("8.0", "triton"), ("10.0", "triton")):
        dev = types.SimpleNamespace(platform="gpu", compute_capability=cc)
        monkeypatch.setattr(P.jax, "devices", lambda dev=dev: [dev])
        assert P._backend("auto", interpret=False) == want, cc
        assert P._backend("auto", interpret=True) == "triton", cc


@pytest.mark.gpu
def test_gpu_default_tuning_takes_mgpu_on_hopper(monkeypatch):
    """On a Hopper GPU the default tuning's anchor call (the models' prefill, no tuning passed) runs the Mosaic GPU
    passes."""
    if jax.default_backend() != "gpu" or not P._hopper():
        pytest.skip("needs a Hopper GPU")
    ran = _ran(monkeypatch)
    t = 1024
    q, k, v = _inputs(np.random.default_rng(SEED + 74), 1, t, 8, 2, 128, t, jnp.bfloat16, peaky=False)
    kl = jnp.full((1,), t, jnp.int32)
    out = P.anchor_prefill(q, k, v, jnp.zeros((1,), jnp.int32), kl, kl, 32, topk_frac=0.25, min_k=8,
                           k_max=R.max_budget(t, 0.25, 8), impl="pallas", chunk_at_zero=True)
    jax.block_until_ready(out)
    assert ran, "the default tuning did not take the Mosaic GPU passes"


def test_set_default_anchor_backend(monkeypatch):
    """The process-wide backend of calls without a tuning (the models' prefill, `bench --e2e_anchor_backend`): set,
    read by the next call, a bad name refused with the field's one-line error and the default kept."""
    monkeypatch.setattr(P, "DEFAULT_TUNING", P.DEFAULT_TUNING)  # restored after the test
    before = P.DEFAULT_TUNING
    P.set_default_anchor_backend("mgpu")
    assert P.DEFAULT_TUNING == dataclasses.replace(before, anchor_backend="mgpu")
    assert P.tuning_from_string("").anchor_backend == "mgpu"  # (reads the default at call time)
    with pytest.raises(ValueError, match="anchor_backend must be one of"):
        P.set_default_anchor_backend("cuda")
    assert P.DEFAULT_TUNING.anchor_backend == "mgpu"


# ---------------------------------------------------------------- reuse over key blocks (`reuse_blocks`), interpret


def _block_selection(rng, b, idx_heads, n_tiles, tile, kb, q_start, kv_len, frac):
    """A random selection of whole key blocks in `anchor_prefill(key_block=kb)`'s layout: per tile, distinct blocks
    whose first key is before min(tile start, kv_len), lanes j*kb ... j*kb + kb - 1 = one block's ids, -1 after; the
    tiles' counts are their largest over the heads (a head with fewer blocks has -1 lanes inside the count)."""
    chosen = {}
    for bi in range(b):
        for h in range(idx_heads):
            for t in range(n_tiles):
                lim = min(q_start[bi] + t * tile, kv_len[bi])
                n_elig = -(-lim // kb) if lim > 0 else 0
                n = min(n_elig, int(np.ceil(frac * n_elig)))
                chosen[bi, h, t] = rng.permutation(n_elig)[:n]
    w = max(kb, max(len(c) for c in chosen.values()) * kb)
    idx = np.full((b, idx_heads, n_tiles, w), -1, np.int32)
    counts = np.zeros((b, n_tiles), np.int32)
    for (bi, h, t), c in chosen.items():
        if len(c):
            idx[bi, h, t, : len(c) * kb] = (c[:, None] * kb + np.arange(kb)).reshape(-1)
        counts[bi, t] = max(counts[bi, t], len(c) * kb)
    return jnp.asarray(idx), jnp.asarray(counts)


def _check_reuse_blocks(b, t, max_len, hq, kvh, d, tile, kb, q_start, kv_len, dtype, *, pool_all=False, seed=0,
                        tuning=None, interpret=True, peaky=False, frac=0.3, hole=False):
    rng = np.random.default_rng(SEED + seed)
    q, k, v = _inputs(rng, b, t, hq, kvh, d, max_len, dtype, peaky=peaky)
    nt = -(-t // tile)
    idx, counts = _block_selection(rng, b, 1 if pool_all else kvh, nt, tile, kb, q_start, kv_len, frac)
    if hole:  # head 0 lacks its first block: -1 lanes inside every count
        idx = idx.at[:, 0, :, :kb].set(-1)
    hm = jnp.zeros((kvh,), jnp.int32) if pool_all else jnp.arange(kvh, dtype=jnp.int32)
    qs, kl = jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    out = M.reuse_blocks(q, k, v, qs, kl, idx, counts, hm, tile, kb, tuning=tuning, interpret=interpret)
    ref = R.sparse_prefill_reference(q, k, v, qs, kl, idx, hm, tile)
    rows = np.arange(t)[None, :] < (np.asarray(kv_len) - np.asarray(q_start))[:, None]  # queries inside kv_len
    return _row_err(np.asarray(out)[rows], np.asarray(ref)[rows])


@pytest.mark.parametrize("case", [
    # group 7 at tile 32: 224 packed rows, two programs per tile; ragged q_start / kv_len, pool 'gqa'
    dict(b=2, t=96, max_len=256, hq=14, kvh=2, d=64, tile=32, kb=16, q_start=[64, 128], kv_len=[160, 200],
         dtype=jnp.bfloat16),
    # q_start not on a block boundary (the diagonal takes an extra block), the last tile's diagonal past the cache
    # end (clamped copies), fp16 d 128, 128-key steps
    dict(b=1, t=100, max_len=160, hq=4, kvh=1, d=128, tile=32, kb=32, q_start=[60], kv_len=[160],
         dtype=jnp.float16, tuning=M.ReuseTuning(block_kv=128)),
    # one selection shared by all KV heads (head map of zeros); blocks of 8; the 2-deep ring wraps many times; the
    # per-element mask on every step (column masks off)
    dict(b=2, t=64, max_len=320, hq=6, kvh=2, d=64, tile=16, kb=8, q_start=[256, 200], kv_len=[320, 250],
         dtype=jnp.bfloat16, pool_all=True, frac=0.6, tuning=M.ReuseTuning(block_kv=64, column_mask=False)),
    # the first case with column masks on the steps inside the count and a 3-deep ring (two KV heads, ragged batch,
    # head 0 missing a block inside the count)
    dict(b=2, t=96, max_len=256, hq=14, kvh=2, d=64, tile=32, kb=16, q_start=[64, 128], kv_len=[160, 200],
         dtype=jnp.bfloat16, seed=1, frac=0.9, hole=True, tuning=M.ReuseTuning(block_kv=64, steps=3)),
])
def test_reuse_blocks_interpret(interp, case):
    """Against `reference.sparse_prefill_reference` on the same expanded ids (rows of queries inside kv_len)."""
    err = _check_reuse_blocks(**case)
    assert err < _tol(case["dtype"]), err


def test_reuse_blocks_races():
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks, interpret_pallas_call as mi

    gpu_callbacks.reset_gpu_interpret_mode_state()
    err = _check_reuse_blocks(1, 64, 192, 4, 2, 64, 16, 16, [96], [192], jnp.bfloat16, seed=5, peaky=True,
                              interpret=plgpu.InterpretGPUParams(detect_races=True))
    assert not mi.get_races().races_found
    gpu_callbacks.reset_gpu_interpret_mode_state()
    assert err < _tol(jnp.bfloat16), err


@pytest.mark.parametrize("case,needle", [
    (dict(kb=4), "key_block"), (dict(kb=32, tile=16), "key_block"), (dict(d=96), "head_dim"),
    (dict(dtype=jnp.float32), "dtype"), (dict(max_len=200), "cache length"), (dict(tile=8, kb=8), "tile_size"),
    (dict(w=20), "idx must be"),
])
def test_reuse_blocks_unsupported_raises_one_line(case, needle):
    kb, tile, d = case.get("kb", 16), case.get("tile", 32), case.get("d", 64)
    dtype, max_len = case.get("dtype", jnp.bfloat16), case.get("max_len", 256)
    q = jnp.zeros((1, 64, 4, d), dtype)
    k = jnp.zeros((1, max_len, 2, d), dtype)
    idx = jnp.zeros((1, 2, 64 // tile, case.get("w", 32)), jnp.int32)
    z = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match=needle) as e:
        M.reuse_blocks(q, k, k, z, z + 64, idx, jnp.zeros((1, 64 // tile), jnp.int32), jnp.arange(2), tile, kb,
                       tuning=case.get("tuning"), interpret=True)
    assert "\n" not in str(e.value)


def _bench_script(name: str):
    """benchmarks/<name>.py as a module (the folder is no package)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_exp2_probe_drops_the_exponentials():
    """`benchmarks/mgpu_prefill_probe.no_exp2` (the probes' `--no_exp2` rows) traces a pass without its exp2: the
    LSE pass lowered for sm_90a has its ex2 instruction, the probe's none."""
    probe = _bench_script("mgpu_prefill_probe")
    q = jax.ShapeDtypeStruct((1, 1024, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, 1024, 2, 128), jnp.bfloat16)
    f = lambda q, k: M.flash_lse(q, k, with_out=False)[1]
    plain, dropped = (g.trace(q, k).lower(lowering_platforms=("cuda",)).as_text()
                      for g in (jax.jit(f), probe.no_exp2(f)))
    assert "ex2" in plain and "ex2" not in dropped and "mosaic_gpu" in dropped


def test_mgpu_sass_reads_the_committed_dumps():
    """`benchmarks/mgpu_sass.py count` reads a GPU dump as committed (stdout.txt.gz): one PTX module per kernel,
    cut before the device's ptxas report that MOSAIC_GPU_DUMP_PTXAS prints after it (local ptxas refused it)."""
    tool = _bench_script("mgpu_sass")
    root = pathlib.Path(__file__).resolve().parents[2] / "results/accuracy/h100_2026-12-06_i21s35/sass"
    for variant, entry in (("lse", "kascade_prefill_lse_mgpu"), ("reuse_kb16", "kascade_prefill_reuse_mgpu")):
        (ptx,) = tool._ptx_texts(str(root / variant))
        assert f".entry {entry}" in ptx and ptx.rstrip().endswith('prefill_mgpu.py"') and "ptxas" not in ptx


def test_few_k_rows_probe_streams_fewer_keys(interp, capsys):
    """`benchmarks/mgpu_prefill_probe.few_k_rows` (the probe's `--few_k_rows` rows): the LSE pass with each K copy cut
    to 8 rows lowers for sm_90a to another kernel and, interpreted, copies only those rows of each 256-key step: the
    first 8 queries (which see only keys 0-7) keep the reference's LSE, the others read what the slots held before
    (the interpreter's poison; stale keys on a GPU)."""
    probe = _bench_script("mgpu_prefill_probe")
    f = lambda q, k: M.flash_lse(q, k, with_out=False)[1]
    shapes = [jax.ShapeDtypeStruct((1, 1024, h, 128), jnp.bfloat16) for h in (4, 2)]
    plain, few = (g.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
                  for g in (jax.jit(f), probe.few_k_rows(f)))
    assert plain.split("kernel_hash")[1][:40] != few.split("kernel_hash")[1][:40] and "mosaic_gpu" in few
    rng = np.random.default_rng(SEED + 11)
    q = jnp.asarray(rng.standard_normal((1, 512, 2, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 512, 1, 128)), jnp.bfloat16)
    got = np.asarray(probe.few_k_rows(lambda q, k: M.flash_lse(q, k, with_out=False, interpret=interp)[1])(q, k))
    want = np.asarray(_ref_lse2(q, k, k)[1])
    np.testing.assert_allclose(got[..., :8], want[..., :8], atol=_LSE_TOL)
    assert not np.allclose(got[..., 8:], want[..., 8:], atol=1e-2)
    for bad in ("12", "128"):  # whole 8-row swizzle tiles, fewer than a slot's 128 rows
        with pytest.raises(SystemExit):
            probe.main(["--few_k_rows", bad])
        assert f"--few_k_rows must be a multiple of 8 in 8..120 (whole 8-row swizzle tiles), got {bad}" in \
            capsys.readouterr().err


def test_reuse_blocks_probe_selection_follows_the_contract():
    """`benchmarks/reuse_blocks_probe.py`'s synthetic selections: distinct whole blocks before each tile, -1 after."""
    probe = _bench_script("reuse_blocks_probe")
    for kb in (1, 16):
        idx, counts, _ = probe.selection(2048, 2, 32, kb)
        idx, counts = np.asarray(idx)[0], np.asarray(counts)[0]
        lane = np.arange(idx.shape[-1])
        inside = lane[None, None, :] < counts[None, :, None]
        assert np.all((idx == -1) == ~inside)
        start = (np.arange(idx.shape[1]) * 32)[None, :, None]
        blocks = np.where(inside, idx // kb, -1)
        assert np.all(np.where(inside, (blocks * kb < start) & (idx % kb == lane % kb), True))
        srt = np.sort(blocks, axis=-1)[..., ::kb]
        assert np.all((np.diff(srt, axis=-1) != 0) | (srt[..., 1:] == -1)), "a block chosen twice"


def test_reuse_backend_routes_key_blocks_interpret(monkeypatch, interp):
    """`PrefillTuning(reuse_backend="mgpu")`: `reuse_prefill` and the anchor's own reuse take `reuse_blocks` for a
    selection of key blocks in its scope and give the Triton path's output; single keys, and blocks outside the
    scope (a cache length that is not a multiple of the block), stay on Triton silently."""
    calls = _spy(monkeypatch, "reuse_blocks")
    rng = np.random.default_rng(SEED + 7)
    t, max_len, tile, kb = 64, 192, 32, 16
    q, k, v = _inputs(rng, 2, t, 4, 2, 64, max_len, jnp.bfloat16)
    qs, kl = jnp.asarray([128, 64], jnp.int32), jnp.asarray([192, 120], jnp.int32)
    idx, counts = _block_selection(rng, 2, 2, t // tile, tile, kb, [128, 64], [192, 120], 0.4)
    hm = jnp.arange(2, dtype=jnp.int32)
    run = lambda be, kb=kb, q=q, k=k, v=v: P.reuse_prefill(
        q, k, v, qs, kl, idx, counts, hm, tile, impl="pallas", interpret=True, key_block=kb,
        tuning=P.PrefillTuning(reuse_backend=be))
    tri, mg = run("triton"), run("mgpu")
    assert calls["reuse_blocks"] == 1, calls
    rows = np.arange(t)[None, :] < np.asarray([64, 56])[:, None]
    assert _row_err(np.asarray(mg)[rows], np.asarray(tri)[rows]) < _tol(jnp.bfloat16)
    jax.eval_shape(lambda: run("mgpu", kb=1))  # traced, not run: the routing is decided while tracing
    jax.eval_shape(lambda: run("mgpu", k=k[:, :184], v=v[:, :184]))  # 184 keys: not whole blocks of 16
    assert calls["reuse_blocks"] == 1, calls
    kw = dict(topk_frac=0.25, min_k=32, k_max=128, impl="pallas", interpret=True, key_block=kb)
    anchor = lambda be: P.anchor_prefill(q, k, v, qs, kl, kl, tile, tuning=P.PrefillTuning(reuse_backend=be), **kw)
    (o_t, i_t, c_t), (o_m, i_m, c_m) = anchor("triton"), anchor("mgpu")
    assert calls["reuse_blocks"] == 2, calls
    np.testing.assert_array_equal(np.asarray(i_m), np.asarray(i_t))
    np.testing.assert_array_equal(np.asarray(c_m), np.asarray(c_t))
    assert _row_err(np.asarray(o_m)[rows], np.asarray(o_t)[rows]) < _tol(jnp.bfloat16)
    with pytest.raises(ValueError, match="reuse_backend must be one of"):
        P.PrefillTuning(reuse_backend="cuda")


@pytest.mark.parametrize("hq,kvh,d,tile,kb,block_kv,steps,dtype", [
    (32, 8, 128, 32, 16, 128, 2, jnp.bfloat16), (32, 8, 128, 32, 16, 128, 3, jnp.bfloat16),
    (14, 2, 64, 32, 16, 128, 2, jnp.bfloat16), (12, 2, 128, 64, 8, 64, 3, jnp.float16),
    (14, 2, 64, 16, 16, 64, 4, jnp.bfloat16)])
def test_reuse_blocks_lower_for_sm90(hq, kvh, d, tile, kb, block_kv, steps, dtype):
    """The Mosaic GPU lowering on the CPU at realistic shapes (it once refused a TMA box whose start was not provably
    a multiple of the ring's 8-row tiling: the diagonal now starts on a block boundary). It also checks the shared
    memory against sm_90's 227 KB: 3 steps of 128 keys at d 128 fit only without the 2 KB reduction scratch."""
    t = 4096
    q, k = jax.ShapeDtypeStruct((1, t, hq, d), dtype), jax.ShapeDtypeStruct((1, t, kvh, d), dtype)
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    args = (q, k, k, i32(1), i32(1), i32(1, kvh, t // tile, 416), i32(1, t // tile), i32(kvh))
    for opts in (False, True):  # without and with column masks
        tun = M.ReuseTuning(block_kv=block_kv, steps=steps, column_mask=opts)
        f = lambda q, k, v, qs, kl, idx, c, hm, tun=tun: M.reuse_blocks(q, k, v, qs, kl, idx, c, hm, tile, kb,
                                                                         tuning=tun)
        assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


# ------------------------------------------------------------------------------------------ GPU tier (H200)


_GPU_SHAPES = [(14, 2, 64), (32, 8, 128)]


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("hq,kvh,d", _GPU_SHAPES)
@pytest.mark.parametrize("p_in_regs,steps", [(None, 2), (False, 2), (None, 3)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_gpu_flash_4k(peaky, hq, kvh, d, p_in_regs, steps, dtype):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v = _inputs(np.random.default_rng(SEED), 1, 4096, hq, kvh, d, 4096, dtype, peaky=peaky)
    tuning = M.MgpuTuning(p_in_regs=p_in_regs, max_concurrent_steps=steps)
    _, lse_err, out_err = _check_flash(q, k, v, True, tuning=tuning)
    # (approx exp2/log2 on the GPU: looser LSE bound than interpret mode)
    assert lse_err < 1e-3 and out_err < _OUT_TOL[jnp.dtype(dtype).name], (lse_err, out_err)
    _, lse_err, _ = _check_flash(q, k, None, False, tuning=tuning)
    assert lse_err < 1e-3, lse_err


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kvh,d", _GPU_SHAPES)
def test_gpu_flash_4k_fma_softmax(hq, kvh, d):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, v = _inputs(np.random.default_rng(SEED), 1, 4096, hq, kvh, d, 4096, jnp.bfloat16, peaky=True)
    tuning = M.MgpuTuning(fma_softmax=False)  # the default is fma_softmax: the other path, the scale first
    _, lse_err, out_err = _check_flash(q, k, v, True, tuning=tuning)
    assert lse_err < 1e-3 and out_err < _OUT_TOL["bfloat16"], (lse_err, out_err)
    _, lse_err, _ = _check_flash(q, k, None, False, tuning=tuning)
    assert lse_err < 1e-3, lse_err
    z = jnp.zeros((1,), jnp.int32)
    ref, _ = R.pooled_scores_prefill_reference(q[:, -512:], k[:, -512:], z, z + 512, 32)
    lse = _check_flash(q[:, -512:], k[:, -512:], None, False, tuning=tuning)[0]
    for cols in (0, 16):  # the score pass's software exp2 on part of the columns (needs the magic add kept apart;
        # the lse from the pass above: the reference's own, within 1e-3)
        sc = M.pooled_scores(q[:, -512:], k[:, -512:], lse, 32, tuning=M.MgpuTuning(scores_poly_exp2_cols=cols))
        assert _score_err(sc, ref) < 5e-3, (cols, _score_err(sc, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kvh,d", _GPU_SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float8_e4m3fn])
def test_gpu_lse_128_rows_a_warpgroup_4k(hq, kvh, d, dtype):
    """`MgpuTuning(lse_block_q=128)` on the GPU (two m64 products a warpgroup; registers as at 64 rows), bf16 and fp8
    operands, against the default pass on the same values."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    q, k, _ = _inputs(np.random.default_rng(SEED + 3), 1, 4096, hq, kvh, d, 4096, jnp.bfloat16, peaky=True)
    q, k = q.astype(dtype), k.astype(dtype)
    want = M.flash_lse(q, k, with_out=False)[1]
    got = M.flash_lse(q, k, with_out=False, tuning=M.MgpuTuning(lse_block_q=128))[1]
    assert float(jnp.max(jnp.abs(got - want))) < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("hq,kvh,d", _GPU_SHAPES)
@pytest.mark.parametrize("tile", [16, 32, 64])
def test_gpu_pooled_scores_4k(peaky, hq, kvh, d, tile):
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    t = 4096
    q, k, _ = _inputs(np.random.default_rng(SEED + tile), 1, t, hq, kvh, d, t, jnp.bfloat16, peaky=peaky)
    _, lse = M.flash_lse(q, k, with_out=False)
    sc = M.pooled_scores(q, k, lse, tile)
    z = jnp.zeros((1,), jnp.int32)
    ref, _ = R.pooled_scores_prefill_reference(q, k, z, z + t, tile)
    err = _score_err(sc, ref)
    assert err < 2e-3, err


_ANCHOR_SHAPES = [(14, 2, 64), (12, 2, 128), (32, 8, 128)]  # the 0.5B, 1.5B and 8B shapes


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kvh,d", _ANCHOR_SHAPES)
@pytest.mark.parametrize("dense_out,cudnn", [(False, False), (True, False), (True, True)])
def test_gpu_anchor_backends_4k(monkeypatch, hq, kvh, d, dense_out, cudnn):
    """anchor_prefill on the Mosaic GPU passes (anchor 0 with the Triton-free dense output, or with cuDNN's LSE
    feeding the Mosaic GPU scores) against the Triton backend and the references."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    calls = _spy(monkeypatch, "flash_lse", "pooled_scores")
    t = 4096
    _, same = _anchor_both(SEED + 70, 1, t, hq, kvh, d, 32, jnp.bfloat16, dense_out, [0], [t], t, interpret=False,
                           chunk_at_zero=cudnn)
    assert calls["flash_lse"] == (0 if cudnn else 1) and calls["pooled_scores"] >= 1, calls
    assert same > 0.95, same  # (near ties may swap: the LSE passes differ in rounding)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kvh,d", _ANCHOR_SHAPES)
def test_gpu_anchor_backends_32k(monkeypatch, hq, kvh, d):
    """At 32K (the score budget then spans several windows at the 8B shape; no reference: its scores would not fit)
    the two backends agree: counts exactly, index sets up to near ties, outputs within bf16 where the sets agree."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")

    calls = _spy(monkeypatch, "flash_lse", "pooled_scores")
    t = 32768
    q, k, v = _inputs(np.random.default_rng(SEED + 71), 1, t, hq, kvh, d, t, jnp.bfloat16, peaky=True)
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    kw = dict(topk_frac=0.1, min_k=128, k_max=R.max_budget(t, 0.1, 128), impl="pallas")
    res = [jax.jit(lambda q, k, v, be=be: P.anchor_prefill(q, k, v, qs, kl, kl, 32, tuning=P.PrefillTuning(
        anchor_backend=be), **kw))(q, k, v) for be in ("triton", "mgpu")]
    assert calls["flash_lse"] == 1 and calls["pooled_scores"] >= 1, calls
    (o_t, i_t, c_t), (o_m, i_m, c_m) = res
    np.testing.assert_array_equal(np.asarray(c_m), np.asarray(c_t))
    i_t, i_m, c = np.asarray(i_t), np.asarray(i_m), np.asarray(c_t)
    agree = np.array([set(a[:n]) == set(b[:n]) for a, b, n in zip(
        i_t.reshape(-1, i_t.shape[-1]), i_m.reshape(-1, i_m.shape[-1]), np.broadcast_to(c[:, None], i_t.shape[:3])
        .reshape(-1))]).reshape(i_t.shape[1:3])  # [kv heads, tiles]
    # A near tie swapped at a tile's budget edge changes that tile's rows by a key's share (session 20: up to 0.12 of
    # a row's RMS); the outputs are compared where the two selections agree, which is every other row.
    rows = agree[(np.arange(hq) // (hq // kvh))[None, :], (np.arange(t) // 32)[:, None]]  # [t, q heads]
    err = _row_err(np.asarray(o_m)[0][rows], np.asarray(o_t)[0][rows])
    print(f"32K {hq}/{kvh}/{d}: same index sets {agree.mean():.4f}, output row error vs Triton where they agree "
          f"{err:.2e}, over all rows {_row_err(o_m, o_t):.2e}")
    assert agree.mean() > 0.99 and err < _tol(jnp.bfloat16), (agree.mean(), err)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kvh,d", _ANCHOR_SHAPES[1:])
@pytest.mark.parametrize("dense_out", [False, True])
def test_gpu_anchor_traced_kv_len_4k(monkeypatch, hq, kvh, d, dense_out):
    """The models' call (jit, traced lengths, chunk_at_zero; anchor layer 0 through cuDNN) at 4K, whole and padded:
    the Mosaic GPU passes run and give the concrete-length call's results bit for bit."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    ran = _ran(monkeypatch)
    t = 4096
    q, k, v = _inputs(np.random.default_rng(SEED + 72), 1, t, hq, kvh, d, t, jnp.bfloat16, peaky=True)
    _check_traced(_anchor_jits(t, t, 32, dense_out, False), q, k, v, ran, pad=100)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kvh,d", _ANCHOR_SHAPES[1:])
@pytest.mark.parametrize("dense_out", [False, True])
def test_gpu_anchor_padded_chunk_4k(hq, kvh, d, dense_out):
    """A 4K chunk at 0 with 100 padding rows (the models pad a prompt to its chunk): the Mosaic GPU backend's counts,
    Top-k sets and outputs against the reference and the Triton backend (`_anchor_both`)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    t = 4096
    _, same = _anchor_both(SEED + 73, 1, t, hq, kvh, d, 32, jnp.bfloat16, dense_out, [0], [t - 100], t,
                           interpret=False, chunk_at_zero=True)
    assert same > 0.99, same


@pytest.mark.gpu
@pytest.mark.parametrize("peaky", [False, True])
@pytest.mark.parametrize("hq,kvh,d", _GPU_SHAPES)
@pytest.mark.parametrize("kb,tuning", [(8, None), (16, None), (16, M.ReuseTuning(steps=3)),
                                       (16, M.ReuseTuning(column_mask=False))])
def test_gpu_reuse_blocks_4k(peaky, hq, kvh, d, kb, tuning):
    """The block reuse on the GPU (P in registers, TMA block copies) against the reference, at 4K from position 0
    (column masks, the default, also with a 3-deep ring of 128-key steps and head 0 missing a block; without column
    masks)."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    err = _check_reuse_blocks(1, 4096, 4096, hq, kvh, d, 32, kb, [0], [4096], jnp.bfloat16, seed=kb, peaky=peaky,
                              interpret=False, frac=0.1, tuning=tuning, hole=tuning is not None)
    assert err < _tol(jnp.bfloat16), err


@pytest.mark.gpu
@pytest.mark.parametrize("hq,kvh,d", _GPU_SHAPES)
def test_gpu_reuse_blocks_32k_matches_triton(hq, kvh, d):
    """At 32K, batch 2 with a ragged second sequence (a chunk at 8200, not on a block boundary): the block reuse
    equals the Triton reuse kernel on the same expanded ids."""
    if jax.default_backend() != "gpu":
        pytest.skip("needs a GPU")
    t, tile, kb = 16384, 32, 16
    rng = np.random.default_rng(SEED + 99)
    q, k, v = _inputs(rng, 2, t, hq, kvh, d, 32768, jnp.bfloat16, peaky=True)
    q_start, kv_len = [16384, 8200], [32768, 8200 + t - 100]
    idx, counts = _block_selection(rng, 2, kvh, t // tile, tile, kb, q_start, kv_len, 0.1)
    qs, kl, hm = jnp.asarray(q_start, jnp.int32), jnp.asarray(kv_len, jnp.int32), jnp.arange(kvh, dtype=jnp.int32)
    out = jax.jit(lambda *a: M.reuse_blocks(*a, tile, kb))(q, k, v, qs, kl, idx, counts, hm)
    tri = jax.jit(lambda *a: P.reuse_prefill(*a, tile, impl="pallas"))(q, k, v, qs, kl, idx, counts, hm)
    rows = np.arange(t)[None, :] < (np.asarray(kv_len) - np.asarray(q_start))[:, None]
    err = _row_err(np.asarray(out)[rows], np.asarray(tri)[rows])
    print(f"32K {hq}/{kvh}/{d} kb {kb}: row error vs Triton {err:.2e}")
    assert err < _tol(jnp.bfloat16), err


@pytest.mark.parametrize("d", [128, 64])
def test_fp8_score_passes_interpret(interp, d):
    """float8_e4m3fn q and k (the score passes only: 128-byte swizzle at d 128, 64-byte at d 64): the LSE and the
    pooled scores are those of the fp8 values, i.e. the bf16 reference on the same values widened; the dense pass
    (P.V) refuses fp8 by name."""
    t, hq, kvh, tile = 256, 4, 2, 32
    q, k, _ = _inputs(np.random.default_rng(SEED + d), 1, t, hq, kvh, d, t, jnp.bfloat16, peaky=True)
    q8, k8 = q.astype(jnp.float8_e4m3fn), k.astype(jnp.float8_e4m3fn)
    qw, kw = q8.astype(jnp.bfloat16), k8.astype(jnp.bfloat16)  # exact: e4m3 values are bf16 values
    _, lse = M.flash_lse(q8, k8, with_out=False, interpret=interp)
    _, rl = _ref_lse2(qw, kw, kw)
    lse_err = float(np.abs(np.asarray(lse) - np.asarray(rl)).max())
    assert lse_err < _LSE_TOL, lse_err
    _, rl_bf16 = _ref_lse2(q, k, k)
    assert float(np.abs(np.asarray(rl) - np.asarray(rl_bf16)).max()) > 10 * _LSE_TOL  # fp8 did change the logits
    sc = M.pooled_scores(q8, k8, lse, tile, interpret=interp)
    z = jnp.zeros((1,), jnp.int32)
    ref, _ = R.pooled_scores_prefill_reference(qw, kw, z, z + t, tile)
    assert _score_err(sc, ref) < _SCORE_TOL
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float16"):
        M.flash_lse(q8, k8, k8, with_out=True, interpret=interp)
    assert M.unsupported_reason(q8, k8, tile) is not None and M.unsupported_reason(q8, k8, tile, fp8_ok=True) is None


def test_fp8_score_operands_with_scale_mult_interpret(interp):
    """`reference.fp8_score_operands` (k centred, power-of-two scales, `mult` undoing them) through both passes with
    scale_mult: the LSE and pooled scores of the widened operands (`reference.fp8_widen`), which are the bf16
    reference's up to the fp8 rounding; with mult = 1 the extra operand changes nothing."""
    t, hq, kvh, d, tile = 256, 4, 2, 64, 32
    q, k, _ = _inputs(np.random.default_rng(SEED + 7), 1, t, hq, kvh, d, t, jnp.bfloat16, peaky=True)
    q, k = q * 9.0, k * 0.3 + 2.0  # large q, k off-centre: the scales and the centring both matter
    q8, k8, mult = R.fp8_score_operands(q, k, jnp.full((1,), t, jnp.int32))
    assert q8.dtype == jnp.float8_e4m3fn and float(jnp.max(jnp.abs(q8.astype(jnp.float32)))) > 224
    qw, kw = R.fp8_widen(q8, mult, jnp.bfloat16), R.fp8_widen(k8, None, jnp.bfloat16)
    _, lse = M.flash_lse(q8, k8, with_out=False, interpret=interp, scale_mult=mult)
    _, rl = _ref_lse2(qw, kw, kw)
    assert float(np.abs(np.asarray(lse) - np.asarray(rl)).max()) < _LSE_TOL
    sc = M.pooled_scores(q8, k8, lse, tile, interpret=interp, scale_mult=mult)
    z = jnp.zeros((1,), jnp.int32)
    ref_w, _ = R.pooled_scores_prefill_reference(qw, kw, z, z + t, tile)
    assert _score_err(sc, ref_w) < _SCORE_TOL
    # The centring leaves the softmax as it was: near the unquantized scores (fp8 rounding of these large, peaky
    # logits moves them by ~20% RMS; without the per-row shift cancelling they would be unrelated, error ~1).
    ref, _ = R.pooled_scores_prefill_reference(q, k, z, z + t, tile)
    assert _score_err(sc, ref) < 0.4
    _, lse1 = M.flash_lse(q, k, with_out=False, interpret=interp, scale_mult=jnp.ones((1,)))
    _, lse0 = M.flash_lse(q, k, with_out=False, interpret=interp)
    assert np.array_equal(np.asarray(lse1), np.asarray(lse0))
    # The centring uses the valid keys only: rows past kv_len (here 1e4) change neither the valid k8 nor mult.
    kl = jnp.full((1,), 200, jnp.int32)
    dirty = k.at[:, 200:].set(1e4)
    a8, b8, ma = R.fp8_score_operands(q, k, kl)
    _, c8, mc = R.fp8_score_operands(q, dirty, kl)
    assert np.array_equal(np.asarray(b8[:, :200].astype(jnp.float32)), np.asarray(c8[:, :200].astype(jnp.float32)))
    assert float(ma[0]) == float(mc[0])
    mean = np.asarray(b8[:, :200].astype(jnp.float32)).mean(1)  # centred: per (head, channel) mean ~ 0
    assert np.abs(mean).max() < 0.05 * np.abs(np.asarray(b8.astype(jnp.float32))).max()
    with pytest.raises(ValueError, match="scale_mult must hold one number"):
        M.flash_lse(q, k, with_out=False, interpret=interp, scale_mult=jnp.ones((2,)))


@pytest.mark.parametrize("hq,kvh,d,tile", [(32, 8, 128, 32), (14, 2, 64, 16), (12, 2, 128, 32)])
def test_fp8_score_passes_lower_for_sm90(hq, kvh, d, tile):
    """The fp8 score passes through the Mosaic GPU lowering for sm_90a on the CPU (wgmma's fp8 operands must be
    K-major, with tiles of one swizzle width: interpret mode checks neither)."""
    q = jax.ShapeDtypeStruct((1, 4096, hq, d), jnp.float8_e4m3fn)
    k = jax.ShapeDtypeStruct((1, 4096, kvh, d), jnp.float8_e4m3fn)
    lse = jax.ShapeDtypeStruct((1, hq, 4096), jnp.float32)
    m = jax.ShapeDtypeStruct((1,), jnp.float32)
    for f, args in [(lambda q, k: M.flash_lse(q, k, with_out=False), (q, k)),
                    (lambda q, k, m: M.flash_lse(q, k, with_out=False, scale_mult=m), (q, k, m)),
                    (lambda q, k, l, m: M.pooled_scores(q, k, l, tile, scale_mult=m), (q, k, lse, m)),
                    (lambda q, k: M.flash_lse(q, k, with_out=False, tuning=M.MgpuTuning(lse_block_kv=128)), (q, k)),
                    (lambda q, k, l: M.pooled_scores(q, k, l, tile), (q, k, lse))]:
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "mosaic_gpu" in text


def test_anchor_prefill_score_fp8_interpret(monkeypatch, interp):
    """score_fp8: the Mosaic GPU backend runs both score passes on fp8 (q8, k8 cut to the chunk, scale_mult), the
    Triton backend and the reference on the same values widened; all three select a Top-k set of the scores of
    `reference.fp8_score_qk`'s operands, and the sparse output is the original q, k, v's on that set. The cache
    holds dirty rows past kv_len (they must not reach the centring). With dense_out the lever is ignored."""
    from tests.kernels_pallas.test_prefill import _check_idx

    seen = []
    orig = M.flash_lse
    monkeypatch.setattr(M, "flash_lse", lambda *a, **kw: seen.append((a[0].dtype, kw.get("scale_mult") is not None))
                        or orig(*a, **kw))
    t, max_len, tile = 128, 192, 32
    q, k, v = _inputs(np.random.default_rng(SEED + 70), 1, t, 4, 2, 64, max_len, jnp.bfloat16, peaky=True)
    k = k.at[:, t:].set(300.0)  # dirty rows past kv_len
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), t, jnp.int32)
    kw = dict(topk_frac=0.25, min_k=8, k_max=R.max_budget(max_len, 0.25, 8), interpret=True, score_fp8=True)
    q_s, k_s = R.fp8_score_qk(q, k, kl)
    scores, _ = R.pooled_scores_prefill_reference(q_s, k_s, qs, kl, tile)
    res = {}
    for name, extra in [("reference", dict(impl="reference")),
                        ("triton", dict(impl="pallas", tuning=P.PrefillTuning(anchor_backend="triton"))),
                        ("mgpu", dict(impl="pallas", tuning=P.PrefillTuning(anchor_backend="mgpu")))]:
        out, idx, counts = P.anchor_prefill(q, k, v, qs, kl, kl, tile, **kw, **extra)
        _check_idx(idx, counts, scores)
        ref_out = R.sparse_prefill_reference(q, k, v, qs, kl, idx, jnp.arange(2), tile)
        assert _row_err(out, ref_out) < _tol(jnp.bfloat16)
        res[name] = np.sort(np.asarray(idx), axis=-1)  # (a set: order unspecified)
    assert seen == [(jnp.dtype(jnp.float8_e4m3fn), True)], seen
    assert np.mean(res["mgpu"] == res["reference"]) > 0.99 and np.mean(res["triton"] == res["reference"]) > 0.99
    plain = P.anchor_prefill(q, k, v, qs, kl, kl, tile, **{**kw, "score_fp8": False}, impl="reference")[1]
    assert not np.array_equal(np.sort(np.asarray(plain), axis=-1), res["reference"])  # fp8 did move some selections
    d8 = P.anchor_prefill(q, k, v, qs, kl, kl, tile, **{**kw, "k_max": kw["k_max"]}, impl="reference",
                          dense_out=True)
    d0 = P.anchor_prefill(q, k, v, qs, kl, kl, tile, **{**kw, "score_fp8": False}, impl="reference", dense_out=True)
    np.testing.assert_array_equal(np.asarray(d8[1]), np.asarray(d0[1]))
