"""Times the reuse prefill over key-block selections (`prefill_mgpu.reuse_blocks`) against the Triton reuse kernel
and cuDNN dense causal attention, batch 1 from position 0 (issue 22 item 2).

Per context and head shape: cuDNN dense (the ratio's base), the Triton reuse on per-key selections (today's R),
the Triton reuse on block selections, and the Mosaic GPU block reuse for each key block and tuning. Selections are
synthetic and scattered: each tile takes its budget (`reference.prefill_counts`, Top-k 10%, min_k 128) as keys or
as whole blocks, one from each of that many equal strata of its prefix, at a hashed offset (different per KV head).
CUPTI median of --iters calls; `main` is the largest kernel, `total` includes the packing around it. `GB/s` is the
K+V bytes the kernel must move (selected keys plus the diagonal tile, every KV head) over the main kernel's time.
Each MGPU row is checked against the Triton reuse on the same ids (`err`: largest relative row error). `--no_exp2`
adds each MGPU variant traced with exp2 as the identity (wrong values, no err): the step without the MUFU's
exponentials. Needs a GPU.

  python benchmarks/reuse_blocks_probe.py [--contexts 32768,131072] [--shapes 32/8/128,14/2/64,12/2/128]
      [--tile 32] [--key_blocks 8,16,32] [--iters 3] [--tuning "block_kv=128,steps=2;block_kv=64,steps=4"]
      [--no_exp2] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def selection(s, kvh, tile, kb, frac=0.1, min_k=128):
    """(idx [1, kvh, tiles, W], counts [1, tiles], bytes per K/V row pair moved) of a scattered selection."""
    import jax.numpy as jnp

    from kernels_pallas import reference as R

    nt = s // tile
    z = jnp.zeros((1,), jnp.int32)
    keys = R.prefill_counts(z, z + s, z + s, s, tile, frac, min_k)[0]  # [tiles]
    ts = jnp.arange(nt, dtype=jnp.int32) * tile
    elig = -(-ts // kb)
    n = jnp.minimum(-(-keys // kb), elig)
    w = int(-(-int(n.max()) * kb // 128) * 128)
    lane = jnp.arange(w, dtype=jnp.int32)
    j = lane // kb
    stride = elig.astype(jnp.float32) / jnp.maximum(n, 1).astype(jnp.float32)  # [tiles]
    h = jnp.arange(kvh, dtype=jnp.uint32)[:, None, None]
    mix = (j[None, None, :].astype(jnp.uint32) * jnp.uint32(2654435761) + ts[None, :, None].astype(jnp.uint32) * 40503
           + h * 97) % 1024
    lo = jnp.floor(j[None, :] * stride[:, None]).astype(jnp.int32)  # stratum j: [lo, hi), disjoint, never empty
    hi = jnp.minimum(jnp.floor((j[None, :] + 1) * stride[:, None]).astype(jnp.int32), elig[:, None])
    beta = lo[None] + (mix.astype(jnp.int32) * jnp.maximum(hi - lo, 1)[None]) // 1024
    idx = jnp.where(j[None, None, :] < n[None, :, None], beta * kb + lane % kb, -1)[None]
    counts = (n * kb)[None]
    rows = int(kvh * (int(counts.sum()) + nt * tile))
    return idx, counts, rows


def probe(s, hq, kvh, d, tile, key_blocks, tunings, iters, log=print, drop_exp2=False):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mgpu_prefill_probe import error_line, no_exp2  # (this script's folder)

    from kascade_jax.bench.timing import cupti_time
    from kernels_pallas import prefill as P
    from kernels_pallas import prefill_mgpu as M

    ks = jax.random.split(jax.random.PRNGKey(s + hq), 3)
    q = jax.random.normal(ks[0], (1, s, hq, d), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, s, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in ks[1:])
    qs, kl, hm = jnp.zeros((1,), jnp.int32), jnp.full((1,), s, jnp.int32), jnp.arange(kvh, dtype=jnp.int32)
    rows, base = [], {}

    def row(name, fn, args, n_rows, kb, ref=None):
        try:
            total, per = cupti_time(fn, args, iters)
            kname, main = max(per.items(), key=lambda kv: kv[1])
            err = None
            if ref is not None:
                o, r = np.asarray(fn(*args), np.float64), np.asarray(ref, np.float64)
                rr = np.sqrt(np.mean(r ** 2, axis=-1))
                err = float((np.sqrt(np.mean((o - r) ** 2, axis=-1)) / np.maximum(rr, np.sqrt(np.mean(r ** 2)) / 8))
                            .max())
            if name == "cudnn dense":
                base["cudnn"] = total
            rows.append(dict(context=s, heads=f"{hq}/{kvh}/{d}", tile=tile, key_block=kb, name=name, total_ms=total,
                             main_ms=main, kernel=kname,
                             vs_cudnn=total / base["cudnn"] if "cudnn" in base else None,
                             gbps=n_rows * d * 2 * 2 / (main / 1e3) / 1e9 if n_rows else None, err=err))
        except Exception as e:  # keep going: one variant's failure must not hide the others
            rows.append(dict(context=s, heads=f"{hq}/{kvh}/{d}", tile=tile, key_block=kb, name=name,
                             error=error_line(e)))
            traceback.print_exc(limit=3)
        log(rows[-1])

    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    row("cudnn dense", cudnn, (q, k, v), 0, 0)
    tri = jax.jit(lambda q, k, v, idx, c: P.reuse_prefill(q, k, v, qs, kl, idx, c, hm, tile, impl="pallas"))
    for kb in [1] + list(key_blocks):
        idx, counts, n_rows = selection(s, kvh, tile, kb)
        row("triton reuse", tri, (q, k, v, idx, counts), n_rows, kb)
        if kb == 1:
            continue
        ref = tri(q, k, v, idx, counts)
        for spec, tun in tunings:
            raw = lambda q, k, v, idx, c, kb=kb, tun=tun: M.reuse_blocks(q, k, v, qs, kl, idx, c, hm, tile, kb,
                                                                          tuning=tun)
            fn = jax.jit(raw)
            row(f"mgpu reuse[{spec}]" if spec else "mgpu reuse", fn, (q, k, v, idx, counts), n_rows, kb, ref=ref)
            if drop_exp2:
                row(f"mgpu reuse[{spec}] no_exp2" if spec else "mgpu reuse no_exp2", no_exp2(raw),
                    (q, k, v, idx, counts), n_rows, kb)
        del idx, counts, ref
    return rows


def table(rows):
    lines = [f"{'context':>8} {'heads':>9} {'kb':>3} {'pass':<40} {'main ms':>9} {'total ms':>9} {'/cuDNN':>7} "
             f"{'GB/s':>6}  err / error"]
    for r in rows:
        head = f"{r['context']:>8} {r['heads']:>9} {r['key_block']:>3} {r['name']:<40}"
        if "error" in r:
            lines.append(f"{head} {'-':>9} {'-':>9} {'-':>7} {'-':>6}  {r['error']}")
            continue
        gbps = f"{r['gbps']:>6.0f}" if r["gbps"] else f"{'-':>6}"
        err = f"{r['err']:.2e}" if r["err"] is not None else ""
        ratio = f"{r['vs_cudnn']:>7.3f}" if r["vs_cudnn"] is not None else f"{'-':>7}"
        lines.append(f"{head} {r['main_ms']:>9.3f} {r['total_ms']:>9.3f} {ratio} {gbps}  {err}")
    return "\n".join(lines)


def main(argv=None):
    from mgpu_prefill_probe import no_gpu, parse_tuning, report, shape_args, shapes  # (this script's folder)

    from kernels_pallas import prefill_mgpu as M

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_args(ap)
    ap.add_argument("--key_blocks", default="8,16,32")
    ap.add_argument("--tuning", default="", help="ReuseTuning variants: 'field=v,field=v;field=v' (empty: defaults)")
    ap.add_argument("--no_exp2", action="store_true", help="also each MGPU variant without its exp2 (timing probe)")
    ap.add_argument("--json", default="", help="also write the rows here")
    a = ap.parse_args(argv)
    tunings = [(spec.strip(), parse_tuning(M.ReuseTuning, spec, "reuse_blocks_probe")) for spec in a.tuning.split(";")]
    if no_gpu("reuse_blocks_probe"):
        return 1
    key_blocks = [int(x) for x in a.key_blocks.split(",") if x]
    rows = []
    for s, hq, kvh, d in shapes(a):
        rows += probe(s, hq, kvh, d, a.tile, key_blocks, tunings, a.iters, drop_exp2=a.no_exp2)
    return report(rows, table(rows), a.json)


if __name__ == "__main__":
    sys.exit(main())
