"""Decode attention on a paged vs a contiguous KV cache, and the paged report.

The same random K/V once contiguous and once scattered over randomly permuted pages of a pool; dense (cuDNN on the
contiguous cache vs the paged Pallas flash-decode) and Kascade's A0 / A / R (kernels_pallas/decode.py vs their
page-table twins in kernels_pallas/paged.py), CUPTI kernel time, and the ratio paged / contiguous of each and of the
weighted Kascade time (the target: within 5%). `check` first compares every paged kernel with its contiguous twin.

The report (<out>/paged.json + paged.md + paged.png) is shared with the serving replay: each writer replaces only
its own section ("kernels" or "replay") and the Markdown is rewritten from every section present, so the two can run
in either order. Neither is replaced: kernels rows merge by shape (`store.merge_paged_kernels`), replay rows of one
trace by strategy and prefill budget (`store.merge_replay`; a replay of another trace is refused before it runs), and
a paged.json that cannot be read is an error (never silently overwritten).
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from kascade_jax.bench import tables
from kascade_jax.bench.decode import inputs
from kascade_jax.bench.store import merge_paged_kernels, merge_replay, replay_conflict, write_outputs
from kascade_jax.bench.timing import BenchShape, cupti_time

STEM = "paged"


def paged_copy(k, page_size: int, seed: int, spare: int = 7):
    """k [batch, s, kv_heads, d] -> (pool [batch * s / page_size + spare, page_size, kv_heads, d], page_table
    [batch, s / page_size]): the same rows on randomly permuted pages (the spare pages hold zeros)."""
    import jax
    import jax.numpy as jnp

    b, s, kvh, d = k.shape
    if s % page_size:
        raise ValueError(f"context {s} is not a multiple of the page size {page_size}")
    mp = s // page_size
    n = b * mp + spare
    perm = jax.random.permutation(jax.random.PRNGKey(seed), n).astype(jnp.int32)
    table = perm[:b * mp].reshape(b, mp)
    # jitted, so that the zero pool is scattered into in place: eagerly the zeros, the reshaped K and the scatter's
    # result were alive at once (~80 GiB at 128K, batch 64, with V's cache beside it)
    return jax.jit(_scatter_pages, static_argnums=(2,))(k, table, n), table


def _scatter_pages(k, table, n: int):
    import jax.numpy as jnp

    b, s, kvh, d = k.shape
    ps = s // table.shape[1]
    return jnp.zeros((n, ps, kvh, d), k.dtype).at[table.reshape(-1)].set(k.reshape(-1, ps, kvh, d))


def _same_sets(a, c):
    import numpy as np

    a, c = np.asarray(a), np.asarray(c)
    a, c = a.reshape(-1, a.shape[-1]), c.reshape(-1, c.shape[-1])
    return float(np.mean([set(x[x >= 0].tolist()) == set(y[y >= 0].tolist()) for x, y in zip(a, c)]))


def check(b, s, page_size, shape: BenchShape, frac=0.1, min_k=128, seed=0, interpret=False, anchor0=True, log=print,
          mask="none"):
    """Paged kernels (DecodeTuning.paged_mask=mask) vs their contiguous twins on the same ragged batch: [{name, rel[,
    same_sets]}]; raises on a relative error above 2e-2 or fewer than 99% identical index sets. anchor0=False skips
    A0 (CPU tests)."""
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import decode as dec
    from kernels_pallas import paged as pg
    from kernels_pallas import reference as ref

    q, k, v = inputs(seed, b, s, shape.q_heads, shape.kv_heads, shape.head_dim, jnp.bfloat16, peaky=True)
    kv_len = jnp.asarray(np.random.default_rng(seed).integers(s // 2, s + 1, b), jnp.int32)
    kp, table = paged_copy(k, page_size, seed)
    vp, _ = paged_copy(v, page_size, seed)  # same seed: the same permutation
    impl = dict(impl="pallas", interpret=interpret)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=ref.max_budget(s, frac, min_k), **impl)
    tuning = dec.DecodeTuning(paged_mask=mask)
    rel = lambda a, r: float(jnp.linalg.norm((a.astype(jnp.float32) - r.astype(jnp.float32)).ravel())  # noqa: E731
                             / jnp.linalg.norm(r.astype(jnp.float32).ravel()))
    out = []
    want = ref.attention_reference(q, k, v, kv_len - 1, kv_len)
    out.append(dict(name="dense", rel=rel(pg.dense_decode(q, kp, vp, table, kv_len, tuning=tuning, **impl), want)))
    for name, dense in (("A0", True), ("A", False))[0 if anchor0 else 1:]:
        o, idx, cnt = pg.anchor_decode(q, kp, vp, table, kv_len, dense_out=dense, tuning=tuning, **kw)
        oc, idx_c, cnt_c = dec.anchor_decode(q, k, v, kv_len, dense_out=dense, **kw)
        out.append(dict(name=name, rel=rel(o, oc), same_sets=_same_sets(idx, idx_c)))
    hm = jnp.arange(shape.kv_heads, dtype=jnp.int32)[::-1]
    o = pg.reuse_decode(q, kp, vp, table, kv_len, idx, cnt, hm, tuning=tuning, **impl)
    out.append(dict(name="R", rel=rel(o, dec.reuse_decode(q, k, v, kv_len, idx, cnt, hm, **impl))))
    for c in out:
        log(f"check b={b} s={s} page {page_size}: {c}")
        if c["rel"] > 2e-2 or c.get("same_sets", 1.0) < 0.99:
            raise ValueError(f"paged kernel {c['name']} disagrees with its contiguous twin: {c}")
    return out


def bench_one(b, s, page_size, frac, min_k, iters, shape: BenchShape, log=print, stream_block=128, *,
              interpret=False, dense_impl="cudnn", timer=cupti_time, mask="none"):
    """One row: dense, A0, A, R and the weighted Kascade time on both caches (<name>_contig, <name>_paged), and
    their ratios paged / contiguous (<name>_ratio). The layouts are measured one after the other: the contiguous K
    is freed once its pool is built, then V, so at most one layout's K/V plus one pool is held (1.5x one cache: 52 GB
    at 128K, batch 64, 8 KV heads, d 128). `mask`: the paged kernels' DecodeTuning.paged_mask. `timer`, `interpret`
    and `dense_impl` let a CPU test run it."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import decode as dec
    from kernels_pallas import paged as pg
    from kernels_pallas import reference as ref

    q, k, v = inputs(1, b, s, shape.q_heads, shape.kv_heads, shape.head_dim, jnp.bfloat16, peaky=False)
    kv_len = jnp.full((b,), s, jnp.int32)
    impl = dict(impl="pallas", interpret=interpret)
    kw = dict(topk_frac=frac, min_k=min_k, k_max=ref.max_budget(s, frac, min_k), **impl)
    tuning = dec.DecodeTuning(stream_block=stream_block, paged_mask=mask)
    hm = jnp.arange(shape.kv_heads, dtype=jnp.int32)[::-1]
    an = jax.jit(lambda q, k, v, l: dec.anchor_decode(q, k, v, l, **kw))
    _, idx, counts = an(q, k, v, kv_len)
    row = dict(batch=b, context=s, page_size=page_size, stream_block=stream_block, topk_frac=frac, k=int(counts[0]),
               paged_mask=mask, **shape.record())
    names = ("dense", "A0", "A", "R")

    def time_layout(tag, fns, cache_args):  # cache_args lives only in this call: the caller can free the cache after
        for n, fn in zip(names, fns):
            args = cache_args + ((idx, counts) if n == "R" else ())
            row[f"{n}_{tag}"], row[f"{n}_{tag}_kernels"] = timer(fn, args, iters)

    contig = (
        jax.jit(lambda q, k, v, l: jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=l,
                                                                implementation=dense_impl)),
        jax.jit(lambda q, k, v, l: dec.anchor_decode(q, k, v, l, dense_out=True, **kw)),
        an,
        jax.jit(lambda q, k, v, l, i, c: dec.reuse_decode(q, k, v, l, i, c, hm, **impl)))
    time_layout("contig", contig, (q, k, v, kv_len))
    kp, table = paged_copy(k, page_size, 1)
    del k  # the contiguous K goes before the V pool is built
    vp, _ = paged_copy(v, page_size, 1)  # same seed: the same permutation
    del v
    paged = (
        jax.jit(lambda q, k, v, t, l: pg.dense_decode(q, k, v, t, l, tuning=tuning, **impl)),
        jax.jit(lambda q, k, v, t, l: pg.anchor_decode(q, k, v, t, l, dense_out=True, tuning=tuning, **kw)),
        jax.jit(lambda q, k, v, t, l: pg.anchor_decode(q, k, v, t, l, tuning=tuning, **kw)),
        jax.jit(lambda q, k, v, t, l, i, c: pg.reuse_decode(q, k, v, t, l, i, c, hm, tuning=tuning, **impl)))
    time_layout("paged", paged, (q, kp, vp, table, kv_len))
    for n in names:
        row[f"{n}_ratio"] = row[f"{n}_paged"] / row[f"{n}_contig"]
    for tag in ("contig", "paged"):
        row[f"weighted_{tag}"] = shape.weighted(row[f"A0_{tag}"], row[f"A_{tag}"], row[f"R_{tag}"])
    row["weighted_ratio"] = row["weighted_paged"] / row["weighted_contig"]
    row["speedup_contig"] = row["dense_contig"] / row["weighted_contig"]
    row["speedup_paged"] = row["dense_contig"] / row["weighted_paged"]
    log(f"b={b:3d} s={s:7d} page {page_size}: " + "  ".join(
        f"{n} {row[n + '_contig']:.4f}/{row[n + '_paged']:.4f} ({row[n + '_ratio']:.3f})"
        for n in ("dense", "A0", "A", "R", "weighted")))
    return row


def run(contexts, batches, page_sizes, *, frac=0.1, min_k=128, iters=10, do_check=True, out_dir="benchmarks",
        max_cache_gb=100.0, shape: BenchShape | None = None, stream_block=128, log=print, mask="none"):
    """Time every (batch, context, page size) on the GPU, after the checks (do_check); every shape asked for ends as
    a row or a not_measured entry with its reason (too large, or failed). Writes the kernels section of
    <out_dir>/paged.json / paged.md (`update`) and returns the rows."""
    import jax

    from kernels_pallas.decode import DecodeTuning
    from models.paged import check_page_size

    shape = shape or BenchShape()
    for ps in page_sizes:
        check_page_size(ps)
    DecodeTuning(paged_mask=mask)  # a bad setting raises here, not as a failed row of every shape
    if jax.default_backend() != "gpu":
        raise ValueError(f"bench_paged needs a GPU, found backend {jax.default_backend()!r}")
    checks = []
    if do_check:
        for ps in page_sizes:
            checks += check(8, 32768, ps, shape, frac, min_k, log=log, mask=mask)
    rows, not_measured = [], []  # every shape asked for is a row or a not_measured entry (with its reason)
    for b in batches:
        for s in contexts:
            gb = 3 * b * s * shape.kv_heads * shape.head_dim * 2 / 1e9  # peak: one layout's K and V + one pool, bf16
            if gb > max_cache_gb:
                reason = (f"skipped: peak K/V {gb:.0f} GB (one layout + one pool) > "
                          f"--paged_max_cache_gb={max_cache_gb:g}")
                log(f"skip b={b} s={s}: {reason}")
                not_measured += [dict(batch=b, context=s, page_size=ps, stream_block=stream_block, paged_mask=mask,
                                      reason=reason) for ps in page_sizes]
                continue
            for ps in page_sizes:
                try:
                    rows.append(bench_one(b, s, ps, frac, min_k, iters, shape, log, stream_block, mask=mask))
                except Exception as e:  # keep the sweep going; the failure is reported and recorded
                    reason = f"failed: {type(e).__name__}: {str(e)[:300]}"
                    log(f"FAILED b={b} s={s} page {ps}: {reason}")
                    not_measured.append(dict(batch=b, context=s, page_size=ps, stream_block=stream_block,
                                             paged_mask=mask, reason=reason))
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                gpu=jax.devices()[0].device_kind, jax=jax.__version__, command=" ".join(sys.argv), iterations=iters,
                heads=shape.heads_text(), formula=f"{shape.formula()} ({shape.mix_text()})",
                page_size=",".join(map(str, page_sizes)), stream_block=stream_block, shape=shape.record(),
                paged_mask=mask)
    log("wrote " + update(out_dir, "kernels", dict(meta=meta, checks=checks, rows=rows, not_measured=not_measured)))
    return rows


def read(out_dir: str) -> dict:
    """<out_dir>/paged.json's sections ({} if there is none); ValueError naming the file if it cannot be read."""
    base = os.path.join(out_dir, STEM)
    if not os.path.exists(base + ".json"):
        return {}
    try:
        with open(base + ".json") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as e:
        raise ValueError(f"{base}.json exists but cannot be read ({type(e).__name__}: {e}); fix or move it "
                         f"(it holds the other section)") from None
    if not isinstance(data, dict):
        raise ValueError(f"{base}.json: expected a JSON object of sections, got {type(data).__name__}")
    return data


def check_replay_target(out_dir: str, meta: dict) -> None:
    """Before a replay runs: its rows could join <out_dir>/paged.json's replay section (same trace), else ValueError."""
    conflict = replay_conflict(read(out_dir).get("replay"), meta)
    if conflict:
        raise ValueError(f"--replay_out={out_dir}: its paged.json holds a replay of another trace ({conflict}); "
                         "write to another folder (rows of one trace accumulate by strategy)")


def update(out_dir: str, section: str, payload: dict) -> str:
    """Merge run `payload` into `section` of <out_dir>/paged.json ("kernels": rows by shape; "replay": rows of one
    trace by strategy and prefill budget) and rewrite paged.md and paged.png; returns the md path."""
    if section not in ("kernels", "replay"):
        raise ValueError(f"section must be 'kernels' or 'replay', got {section!r}")
    base = os.path.join(out_dir, STEM)
    data = read(out_dir)
    merge = merge_paged_kernels if section == "kernels" else merge_replay
    data[section] = merge(data.get(section), payload)
    write_outputs(out_dir, STEM, data, tables.paged_markdown(data), lambda path: tables.paged_plot(data, path))
    return base + ".md"
