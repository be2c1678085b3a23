"""The prefill-attention kernel benchmark: the Kascade kernels (A0, A, R) against cuDNN causal flash attention in
the same run, timed with CUPTI, in the paper's Table 3 layout, with the anchor pipeline's extra device memory; the
kernels' check against the references; and the tuning tools (`tune`: pick the fastest variant per kernel group;
`sweep`: A/B tuning variants against a base).

Non-obvious: a sweep variant re-times only the pieces its fields can change (`_parts`) and takes the base's time
for the rest, so its weighted time is an estimate. Refuses to run without a GPU (`check` runs anywhere with
interpret=True).
"""

from __future__ import annotations

import datetime
import sys

from kascade_jax.bench import tables
from kascade_jax.bench.store import note_overwrite, output_stem, write_outputs
from kascade_jax.bench.timing import BenchShape, cupti_time, time_pieces

_DEFAULT = BenchShape()


def inputs(seed, s, dtype, peaky=False, shape=_DEFAULT):
    import jax
    import jax.numpy as jnp

    kq, kk, kv, kp = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(kq, (1, s, shape.q_heads, shape.head_dim), jnp.float32)
    k = jax.random.normal(kk, (1, s, shape.kv_heads, shape.head_dim), jnp.float32)
    v = jax.random.normal(kv, (1, s, shape.kv_heads, shape.head_dim), dtype)
    if peaky:  # 64 keys aligned with the mean query of every head: strongly preferred by all tiles
        hot = jax.random.randint(kp, (64,), 0, s)
        qm = q.mean(axis=(1, 2))[:, None, None, :]
        k = k.at[:, hot].add(3.0 * qm / jnp.abs(qm).mean())
        q = q * 2.0
    return q.astype(dtype), k.astype(dtype), v


def _k_max(s, frac, min_k, key_block):
    """The anchors' index width at context s (`reference.index_width`, as the strategies' `static_k_max`)."""
    from kernels_pallas import reference as ref

    return min(ref.index_width(ref.max_budget(s, frac, min_k), key_block), s)


def check(seed=0, s=8192, dtype="bfloat16", frac=0.1, min_k=128, tile=32, peaky=False, tuning=None, log=print,
          shape=_DEFAULT, interpret=False, key_block=1, score_fp8=False):
    """A0, A, R against the references at one shape; returns errors (raises on failure). interpret=True runs the
    Pallas kernels on the CPU (tests, small s). key_block > 1: the index checks compare block scores and block ids.
    score_fp8: A selects on the fp8 operands' scores (`reference.fp8_score_qk`), A0 on the exact ones."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import prefill as pf
    from kernels_pallas import reference as ref

    q, k, v = inputs(seed, s, jnp.dtype(dtype), peaky, shape)
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), s, jnp.int32)
    k_max = _k_max(s, frac, min_k, key_block)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, impl="pallas", tuning=tuning, interpret=interpret,
              key_block=key_block, score_fp8=score_fp8)
    out, idx, counts = jax.jit(lambda q, k, v: pf.anchor_prefill(q, k, v, qs, kl, kl, tile, **kw))(q, k, v)
    out0, idx0, _ = jax.jit(lambda q, k, v: pf.anchor_prefill(q, k, v, qs, kl, kl, tile, dense_out=True,
                                                              chunk_at_zero=True, **kw))(q, k, v)
    hm = jnp.asarray(np.random.default_rng(seed).permutation(shape.kv_heads), jnp.int32)
    reuse = jax.jit(lambda *a: pf.reuse_prefill(*a, tile, impl="pallas", tuning=tuning, interpret=interpret,
                                                key_block=key_block))
    r_out = reuse(q, k, v, qs, kl, idx, counts, hm)
    score_fn = jax.jit(lambda q, k: ref.pooled_scores_prefill_reference(q, k, qs, kl, tile)[0])
    scores0 = score_fn(q, k)
    scores = score_fn(*ref.fp8_score_qk(q, k, kl)) if score_fp8 else scores0
    ref_dense = jax.jit(lambda q, k, v: ref.attention_reference(q, k, v, qs, kl))(q, k, v)
    ref_sparse = jax.jit(lambda q, k, v, i, m: ref.sparse_prefill_reference(q, k, v, qs, kl, i, m, tile))
    rel = lambda a, r: float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(r, np.float32))
                             / np.linalg.norm(np.asarray(r, np.float32)))
    errs = dict(anchor_out=rel(out, ref_sparse(q, k, v, idx, jnp.arange(shape.kv_heads))),
                anchor0_out=rel(out0, ref_dense),
                reuse_out=rel(r_out, ref_sparse(q, k, v, idx, hm)))
    if key_block > 1:  # compare blocks: block scores, each selected block's first id / kb
        scores, scores0 = (ref.block_scores(x, key_block) for x in (scores, scores0))
        idx, idx0 = (jnp.where(x[..., ::key_block] >= 0, x[..., ::key_block] // key_block, -1) for x in (idx, idx0))
        counts = counts // key_block
    idx, idx0, counts = map(np.asarray, (idx, idx0, counts))
    k_max = idx.shape[-1]
    ranks = np.arange(k_max)
    valid = np.broadcast_to(ranks < counts[:, None, :, None], idx.shape)
    # Anchor 0's indices equal anchor's, unless its LSE came from cuDNN (then they may differ at near-ties only) or
    # the anchor scores on fp8.
    for name, ix, sc in (("", idx, scores), ("anchor0_", idx0, scores0)):
        sc = np.asarray(sc)
        best = np.where(valid, -np.sort(-sc, -1)[..., :k_max], -np.inf)
        fin = np.isfinite(best)
        ref_idx = np.asarray(ref.select_topk_reference(jnp.asarray(sc), jnp.asarray(counts)[:, None, :], k_max))
        assert np.all(ix[~valid] == -1) and np.all(ix[valid] >= 0)
        picked = np.where(valid, np.take_along_axis(sc, np.maximum(ix, 0), -1), -np.inf)
        assert np.all(np.isfinite(picked[valid])), "ineligible key selected"
        mine = -np.sort(-picked, -1)
        errs[name + "max_rel_sorted_score_diff"] = float(np.max(np.abs(mine[fin] - best[fin]) /
                                                             np.maximum(best[fin], 1e-30)))
        same = [set(a[a >= 0].tolist()) == set(b[b >= 0].tolist())
                for a, b in zip(ix.reshape(-1, k_max), ref_idx.reshape(-1, k_max))]
        errs[name + "exact_set_fraction"] = float(np.mean(same))
    errs["anchor0_same_idx_as_anchor"] = bool(np.array_equal(idx, idx0))
    if not (tuning and tuning.anchor0_cudnn) and not score_fp8:
        assert errs["anchor0_same_idx_as_anchor"], "anchor-0 and anchor indices differ"
    log(f"check s={s} heads={shape.heads} {dtype} tile={tile} key_block={key_block} score_fp8={score_fp8} "
        f"peaky={peaky}: {errs}")
    assert max(errs["anchor_out"], errs["anchor0_out"], errs["reuse_out"]) < 2e-2, errs
    assert max(errs["max_rel_sorted_score_diff"], errs["anchor0_max_rel_sorted_score_diff"]) < 1e-3, errs
    return errs


def _extra_bytes(fn, args):
    """XLA temp allocation of the compiled function (bytes): device memory beyond its inputs and outputs."""
    try:
        ma = fn.lower(*args).compile().memory_analysis()
        return int(ma.temp_size_in_bytes), int(ma.output_size_in_bytes)
    except Exception:  # noqa: BLE001 - memory analysis is best effort on some backends
        return -1, -1


def bench_one(s, frac, dtype, min_k, tile, iters, tuning=None, log=print, shape=_DEFAULT, key_block=1,
              score_fp8=False):
    """One row at batch 1, context s: dense (cuDNN), A0, A and R, their ratios, the weighted time and speedup, each
    piece's kernels, and the extra device memory of the compiled anchor pipelines."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import prefill as pf
    from kernels_pallas import reference as ref

    dt = jnp.dtype(dtype)
    q, k, v = inputs(1, s, dt, shape=shape)
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), s, jnp.int32)
    k_max = _k_max(s, frac, min_k, key_block)
    hm = jnp.arange(shape.kv_heads, dtype=jnp.int32)[::-1]
    kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, impl="pallas", tuning=tuning, key_block=key_block,
              score_fp8=score_fp8)
    dense = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    a0 = jax.jit(lambda q, k, v: pf.anchor_prefill(q, k, v, qs, kl, kl, tile, dense_out=True, chunk_at_zero=True, **kw))
    an = jax.jit(lambda q, k, v: pf.anchor_prefill(q, k, v, qs, kl, kl, tile, **kw))
    re = jax.jit(lambda q, k, v, i, c, m: pf.reuse_prefill(q, k, v, qs, kl, i, c, m, tile, impl="pallas",
                                                           tuning=tuning, key_block=key_block))
    _, idx, counts = an(q, k, v)
    row = dict(context=s, topk_frac=frac, dtype=dtype, tile=tile, key_block=key_block, score_fp8=score_fp8,
               k_last_tile=int(counts[0, -1]),
               k_max=k_max, **shape.record())
    row["A_extra_bytes"], row["A_out_bytes"] = _extra_bytes(an, (q, k, v))
    row["A0_extra_bytes"], _ = _extra_bytes(a0, (q, k, v))
    time_pieces(row, (("dense", dense, (q, k, v)), ("A0", a0, (q, k, v)), ("A", an, (q, k, v)),
                      ("R", re, (q, k, v, idx, counts, hm))), iters, shape)
    row["dense_TFLOPs"] = 4 * s * s * shape.head_dim * shape.q_heads / 2 / row["dense"] / 1e9
    log(f"s={s:7d} k={frac:g} {dtype}: dense {row['dense']:.3f}  A0 {row['A0']:.3f} ({row['A0/dense']:.3f})  "
        f"A {row['A']:.3f} ({row['A/dense']:.3f})  R {row['R']:.3f} ({row['R/dense']:.3f})  "
        f"weighted {row['weighted']:.3f}  speedup {row['speedup']:.2f}x  A extra {row['A_extra_bytes'] / 1e9:.2f} GB")
    for name in ("A0", "A", "R"):
        log(f"   {name} kernels: " + ", ".join(f"{n[:40]}={t:.3f}" for n, t in row[name + "_kernels"].items()))
    del q, k, v, idx
    return row


# Variants timed by --prefill_tune: each field group (dense_*, scores_*, select_*, reuse_*) is picked independently.
_VARIANTS = [
    dict(dense_block_k=64, dense_stages=3, lse_block_k=128, lse_stages=2, scores_block_k=128, scores_stages=2,
         select_block=1024, select_warps=4, select_stages=3, select_nb=16, reuse_block_k=128, reuse_stages=3),
    dict(dense_block_k=64, dense_stages=2, lse_block_k=64, lse_stages=2, scores_block_k=128, scores_stages=3,
         select_block=1024, select_warps=4, select_stages=3, select_nb=8, reuse_block_k=128, reuse_stages=4),
    dict(dense_block_k=128, dense_stages=2, lse_block_k=128, lse_stages=3, scores_block_k=64, scores_stages=2,
         select_block=2048, select_warps=4, select_stages=3, select_nb=8, reuse_block_k=64, reuse_stages=3,
         reuse_warps=4),
    dict(dense_block_k=64, dense_stages=4, lse_block_k=64, lse_stages=3, scores_block_k=128, scores_stages=4,
         select_block=512, select_warps=4, select_stages=4, select_nb=8, reuse_block_k=128, reuse_stages=2,
         reuse_warps=4),
]
_GROUPS = {"dense": ("kascade_prefill_dense",), "lse": ("kascade_prefill_lse",), "scores": ("kascade_prefill_pooled_scores",),
           "select": ("kascade_prefill_select",), "reuse": ("kascade_prefill_reuse",)}


def tune(s, dtype, min_k, tile, iters, log=print, shape=_DEFAULT):
    """Time every variant at context s (top-k 10%); return the PrefillTuning made of the fastest field groups."""
    from kernels_pallas import prefill as pf

    results = []
    for i, var in enumerate(_VARIANTS):
        try:
            row = bench_one(s, 0.1, dtype, min_k, tile, iters, tuning=pf.PrefillTuning(**var), log=log, shape=shape)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is skipped
            log(f"variant {i} FAILED {type(e).__name__}: {str(e)[:300]}")
            continue
        per = {}
        for name in ("A0", "A", "R"):
            for kn, t in row[name + "_kernels"].items():
                per.setdefault(kn, []).append(t)
        per = {kn: min(ts) for kn, ts in per.items()}
        times = {g: sum(v for kn, v in per.items() if any(kn.startswith(p) for p in pre)) for g, pre in _GROUPS.items()}
        log(f"variant {i}: " + ", ".join(f"{g} {t:.3f}" for g, t in times.items()))
        results.append((var, times))
    if not results:
        raise RuntimeError(f"--prefill_tune={s}: every tuning variant failed (see the log above)")
    best = {}
    for g in _GROUPS:
        var, _ = min(results, key=lambda r: r[1][g])
        best.update({f: v for f, v in var.items() if f.startswith(g)})
    log(f"tuned: {best}")
    return pf.PrefillTuning(**best), [dict(variant=v, ms=t) for v, t in results]


def _parts(tuning, base):
    """Which timed pieces a tuning variant can change (relative to the base tuning)."""
    import dataclasses

    changed = {f for f, v in dataclasses.asdict(tuning).items() if getattr(base, f) != v}
    parts = {"R"} if any(f.startswith("reuse_") for f in changed) else set()
    if changed & {"anchor0_cudnn", "anchor_backend"} or any(f.startswith(("dense_", "scores_", "select_"))
                                                          for f in changed):
        parts.add("A0")
    if "anchor_backend" in changed or any(f.startswith(("lse_", "scores_", "select_")) for f in changed):
        parts.add("A")
    return parts


def sweep(contexts, specs, dtype, frac, min_k, tile, iters, base_spec="", log=print, shape=_DEFAULT, key_block=1,
          score_fp8=False):
    """A/B tuning variants (each applied on top of base_spec) against the base tuning, one context at a time; returns
    rows (one per context x spec).

    The base tuning times dense (cuDNN), A0, A and R; a variant re-times only the pieces it can change, and its
    weighted estimate takes the base's time for the rest (for a reuse-only variant A is the base A plus the reuse
    difference, as A ends with the same reuse kernel on its own indices)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import prefill as pf
    from kernels_pallas import reference as ref

    rows = []
    for s in contexts:
        dt = jnp.dtype(dtype)
        q, k, v = inputs(1, s, dt, shape=shape)
        qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), s, jnp.int32)
        k_max = _k_max(s, frac, min_k, key_block)
        hm = jnp.arange(shape.kv_heads, dtype=jnp.int32)[::-1]
        base = None
        idx = counts = None
        base_tuning = pf.tuning_from_string(base_spec)
        for spec in [""] + list(specs):
            try:
                tuning = pf.tuning_from_string(spec, base_tuning)
                kw = dict(topk_frac=frac, min_k=min_k, k_max=k_max, impl="pallas", tuning=tuning, key_block=key_block,
                          score_fp8=score_fp8)
                fns = dict(
                    dense=(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                                implementation="cudnn")), None),
                    A0=(jax.jit(lambda q, k, v: pf.anchor_prefill(q, k, v, qs, kl, kl, tile, dense_out=True,
                                                                  chunk_at_zero=True, **kw)), None),
                    A=(jax.jit(lambda q, k, v: pf.anchor_prefill(q, k, v, qs, kl, kl, tile, **kw)), None),
                    R=(jax.jit(lambda q, k, v, i, c, m: pf.reuse_prefill(q, k, v, qs, kl, i, c, m, tile, impl="pallas",
                                                                         tuning=tuning, key_block=key_block)), "idx"))
                if base is None:
                    _, idx, counts = fns["A"][0](q, k, v)
                parts = ("dense", "A0", "A", "R") if base is None else sorted(_parts(tuning, base_tuning))
                row = dict(context=s, dtype=dtype, topk_frac=frac, key_block=key_block, score_fp8=score_fp8,
                           spec=spec or f"(base) {base_spec}", timed=list(parts), **shape.record())
                for name in parts:
                    fn, extra = fns[name]
                    args = (q, k, v, idx, counts, hm) if extra else (q, k, v)
                    row[name], row[name + "_kernels"] = cupti_time(fn, args, iters)
                if base is None:
                    base = row
                est = {n: row.get(n, base[n]) for n in ("dense", "A0", "A", "R")}
                if "R" in row and "A" not in row:
                    est["A"] = base["A"] + row["R"] - base["R"]
                row["weighted_est"] = shape.weighted(est["A0"], est["A"], est["R"])
                row["speedup_est"] = base["dense"] / row["weighted_est"]
                for n in ("A0", "A", "R"):
                    row[n + "/dense_est"] = est[n] / base["dense"]
                log(f"sweep s={s} [{row['spec']}]: " + "  ".join(f"{n} {row[n]:.3f}" for n in parts) +
                    f"  -> A0/A/R {row['A0/dense_est']:.3f}/{row['A/dense_est']:.3f}/{row['R/dense_est']:.3f}"
                    f"  weighted {row['speedup_est']:.2f}x")
                for n in parts:
                    if n != "dense":
                        per = row[n + "_kernels"].items()
                        log(f"   {n} kernels: " + ", ".join(f"{kn[:40]}={t:.3f}" for kn, t in per if t > 0.01))
                rows.append(row)
            except Exception as e:  # noqa: BLE001 - a variant that fails to compile is reported, the sweep goes on
                log(f"sweep s={s} [{spec}]: FAILED {type(e).__name__}: {str(e)[:300]}")
                if base is None:
                    break
        del q, k, v, idx
    return rows


def _meta(**extra):
    import jax

    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                gpu=jax.devices()[0].device_kind, jax=jax.__version__, command=" ".join(sys.argv), **extra)


def run(contexts, fracs, dtypes, *, long_contexts=(), min_k=128, tile=32, iters=5, out_dir="benchmarks",
        check_first=False, tune_at=0, tuning_spec="", sweep_specs=(), sweep_contexts=(32768,), shape=_DEFAULT, tag="",
        key_block=1, score_fp8=False, log=print):
    """The sweep (sweep_specs: <out_dir>/prefill_sweep[_<tag>].json/md), then the table (<out_dir>/prefill[_<tag>].
    json/md/png) at the tuning: the defaults, or the fastest variants at tune_at, with tuning_spec on top. Contexts
    are timed at every top-k of the first dtype, long_contexts and the further dtypes at the first top-k only; a
    failing row is logged and the run goes on. Returns the table's rows (none: nothing written)."""
    import dataclasses

    import jax

    from kernels_pallas import prefill as pf

    # Both stems first: an untagged run at another shape is refused before anything is timed.
    stem, sweep_stem = output_stem("prefill", tag, shape), output_stem("prefill_sweep", tag, shape)
    if jax.default_backend() != "gpu":
        raise ValueError("bench --phase=prefill needs a GPU (CPU timings would mean nothing)")
    if sweep_specs:
        note_overwrite(out_dir, sweep_stem, shape, log)
    if contexts or long_contexts:
        note_overwrite(out_dir, stem, shape, log)
    if check_first:  # the base tuning and every sweep variant (e.g. anchor_backend=mgpu) against the references
        base_tuning = pf.tuning_from_string(tuning_spec)
        for spec in [""] + list(sweep_specs):
            for peaky in (False, True):
                check(peaky=peaky, tuning=pf.tuning_from_string(spec, base_tuning), log=log, shape=shape,
                      key_block=key_block, score_fp8=score_fp8)
    if sweep_specs:
        srows = sweep(sweep_contexts, sweep_specs, dtypes[0], fracs[0], min_k, tile, iters, base_spec=tuning_spec,
                      log=log, shape=shape, key_block=key_block, score_fp8=score_fp8)
        meta = _meta(shape=shape.record(), key_block=key_block, score_fp8=score_fp8)
        write_outputs(out_dir, sweep_stem, dict(meta=meta, rows=srows),
                      tables.prefill_sweep_markdown(srows, meta, shape), log=log)
    tuning, tuning_runs = pf.DEFAULT_TUNING, []
    if tune_at:
        tuning, tuning_runs = tune(tune_at, dtypes[0], min_k, tile, iters, log=log, shape=shape)
    tuning = pf.tuning_from_string(tuning_spec, tuning)
    rows = []
    plan = [(dtypes[0], s, f) for s in contexts for f in fracs] + [(dtypes[0], s, fracs[0]) for s in long_contexts]
    plan += [(dt, s, fracs[0]) for dt in dtypes[1:] for s in contexts]  # further dtypes: the first top-k only
    from tqdm import tqdm

    for dtype, s, f in tqdm(plan, desc="prefill benchmark", unit="config", file=sys.stderr):
        try:
            rows.append(bench_one(s, f, dtype, min_k, tile, iters, tuning=tuning, log=log, shape=shape,
                                  key_block=key_block, score_fp8=score_fp8))
        except Exception as e:  # noqa: BLE001 - report and go on (e.g. out of memory at 256K)
            log(f"s={s} k={f} {dtype}: FAILED {type(e).__name__}: {str(e)[:300]}")
    if not rows:  # e.g. a sweep-only call: keep the last table
        return rows
    meta = _meta(tuning=dataclasses.asdict(tuning), tuning_runs=tuning_runs, shape=shape.record(), tile=tile,
                 min_k=min_k, key_block=key_block, score_fp8=score_fp8)
    write_outputs(out_dir, stem, dict(meta=meta, rows=rows), tables.prefill_markdown(rows, meta, shape),
                  lambda path: tables.prefill_plot(rows, path, shape), log=log)
    return rows
