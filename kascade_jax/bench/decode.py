"""The decode-attention kernel benchmark: the Kascade kernels (A0: anchor layer 0 with the dense output, A: anchor,
R: reuse) against cuDNN dense decode in the same run, timed with CUPTI, in the paper's Table 3 layout, and the
kernels' check against the references at the benchmark's shape (Gaussian and peaky inputs).

Non-obvious: the weighted Kascade time (1*A0 + (M-1)*A + (L-M)*R)/L is what the speedup divides (`BenchShape`), and
it refuses to run without a GPU: CPU timings would mean nothing (`check` runs anywhere, interpret=True on a CPU).
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import sys
import time

from kascade_jax.bench import tables
from kascade_jax.bench.store import note_overwrite, output_stem, write_outputs
from kascade_jax.bench.timing import BenchShape, cupti_time, time_pieces

_DEFAULT = BenchShape()


def inputs(seed, b, s, hq, kvh, d, dtype, peaky):
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (b, 1, hq, d), jnp.float32)
    k = jax.random.normal(kk, (b, s, kvh, d), dtype)
    v = jax.random.normal(kv, (b, s, kvh, d), dtype)
    if peaky:
        # Plant 16 keys per (sequence, kv head) aligned with the group's mean query: logits ~ +8 above the bulk.
        g = hq // kvh
        qm = q.reshape(b, kvh, g, d).mean(axis=2)  # [batch, kv_heads, d]
        pos = jax.random.randint(kp, (b, kvh, 16), 0, s)
        bi = jnp.arange(b)[:, None, None]
        hi = jnp.arange(kvh)[None, :, None]
        k = k.at[bi, pos, hi].set(jnp.broadcast_to(3.0 * qm[:, :, None, :], (b, kvh, 16, d)).astype(dtype))
    return q.astype(dtype), k, v


def _rel_err(a, r) -> float:
    """|a - r| / |r| (Frobenius, fp32); a non-finite a fails."""
    import numpy as np

    a, r = np.asarray(a, np.float32), np.asarray(r, np.float32)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.linalg.norm(a - r) / np.linalg.norm(r))


def _set_gap(mine, theirs, sc) -> tuple[int, float]:
    """(keys in `mine` not in `theirs`, the score gap between the best key it missed and the worst it took, relative
    to the reference's lowest selected score; 0 for equal sets): how far from a near-tie a differing selection is."""
    a, r = set(mine.tolist()), set(theirs.tolist())
    if a == r:
        return 0, 0.0
    gap = float(sc[sorted(r - a)].max() - sc[sorted(a - r)].min()) / max(float(sc[theirs].min()), 1e-30)
    return len(a - r), gap


def check(seed=0, b=8, s=32768, hq=_DEFAULT.q_heads, kvh=_DEFAULT.kv_heads, d=_DEFAULT.head_dim, dtype="bfloat16",
          frac=0.1, min_k=128, peaky=False, ragged=True, interpret=False, tuning=None, log=print):
    """Compare A0, A, R (Pallas) with the references on fresh inputs; returns a dict of errors (raises on failure)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import decode as dec
    from kernels_pallas import reference as ref

    dt = jnp.dtype(dtype)
    q, k, v = inputs(seed, b, s, hq, kvh, d, dt, peaky)
    rng = np.random.default_rng(seed)
    kv_len = jnp.asarray(rng.integers(s // 2, s + 1, size=b) if ragged else np.full(b, s), jnp.int32)
    k_max = ref.max_budget(s, frac, min_k)
    hm = jnp.asarray(rng.permutation(kvh), jnp.int32)
    tuning = tuning or dec.DEFAULT_TUNING
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, interpret=interpret, tuning=tuning)
    rel = _rel_err
    out, idx, counts = jax.jit(lambda *a: dec.anchor_decode(*a, impl="pallas", **kw))(q, k, v, kv_len)
    out0, idx0, _ = jax.jit(lambda *a: dec.anchor_decode(*a, impl="pallas", dense_out=True, **kw))(q, k, v, kv_len)
    scores = jax.jit(lambda q, k, l: ref.pooled_scores_decode_reference(q, k, l))(q, k, kv_len)
    ref_idx = jax.jit(lambda sc, c: ref.select_topk_reference(sc, c[:, None], k_max))(scores, counts)
    ref_dense = jax.jit(lambda *a: ref.attention_reference(*a))(q, k, v, kv_len - 1, kv_len)
    ref_sparse = jax.jit(lambda *a: ref.sparse_decode_reference(*a))(q, k, v, kv_len, ref_idx, jnp.arange(kvh))
    reuse = jax.jit(lambda *a: dec.reuse_decode(*a, impl="pallas", interpret=interpret, tuning=tuning))
    r_out = reuse(q, k, v, kv_len, ref_idx, counts, hm)
    ref_reuse = jax.jit(lambda *a: ref.sparse_decode_reference(*a))(q, k, v, kv_len, ref_idx, hm)

    idx, idx0, ref_idx, scores, counts = map(np.asarray, (idx, idx0, ref_idx, scores, counts))
    assert np.array_equal(idx, idx0), "anchor-0 and anchor indices differ"
    n_diff, worst = 0, 0.0
    for bi in range(b):
        for h in range(kvh):
            mine = idx[bi, h][idx[bi, h] >= 0]
            theirs = ref_idx[bi, h][ref_idx[bi, h] >= 0]
            assert len(mine) == counts[bi] == len(theirs), (bi, h, len(mine), counts[bi], len(theirs))
            assert len(np.unique(mine)) == len(mine) and mine.max() < kv_len[bi], "bad indices"
            n_only, gap = _set_gap(mine, theirs, scores[bi, h])
            n_diff, worst = n_diff + n_only, max(worst, gap)
    errs = dict(anchor_out=rel(out, ref_sparse), anchor0_out=rel(out0, ref_dense), reuse_out=rel(r_out, ref_reuse),
                idx_differing=n_diff, idx_worst_rel_score_gap=worst)
    log(f"check b={b} s={s} hq={hq} kvh={kvh} d={d} {dtype} peaky={peaky} ragged={ragged}: {errs}")
    assert errs["anchor_out"] < 2e-2 and errs["anchor0_out"] < 2e-2 and errs["reuse_out"] < 2e-2, errs
    assert worst <= 1e-4, f"selection differs beyond near-ties: {errs}"
    return errs


def check_fp8(seed=0, b=8, s=32768, hq=_DEFAULT.q_heads, kvh=_DEFAULT.kv_heads, d=_DEFAULT.head_dim, frac=0.1,
              min_k=128, peaky=False, tuning=None, interpret=False, log=print):
    """The anchor on the fp8 K copy (`score_keys`, `reference.fp8_decode_keys`) against the reference on the copy
    widened (bf16, or float16 with `tuning.stream_fp8_f16`: the same logits; same index set up to near-ties, sparse
    output from bf16 K and V), and the share of the bf16 Top-k's pooled mass its selection keeps (worst and mean
    over sequences and heads); returns the numbers."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import decode as dec
    from kernels_pallas import reference as ref

    q, k, v = inputs(seed, b, s, hq, kvh, d, jnp.bfloat16, peaky)
    kv_len = jnp.asarray(np.random.default_rng(seed).integers(s // 2, s + 1, size=b), jnp.int32)
    k8, _, mult = jax.jit(ref.fp8_decode_keys)(k, kv_len)
    k_max = ref.max_budget(s, frac, min_k)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, interpret=interpret, tuning=tuning or dec.DEFAULT_TUNING)
    out, idx, counts = jax.jit(lambda q, k, v, l, k8, m: dec.anchor_decode(q, k, v, l, impl="pallas",
                                                                          score_keys=(k8, m), **kw))(
        q, k, v, kv_len, k8, mult)
    pooled = jax.jit(lambda q, k, l: ref.pooled_scores_decode_reference(q, k, l))
    wide = pooled(*ref.fp8_decode_qk(q, (k8, mult), k.dtype), kv_len)
    exact = pooled(q, k, kv_len)
    sel = jax.jit(lambda sc, c: ref.select_topk_reference(sc, c[:, None], k_max))
    ref_idx, exact_idx = sel(wide, counts), sel(exact, counts)
    ref_out = jax.jit(lambda *a: ref.sparse_decode_reference(*a))(q, k, v, kv_len, idx, jnp.arange(kvh))
    idx, ref_idx, exact_idx, wide, exact, counts = map(np.asarray, (idx, ref_idx, exact_idx, wide, exact, counts))
    worst_gap, recalls = 0.0, []
    for bi in range(b):
        for h in range(kvh):
            mine, theirs = idx[bi, h, :counts[bi]], ref_idx[bi, h, :counts[bi]]
            worst_gap = max(worst_gap, _set_gap(mine, theirs, wide[bi, h])[1])
            recalls.append(float(exact[bi, h][mine].sum() / exact[bi, h][exact_idx[bi, h, :counts[bi]]].sum()))
    err = _rel_err(out, ref_out)
    res = dict(peaky=peaky, fp8_f16=kw["tuning"].stream_fp8_f16, fp8_idx_worst_rel_score_gap=worst_gap, fp8_out_err=err,
               fp8_mass_recall_worst=min(recalls), fp8_mass_recall_mean=float(np.mean(recalls)))
    log(f"check fp8 K copy b={b} s={s} hq={hq} kvh={kvh} d={d} peaky={peaky}: {res}")
    assert worst_gap <= 1e-4 and err < 2e-2, f"fp8 anchor differs from its reference: {res}"
    return res


def fp8_row(row: dict, dense, q, k, v, kv_len, frac, min_k, iters, shape, tuning, log=print, f16=False) -> dict:
    """row["A_fp8"]: the anchor scoring on the fp8 K copy widened to bf16 (`score_keys`; the copy is made outside the
    timing: the cache keeps it), with the row's A0 and R, weighted_fp8 and speedup_fp8; with `f16`, also
    row["A_fp8f16"] (and its weighted / speedup): the same widened to float16 against a float16 q
    (`DecodeTuning.stream_fp8_f16`, the kernels' default)."""
    import jax

    from kernels_pallas import decode as dec
    from kernels_pallas import reference as ref

    k8, _, mult = jax.jit(ref.fp8_decode_keys)(k, kv_len)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=ref.max_budget(k.shape[1], frac, min_k), impl="pallas",
              tuning=tuning)
    variants = [("fp8", "fp8 K copy", dataclasses.replace(tuning, stream_fp8_f16=False))]
    if f16:
        variants.append(("fp8f16", "fp8 K copy, float16 dot", dataclasses.replace(tuning, stream_fp8_f16=True)))
    for t, name, tu in variants:
        fn = jax.jit(lambda q, k, v, l, k8, m, tu=tu: dec.anchor_decode(q, k, v, l, score_keys=(k8, m),
                                                                         **dict(kw, tuning=tu)))
        try:
            row[f"A_{t}"], row[f"A_{t}_kernels"] = cupti_time(fn, (q, k, v, kv_len, k8, mult), iters)
        except Exception as e:  # the new variant must not take the row's other numbers with it; it says so
            if t == "fp8":
                raise
            row[f"{t}_failed"] = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"   {name} FAILED: {row[f'{t}_failed']}")
            continue
        row[f"A0_{t}"], row[f"R_{t}"] = row["A0"], row["R"]
        row[f"weighted_{t}"] = shape.weighted(row["A0"], row[f"A_{t}"], row["R"])
        row[f"speedup_{t}"] = dense / row[f"weighted_{t}"]
        log(f"   {name}: A {row[f'A_{t}']:.4f} ({row[f'A_{t}'] / dense:.3f})  weighted {row[f'weighted_{t}']:.4f}  "
            f"speedup {row[f'speedup_{t}']:.2f}x")
        log(f"   A ({t}) kernels: " + ", ".join(f"{n[:40]}={ms:.4f}" for n, ms in row[f"A_{t}_kernels"].items()))
    del k8
    return row


def strategy_pieces(q, k, v, kv_len, frac, min_k, *, kernels="pallas", **levers):
    """The decode layers of a Kascade strategy with `levers` (e.g. decode_rerank=4), through the model's own path
    (`KascadeStrategy.attend`, so the rerank's candidate scoring and top-k are timed with the kernels):
    [("A0", fn, args), ("A", ...), ("R", ...)] and, with decode_rerank_layers=(3,), ("F", ...): each fn returns
    that layer's output. Layer 0 is the dense-output anchor (layer 1 reads it, so it selects), layer 2 an anchor,
    layers 3 and 4 reuse layers reading layer 2's state (identity head map); with decode_rerank_layers=(3,) layer 3
    reranks and layer 4 (F) attends the anchor's own Top-k among its candidates."""
    import jax

    from kascade_jax.registry import make_strategy
    from models.attention import AttentionInputs

    strat = make_strategy("kascade", 5, k.shape[2], anchors=(0, 2), topk_frac=frac, min_k=min_k, kernels=kernels,
                          **levers)

    def layer(i):
        def fn(q, k, v, kv_len, state):
            inputs = AttentionInputs(q=q, k_cache=k, v_cache=v, q_start=kv_len - 1, kv_len=kv_len, seq_len=kv_len,
                                     phase="decode")
            return strat.attend(i, inputs, state)
        return jax.jit(fn)

    state = layer(2)(q, k, v, kv_len, None)[1]
    out = lambda i: jax.jit(lambda *a: layer(i)(*a)[0])  # noqa: E731
    pieces = [("A0", out(0), (q, k, v, kv_len, None)), ("A", out(2), (q, k, v, kv_len, None)),
              ("R", out(3), (q, k, v, kv_len, state))]
    if levers.get("decode_rerank_layers") is not None:
        pieces.append(("F", out(4), (q, k, v, kv_len, state)))
    return pieces


def worst_weighted(shape, n_worst: int, a0: float, a: float, r: float, f: float) -> tuple[int, float]:
    """(reranking layers, weighted time) of the decode_rerank_worst mix: (A0 + (M-1) A + N R + (L-M-N) F) / L."""
    m, n = shape.num_anchors, shape.num_layers
    w = min(n_worst, n - m)
    return w, (a0 + (m - 1) * a + w * r + (n - m - w) * f) / n


def rerank_row(row: dict, dense, q, k, v, kv_len, frac, min_k, reranks, iters, shape, log=print,
               worst: int = 0) -> dict:
    """row[f"{piece}_rr{C}"] for each C in `reranks` (the decode_rerank lever through the strategy's path; every
    reuse layer reranks) and their weighted time and speedup over the row's dense, in the same run; with `worst`
    N, also row[f"{piece}_rr{C}w{N}"] (pieces A0, A, R, F: only N reuse layers rerank, `worst_weighted`)."""
    for c in reranks:
        for name, fn, args in strategy_pieces(q, k, v, kv_len, frac, min_k, decode_rerank=c):
            if name != "F":
                row[f"{name}_rr{c}"], row[f"{name}_rr{c}_kernels"] = cupti_time(fn, args, iters)
        row[f"weighted_rr{c}"] = shape.weighted(row[f"A0_rr{c}"], row[f"A_rr{c}"], row[f"R_rr{c}"])
        row[f"speedup_rr{c}"] = dense / row[f"weighted_rr{c}"]
        log(f"   rerank C={c}: A0 {row[f'A0_rr{c}']:.4f}  A {row[f'A_rr{c}']:.4f}  R {row[f'R_rr{c}']:.4f}  "
            f"weighted {row[f'weighted_rr{c}']:.4f}  speedup {row[f'speedup_rr{c}']:.2f}x")
        if worst:
            tag = f"rr{c}w{worst}"
            for name, fn, args in strategy_pieces(q, k, v, kv_len, frac, min_k, decode_rerank=c,
                                                  decode_rerank_layers=(3,)):
                row[f"{name}_{tag}"], row[f"{name}_{tag}_kernels"] = cupti_time(fn, args, iters)
            n_rr, row[f"weighted_{tag}"] = worst_weighted(shape, worst, *(row[f"{p}_{tag}"] for p in "A0 A R F".split()))
            row[f"speedup_{tag}"] = dense / row[f"weighted_{tag}"]
            log(f"   rerank C={c}, {n_rr} reranking layers: A0 {row[f'A0_{tag}']:.4f}  A {row[f'A_{tag}']:.4f}  "
                f"R {row[f'R_{tag}']:.4f}  F {row[f'F_{tag}']:.4f}  weighted {row[f'weighted_{tag}']:.4f}  "
                f"speedup {row[f'speedup_{tag}']:.2f}x")
    return row


def pool_row(row: dict, dense, q, k, v, kv_len, frac, min_k, pools, iters, shape, log=print) -> dict:
    """row[f"{piece}_pool{P}"] for each pool P in `pools` ("gqa": Kascade's per-KV-head selection, "all":
    all_heads_pooled's one set shared by every head) through the strategy's path, with their weighted time and
    speedup over the row's dense: the strategy-path pair compares the two selections like for like (the plain
    row times the kernels alone)."""
    for p in pools:
        for name, fn, args in strategy_pieces(q, k, v, kv_len, frac, min_k, pool=p):
            row[f"{name}_pool{p}"], row[f"{name}_pool{p}_kernels"] = cupti_time(fn, args, iters)
        row[f"weighted_pool{p}"] = shape.weighted(row[f"A0_pool{p}"], row[f"A_pool{p}"], row[f"R_pool{p}"])
        row[f"speedup_pool{p}"] = dense / row[f"weighted_pool{p}"]
        log(f"   pool={p}: A0 {row[f'A0_pool{p}']:.4f}  A {row[f'A_pool{p}']:.4f}  R {row[f'R_pool{p}']:.4f}  "
            f"weighted {row[f'weighted_pool{p}']:.4f}  speedup {row[f'speedup_pool{p}']:.2f}x")
    return row


_SHORT_SPEC = re.compile(r"(\d+)(?:w(\d+))?(?:d(\d+))?(?:r(\d+))?(c)?")


def short_select_tuning(spec: str, base=None):
    """A --decode_short_select value N[wW][dD][rR][c] -> `base` (default tuning) with short_select_max N and, if
    given, short_select_warps W, short_select_digit D, short_select_rows R and (c) fused_combine on. ValueError if
    malformed or out of range (DecodeTuning's check)."""
    from kernels_pallas import decode as dec

    m = _SHORT_SPEC.fullmatch(str(spec).strip())
    if not m:
        raise ValueError(f"a short select value is N[wW][dD][rR][c] (e.g. 32768, 16384w16d2, 32768r1024, 32768c), "
                         f"got {spec!r}")
    over = dict(short_select_max=int(m.group(1)))
    if m.group(2):
        over["short_select_warps"] = int(m.group(2))
    if m.group(3):
        over["short_select_digit"] = int(m.group(3))
    if m.group(4):
        over["short_select_rows"] = int(m.group(4))
    if m.group(5):
        over["fused_combine"] = True
    return dataclasses.replace(base or dec.DEFAULT_TUNING, **over)


def short_select_row(row: dict, dense, q, k, v, kv_len, frac, min_k, specs, pools, iters, shape, tuning,
                     log=print, reuse_args=None) -> dict:
    """row[f"{piece}_ss{spec}_{pool}"] for pieces A0, A and R with the tuning of each --decode_short_select spec
    (`short_select_tuning`) and each pool, through the kernels' entry point like the row's own pieces: A0 and A (the
    anchors, which run the select) re-timed; R re-timed (reuse_args: the row's idx, counts and head map) where the
    spec changes the combine (c), else the row's (the select does not touch it)."""
    import jax

    from kernels_pallas import decode as dec
    from kernels_pallas import reference as ref

    k_max = ref.max_budget(k.shape[1], frac, min_k)
    for spec in specs:
        t = short_select_tuning(spec, tuning)
        r_time = (row["R"], row["R_kernels"])
        if t.fused_combine != (tuning or dec.DEFAULT_TUNING).fused_combine:
            re_t = jax.jit(lambda q, k, v, l, i, c, m: dec.reuse_decode(q, k, v, l, i, c, m, impl="pallas", tuning=t))
            r_time = cupti_time(re_t, (q, k, v, kv_len, *reuse_args), iters)
        for p in pools:
            tag = f"ss{spec}_{p}"
            kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, impl="pallas", pool=p, tuning=t)
            for name, dense_out in (("A0", True), ("A", False)):
                fn = jax.jit(lambda q, k, v, l, d=dense_out: dec.anchor_decode(q, k, v, l, dense_out=d, **kw))
                row[f"{name}_{tag}"], row[f"{name}_{tag}_kernels"] = cupti_time(fn, (q, k, v, kv_len), iters)
            row[f"R_{tag}"], row[f"R_{tag}_kernels"] = r_time
            row[f"weighted_{tag}"] = shape.weighted(row[f"A0_{tag}"], row[f"A_{tag}"], row[f"R_{tag}"])
            row[f"speedup_{tag}"] = dense / row[f"weighted_{tag}"]
            log(f"   short select {spec}, pool={p}: A0 {row[f'A0_{tag}']:.4f}  A {row[f'A_{tag}']:.4f}  "
                f"R {row[f'R_{tag}']:.4f}  weighted {row[f'weighted_{tag}']:.4f}  speedup {row[f'speedup_{tag}']:.2f}x")
    return row


def reuse_tunings(spec: str, base=None) -> list:
    """A --decode_reuse_sweep value "field=value,...;field=value,..." -> [(spec text, DecodeTuning)]: each
    ';'-separated override of the reuse kernel's fields (reuse_block, reuse_splits, reuse_warps, reuse_stages) applied
    to `base`; another field is refused (the sweep re-times only A and R, and A0's dense pass must not change)."""
    from kernels_pallas import decode as dec

    out = []
    for part in (p.strip() for p in spec.split(";")):
        if not part:
            continue
        fields = {kv.split("=", 1)[0].strip() for kv in part.split(",")}
        bad = fields - {"reuse_block", "reuse_splits", "reuse_warps", "reuse_stages"}
        if bad:
            raise ValueError(f"reuse sweep setting {part!r}: only the reuse kernel's fields (reuse_block, "
                             f"reuse_splits, reuse_warps, reuse_stages), got {sorted(bad)}")
        out.append((part, dec.tuning_from_string(part, base or dec.DEFAULT_TUNING)))
    return out


def reuse_row(row: dict, dense, q, k, v, kv_len, frac, min_k, sweep, iters, shape, reuse_args, log=print) -> dict:
    """row[f"{piece}_rs{i}"] for pieces A and R with each reuse tuning of `sweep` ([(text, DecodeTuning)] from
    `reuse_tunings`): the reuse layers (R; reuse_args: the row's idx, counts and head map) and the anchors, whose sparse
    output is the same reuse kernel (A); A0 (dense output, no reuse kernel) is the row's. row["reuse_sweep"] maps the
    suffixes to the settings."""
    import jax

    from kernels_pallas import decode as dec
    from kernels_pallas import reference as ref

    k_max = ref.max_budget(k.shape[1], frac, min_k)
    row["reuse_sweep"] = {}
    for i, (text, t) in enumerate(sweep):
        tag = f"rs{i}"
        row["reuse_sweep"][tag] = text
        re_t = jax.jit(lambda q, k, v, l, i, c, m, t=t: dec.reuse_decode(q, k, v, l, i, c, m, impl="pallas", tuning=t))
        row[f"R_{tag}"], row[f"R_{tag}_kernels"] = cupti_time(re_t, (q, k, v, kv_len, *reuse_args), iters)
        kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, impl="pallas", tuning=t)
        fn = jax.jit(lambda q, k, v, l: dec.anchor_decode(q, k, v, l, **kw))
        row[f"A_{tag}"], row[f"A_{tag}_kernels"] = cupti_time(fn, (q, k, v, kv_len), iters)
        row[f"A0_{tag}"] = row["A0"]
        row[f"weighted_{tag}"] = shape.weighted(row["A0"], row[f"A_{tag}"], row[f"R_{tag}"])
        row[f"speedup_{tag}"] = dense / row[f"weighted_{tag}"]
        log(f"   reuse {text}: A {row[f'A_{tag}']:.4f}  R {row[f'R_{tag}']:.4f} ({row[f'R_{tag}'] / dense:.3f})  "
            f"weighted {row[f'weighted_{tag}']:.4f}  speedup {row[f'speedup_{tag}']:.2f}x")
    return row


def cache_bytes(b, s, shape, itemsize):
    """Bytes of the K and V caches of b sequences of s tokens."""
    return 2 * b * s * shape.kv_heads * shape.head_dim * itemsize


def bench_one(b, s, frac, dtype, min_k, iters, tuning=None, log=print, shape=_DEFAULT, reranks=(), rerank_worst=0,
              pools=(), short_selects=(), score_fp8=False, score_fp8_f16=False, reuse_sweep=()):
    """One row: dense (cuDNN), A0, A and R at batch b and context s (every sequence full), their ratios to dense,
    the weighted Kascade time and its speedup, and each piece's kernels; with `reranks`, the same through the
    strategy with decode_rerank C (`rerank_row`); with `pools`, through the strategy with each selection pool
    (`pool_row`); with `short_selects`, the anchors at each short select setting (`short_select_row`, each of
    `pools`, else gqa); with `score_fp8`, the anchor on the fp8 K copy (`fp8_row`; `score_fp8_f16`: also widened to
    float16); with `reuse_sweep` ([(text, DecodeTuning)]), A and R at each reuse kernel tuning (`reuse_row`)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import decode as dec
    from kernels_pallas import reference as ref

    tuning = tuning or dec.DEFAULT_TUNING
    dt = jnp.dtype(dtype)
    q, k, v = inputs(1, b, s, shape.q_heads, shape.kv_heads, shape.head_dim, dt, peaky=False)
    kv_len = jnp.full((b,), s, jnp.int32)
    k_max = ref.max_budget(s, frac, min_k)
    hm = jnp.arange(shape.kv_heads, dtype=jnp.int32)[::-1]
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, impl="pallas", tuning=tuning)
    dense = jax.jit(lambda q, k, v, l: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=l, implementation="cudnn"))
    a0 = jax.jit(lambda q, k, v, l: dec.anchor_decode(q, k, v, l, dense_out=True, **kw))
    an = jax.jit(lambda q, k, v, l: dec.anchor_decode(q, k, v, l, **kw))
    _, idx, counts = an(q, k, v, kv_len)
    re = jax.jit(lambda q, k, v, l, i, c, m: dec.reuse_decode(q, k, v, l, i, c, m, impl="pallas", tuning=tuning))
    row = dict(batch=b, context=s, topk_frac=frac, dtype=dtype, k=int(counts[0]), **shape.record())
    time_pieces(row, (("dense", dense, (q, k, v, kv_len)), ("A0", a0, (q, k, v, kv_len)), ("A", an, (q, k, v, kv_len)),
                      ("R", re, (q, k, v, kv_len, idx, counts, hm))), iters, shape)
    kv_bytes = cache_bytes(b, s, shape, dt.itemsize)
    row["dense_TBps"] = kv_bytes / row["dense"] / 1e9
    log(f"b={b:3d} s={s:7d} k={frac:g} {dtype}: dense {row['dense']:.4f}  A0 {row['A0']:.4f} ({row['A0/dense']:.3f})  "
        f"A {row['A']:.4f} ({row['A/dense']:.3f})  R {row['R']:.4f} ({row['R/dense']:.3f})  "
        f"weighted {row['weighted']:.4f}  speedup {row['speedup']:.2f}x")
    log("   A kernels: " + ", ".join(f"{n[:40]}={t:.4f}" for n, t in row["A_kernels"].items()))
    if score_fp8:
        fp8_row(row, row["dense"], q, k, v, kv_len, frac, min_k, iters, shape, tuning, log, f16=score_fp8_f16)
    if reuse_sweep:
        reuse_row(row, row["dense"], q, k, v, kv_len, frac, min_k, reuse_sweep, iters, shape, (idx, counts, hm), log)
    if reranks:
        rerank_row(row, row["dense"], q, k, v, kv_len, frac, min_k, reranks, iters, shape, log, worst=rerank_worst)
    if pools:
        pool_row(row, row["dense"], q, k, v, kv_len, frac, min_k, pools, iters, shape, log)
    if short_selects:
        short_select_row(row, row["dense"], q, k, v, kv_len, frac, min_k, short_selects, pools or ("gqa",), iters,
                         shape, tuning, log, reuse_args=(idx, counts, hm))
    del q, k, v
    return row


def run(contexts, batches, fracs, dtypes, *, min_k=128, iters=10, do_check=True, out_dir="benchmarks",
        max_cache_gb=80.0, tuning=None, shape=_DEFAULT, tag="", reranks=(), rerank_worst=0, pools=(),
        short_selects=(), score_fp8=False, score_fp8_f16=False, reuse_sweep=(), log=print):
    """Time every (dtype, batch, context, top-k) on the GPU, after the checks (do_check; also one per short select
    setting, at 32K); writes <out_dir>/decode[_<tag>].json/md/png and returns the rows. Shapes whose caches exceed
    max_cache_gb are skipped, a failing one is logged and the sweep goes on. score_fp8_f16 (with score_fp8): the fp8
    rows also widened to float16, after its own check (a failed check is recorded and drops that variant only)."""
    if score_fp8_f16 and not score_fp8:
        raise ValueError("score_fp8_f16 times a variant of the fp8 rows: it needs score_fp8")
    import jax

    stem = output_stem("decode", tag, shape)  # refuses before any timing: untagged files hold the default shape
    if jax.default_backend() != "gpu":
        raise ValueError(f"bench_decode needs a GPU, found backend {jax.default_backend()!r}")
    note_overwrite(out_dir, stem, shape, log)
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=jax.devices()[0].device_kind, jax=jax.__version__, command=" ".join(sys.argv), tuning=repr(tuning),
                shape=shape.record())
    checks = []
    if do_check:
        for peaky in (False, True):
            checks.append(check(seed=int(time.time()) % 10000, hq=shape.q_heads, kvh=shape.kv_heads, d=shape.head_dim,
                                peaky=peaky, tuning=tuning, log=log))
        checks.append(check(seed=3, b=3, s=20000, hq=12, kvh=4, d=64, dtype="float16", frac=0.2, min_k=16, peaky=True,
                            tuning=tuning, log=log))
        from kernels_pallas import decode as dec

        if score_fp8:
            for peaky in (False, True):
                checks.append(check_fp8(seed=5, hq=shape.q_heads, kvh=shape.kv_heads, d=shape.head_dim, peaky=peaky,
                                        tuning=dataclasses.replace(tuning or dec.DEFAULT_TUNING,
                                                                   stream_fp8_f16=False), log=log))
        if score_fp8_f16:
            t = dataclasses.replace(tuning or dec.DEFAULT_TUNING, stream_fp8_f16=True)
            for peaky in (False, True):
                try:
                    checks.append(check_fp8(seed=5, hq=shape.q_heads, kvh=shape.kv_heads, d=shape.head_dim,
                                            peaky=peaky, tuning=t, log=log))
                except Exception as e:  # recorded; the float16 variant is then not timed
                    checks.append(dict(peaky=peaky, fp8_f16=True, failed=f"{type(e).__name__}: {str(e)[:400]}"))
                    log(f"check fp8 via float16 FAILED (the variant is not timed): {checks[-1]['failed']}")
                    score_fp8_f16 = False
        for spec in short_selects:  # once per setting other than the run's own tuning (checked above)
            t = short_select_tuning(spec, tuning)
            if t != (tuning or dec.DEFAULT_TUNING):
                checks.append(check(seed=4, hq=shape.q_heads, kvh=shape.kv_heads, d=shape.head_dim, peaky=True,
                                    tuning=t, log=log))
        for _, t in reuse_sweep:  # each reuse tuning against the references once
            checks.append(check(seed=6, hq=shape.q_heads, kvh=shape.kv_heads, d=shape.head_dim, peaky=True, tuning=t,
                                log=log))
    rows = []
    from tqdm import tqdm

    plan = [(dtype, b, s, f) for dtype in dtypes for b in batches for s in contexts for f in fracs]
    for dtype, b, s, f in tqdm(plan, desc="decode benchmark", unit="config", file=sys.stderr):
        if cache_bytes(b, s, shape, 2) / 1e9 > max_cache_gb:
            log(f"skip b={b} s={s} k={f}: caches over {max_cache_gb} GB")
            continue
        try:
            rows.append(bench_one(b, s, f, dtype, min_k, iters, tuning, log, shape=shape, reranks=reranks,
                                  rerank_worst=rerank_worst, pools=pools, short_selects=short_selects,
                                  score_fp8=score_fp8, score_fp8_f16=score_fp8_f16,
                                  reuse_sweep=reuse_sweep))
        except Exception as e:  # keep the sweep going; the failure is reported
            log(f"FAILED b={b} s={s} k={f} {dtype}: {type(e).__name__}: {str(e)[:400]}")
    write_outputs(out_dir, stem, dict(meta=meta, checks=checks, rows=rows), tables.decode_markdown(rows, meta, shape),
                  (lambda path: tables.decode_plot(rows, path, shape)) if rows else None, log=log)
    return rows
