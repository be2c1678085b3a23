"""Times the Mosaic GPU anchor-prefill passes (`kernels_pallas.prefill_mgpu`) against cuDNN and the Triton passes.

Per context and head shape (batch 1): (a) the flash pass with output against cuDNN causal attention and the Triton
dense pass, and LSE-only against the Triton LSE pass; (b) the pooled-score pass against the Triton score kernel
over all tiles (its chunk loop, without the select). CUPTI median of --iters calls; `main` is the largest kernel of
a call (the MGPU rows also pack Q and the LSE in XLA: `total` includes that). FLOP/s are matmul FLOPs (causal half)
over the main kernel's time, as a fraction of the H200 dense bf16 ceiling (989 TFLOP/s datasheet; also of the
819 TFLOP/s measured). Each row also checks the MGPU result
against cuDNN / Triton (`err`). `--fp8` adds the two score passes on float8_e4m3fn copies of q and k (`lse fp8`,
`scores fp8`; their FLOP fractions stay of the bf16 ceiling), each checked against the same MGPU pass on those
values widened to bf16 (`err`: LSE max abs, base 2; scores as above on the last window of tiles). `--no_exp2` adds
each MGPU pass of the first --mgpu variant traced with exp2 as the identity (`no_exp2`: wrong values, err `probe`):
the time without the MUFU's exponentials, so the difference is what they cost. `--few_k_rows N` adds the flash
passes of that variant with each K / V copy cut to N rows (`kN`, err `probe`): the same compute on 1/32 of the
bytes, so the difference is what streaming K and V into shared memory costs. Needs a GPU; one line and exit
status 1 anywhere else.

  python benchmarks/mgpu_prefill_probe.py [--contexts 32768,131072] [--shapes 32/8/128,14/2/64,12/2/128]
      [--tile 32] [--iters 3] [--mgpu "block_kv=64;block_kv=128,max_concurrent_steps=3"] [--fp8] [--no_exp2]
      [--few_k_rows 8] [--json out.json]

The kernels' SASS and ptxas reports: `benchmarks/mgpu_sass.py`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CEILING = 989e12  # H200 dense bf16 FLOP/s (datasheet)
MEASURED = 819e12  # bf16 matmul measured on this H200 (../shared/docs/h200-baselines.md)


def parse_tuning(cls, spec: str, prog: str):
    """'field=v,field=v' (integers, true, false, none) -> cls(**fields); a bad field or value exits naming it."""
    fields = {f.name for f in dataclasses.fields(cls)}
    over = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        name, _, val = item.partition("=")
        if name not in fields:
            raise SystemExit(f"{prog}: unknown {cls.__name__} field {name!r} (fields: {sorted(fields)})")
        words = {"true": True, "false": False, "none": None}
        if not (val.isdigit() or val.lower() in words):
            raise SystemExit(f"{prog}: {name} takes an integer, true, false or none, got {val!r}")
        over[name] = int(val) if val.isdigit() else words[val.lower()]
    try:
        return cls(**over)
    except ValueError as e:
        raise SystemExit(f"{prog}: {e}") from None


def _mgpu_tuning(spec: str):
    from kernels_pallas import prefill_mgpu as M

    return parse_tuning(M.MgpuTuning, spec, "mgpu_prefill_probe")


def shape_args(ap, iters=3):
    """The arguments both probes share: contexts, head shapes, tile, iterations."""
    ap.add_argument("--contexts", default="32768,131072")
    ap.add_argument("--shapes", default="32/8/128,14/2/64,12/2/128", help="q_heads/kv_heads/head_dim,...")
    ap.add_argument("--tile", type=int, default=32)
    ap.add_argument("--iters", type=int, default=iters)


def no_gpu(prog: str) -> bool:
    """True (after one line on stderr) unless the JAX backend is a GPU."""
    import jax

    if jax.default_backend() == "gpu":
        return False
    print(f"{prog}: needs an NVIDIA GPU (the JAX backend here is {jax.default_backend()!r})", file=sys.stderr)
    return True


def error_line(e: Exception) -> str:
    """A failed variant's row text: the exception's type and the first line of its message (160 characters)."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _row_rel_err(a, b, keep):
    """Largest per-row RMS difference of a and b over `keep`, relative to that row's RMS of b (rows of b all 0: 0)."""
    import jax.numpy as jnp

    num = jnp.sqrt(jnp.sum(jnp.where(keep, (a - b) ** 2, 0.0), -1))
    den = jnp.sqrt(jnp.sum(jnp.where(keep, b ** 2, 0.0), -1))
    return float(jnp.max(jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)))


def report(rows, text, path) -> int:
    """Prints the table, writes the rows as JSON to `path` (if any); exit status 0."""
    print(text)
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


def shapes(a):
    """(context, q_heads, kv_heads, head_dim) for every --contexts x --shapes pair."""
    for s in (int(x) for x in a.contexts.split(",")):
        for shape in a.shapes.split(","):
            yield (s, *(int(x) for x in shape.split("/")))


def _flops(s, hq, d, tile, kind):
    causal = s * s / 2
    if kind == "dense":
        return 4 * d * hq * causal
    if kind == "lse":
        return 2 * d * hq * causal
    n_t = s // tile  # scores: keys strictly before each tile
    return 2 * d * hq * tile * tile * n_t * (n_t - 1) / 2


def _traced_with(fn, target, name, value):
    """jit of `fn` (not itself jitted: a cached trace would keep the original) traced with `target.name` patched to
    `value`: the timing probes below."""
    import jax
    from unittest import mock

    def f(*args):
        with mock.patch.object(target, name, value):
            return fn(*args)

    return jax.jit(f)


def no_exp2(fn):
    """`fn` traced with jnp.exp2 as the identity: a timing probe of a kernel without its exponentials (its values are
    wrong; only the time counts)."""
    import jax.numpy as jnp

    return _traced_with(fn, jnp, "exp2", lambda x: x)


def few_k_rows(fn, rows=8):
    """`fn` traced with every TMA copy of more than 64 rows (the flash passes' K and V ring slots; their q blocks are
    64 rows) cut to its first `rows`: a timing probe of a pass that streams 1/32 of its K and V bytes and computes as
    much as before (wrong values). Much faster than the plain pass: it waits on those bytes (L2 to shared memory);
    about as fast: it does not."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    copy = plgpu.copy_gmem_to_smem

    def few(src, dst, barrier=None, **kw):
        if len(dst.shape) == 2 and dst.shape[0] > 64:
            src, dst = src.at[pl.ds(0, rows)], dst.at[pl.ds(0, rows)]
        return copy(src, dst, barrier, **kw)

    return _traced_with(fn, plgpu, "copy_gmem_to_smem", few)


def _time(fn, args, iters):
    from kascade_jax.bench.timing import cupti_time

    total, per = cupti_time(fn, args, iters)
    name, main = max(per.items(), key=lambda kv: kv[1])
    return total, main, name


def probe(s, hq, kvh, d, tile, iters, tunings, log=print, fp8=False, drop_exp2=False, few_k=0):
    import jax
    import jax.numpy as jnp
    import numpy as np

    from kernels_pallas import prefill as P
    from kernels_pallas import prefill_mgpu as M

    ks = jax.random.split(jax.random.PRNGKey(s + hq), 3)
    q = jax.random.normal(ks[0], (1, s, hq, d), jnp.float32).astype(jnp.bfloat16)
    k, v = (jax.random.normal(kk, (1, s, kvh, d), jnp.float32).astype(jnp.bfloat16) for kk in ks[1:])
    scale = 1.0 / d ** 0.5
    qs, kl = jnp.zeros((1,), jnp.int32), jnp.full((1,), s, jnp.int32)
    lay = P._layout(q, k, tile)
    qp = jax.block_until_ready(P._pack_q(q, lay))
    tt = P.DEFAULT_TUNING

    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"))
    tri_dense = jax.jit(lambda qp, k, v: P._dense_pass(qp, k, v, qs, kl, lay, scale, with_out=True, tuning=tt,
                                                       interpret=False))
    tri_lse = jax.jit(lambda qp, k: P._dense_pass(qp, k, k, qs, kl, lay, scale, with_out=False, tuning=tt,
                                                  interpret=False)[0])
    width, chunk, n_chunks = P._score_chunking(lay, tt)
    call = P._scores_call(lay, scale, tt, chunk, width, False)

    def tri_scores(qp, lse, k):  # every chunk of tiles; one element of each kept, so none is dropped
        def body(c, acc):
            return acc + call(jnp.reshape(c, (1,)).astype(jnp.int32), qs, kl, qp, lse, k)[0, 0, -1, 0]
        return jax.lax.fori_loop(0, n_chunks, body, jnp.float32(0))

    tri_scores = jax.jit(tri_scores)
    rows = []

    def row(name, kind, fn, args, err=None):
        try:
            total, main, kname = _time(fn, args, iters)
            frac = _flops(s, hq, d, tile, kind) / (main / 1e3) / CEILING
            rows.append(dict(context=s, heads=f"{hq}/{kvh}/{d}", tile=tile, name=name, total_ms=total, main_ms=main,
                             kernel=kname, frac=frac, err=err))
        except Exception as e:  # keep going: a lowering failure of one variant must not hide the others
            rows.append(dict(context=s, heads=f"{hq}/{kvh}/{d}", tile=tile, name=name, error=error_line(e)))
            traceback.print_exc(limit=3)
        log(rows[-1])

    row("cudnn dense", "dense", cudnn, (q, k, v))
    row("triton dense+lse", "dense", tri_dense, (qp, k, v))
    row("triton lse", "lse", tri_lse, (qp, k))
    lse_t = jax.block_until_ready(tri_lse(qp, k))
    row("triton scores", "scores", tri_scores, (qp, lse_t, k))
    ref_out = cudnn(q, k, v)
    ref_sc = call(jnp.full((1,), n_chunks - 1, jnp.int32), qs, kl, qp, lse_t, k)  # the last chunk of tiles
    for spec, tun in tunings:
        tag = f"mgpu[{spec}]" if spec else "mgpu"
        fns = dict(dense=lambda q, k, v, tun=tun: M.flash_lse(q, k, v, with_out=True, tuning=tun),
                   lse=lambda q, k, tun=tun: M.flash_lse(q, k, with_out=False, tuning=tun)[1],
                   scores=lambda q, k, l, tun=tun: M.pooled_scores(q, k, l, tile, tuning=tun))
        dense, lse_only, scores = (jax.jit(fns[n]) for n in ("dense", "lse", "scores"))
        errs, lse_m = _check_mgpu(dense, lse_only, scores, q, k, v, ref_out, lse_t, ref_sc, lay, tile, chunk, n_chunks)
        row(f"{tag} dense+lse", "dense", dense, (q, k, v), err=errs[0])
        row(f"{tag} lse", "lse", lse_only, (q, k), err=errs[1])
        if lse_m is not None:
            row(f"{tag} scores", "scores", scores, (q, k, lse_m), err=errs[2])
        first = spec == tunings[0][0]  # the probes below time the first variant only
        if drop_exp2 and first:
            row(f"{tag} dense+lse no_exp2", "dense", no_exp2(fns["dense"]), (q, k, v), err="probe")
            row(f"{tag} lse no_exp2", "lse", no_exp2(fns["lse"]), (q, k), err="probe")
            if lse_m is not None:
                row(f"{tag} scores no_exp2", "scores", no_exp2(fns["scores"]), (q, k, lse_m), err="probe")
        if few_k and first:  # the flash passes only (the score pass's ring slots are 64 rows)
            row(f"{tag} dense+lse k{few_k}", "dense", few_k_rows(fns["dense"], few_k), (q, k, v), err="probe")
            row(f"{tag} lse k{few_k}", "lse", few_k_rows(fns["lse"], few_k), (q, k), err="probe")
        del lse_m
        if fp8:
            _fp8_rows(row, tag, lse_only, scores, q, k, tile, chunk)
    del q, k, v, qp, ref_out, ref_sc, lse_t
    return rows


def _fp8_rows(row, tag, lse_only, scores, q, k, tile, chunk):
    """Time the LSE-only and score passes on float8_e4m3fn q and k, each checked against the bf16 pass on the same
    values widened (exact: every e4m3 value is a bf16 value)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import prefill_mgpu as M

    q8, k8 = q.astype(jnp.float8_e4m3fn), k.astype(jnp.float8_e4m3fn)
    qw, kw = q8.astype(q.dtype), k8.astype(k.dtype)
    errs, lse8 = ["not run"] * 2, None
    try:
        lse8 = lse_only(q8, k8)
        lse_w = lse_only(qw, kw)
        errs[0] = float(jnp.max(jnp.abs(lse8 - lse_w)))
        s, nt = q.shape[1], q.shape[1] // tile
        first = jnp.full((1,), nt - chunk, jnp.int32)
        win = jax.jit(lambda q, k, l: M.pooled_scores(q, k, l, tile, first_tile=first, n_tiles=chunk, width=s))
        a, b = win(q8, k8, lse8), win(qw, kw, lse8)
        errs[1] = _row_rel_err(a, b, jnp.isfinite(b))
        del lse_w, a, b
    except Exception as e:
        msg = error_line(e)
        errs = [x if not isinstance(x, str) else msg for x in errs]
        traceback.print_exc(limit=3)
    row(f"{tag} lse fp8", "lse", lse_only, (q8, k8), err=errs[0])
    if lse8 is not None:
        row(f"{tag} scores fp8", "scores", scores, (q8, k8, lse8), err=errs[1])
    del q8, k8, qw, kw, lse8


def _check_mgpu(dense, lse_only, scores, q, k, v, ref_out, lse_t, ref_sc, lay, tile, chunk, n_chunks):
    """Errors of the MGPU passes: output vs cuDNN (last 2048 rows, RMS relative to the slice's RMS), LSE vs the
    Triton pass (max abs, base 2), scores vs the Triton kernel on the last chunk of tiles (max per-row RMS
    relative to the row's RMS, keys before the tile). Returns ([3 errors or messages], MGPU LSE or None)."""
    import jax.numpy as jnp

    from kernels_pallas import prefill_mgpu as M

    errs, lse = ["not run"] * 3, None
    s = q.shape[1]
    try:
        out, _ = dense(q, k, v)
        o, r = out.astype(jnp.float32)[0, -2048:], ref_out.astype(jnp.float32)[0, -2048:]
        errs[0] = float(jnp.max(jnp.sqrt(jnp.mean((o - r) ** 2, -1)) / jnp.sqrt(jnp.mean(r ** 2))))
        del out, o, r
        lse = lse_only(q, k)
        ok = jnp.isfinite(lse_t) & (jnp.arange(lay.rows_pad) < lay.rows)
        errs[1] = float(jnp.max(jnp.where(ok, jnp.abs(M.lse_for_triton(lse, q, k, tile) - lse_t), 0.0)))
        t0 = (n_chunks - 1) * chunk
        a = scores(q, k, lse)[:, :, t0:t0 + chunk, :]
        b = ref_sc[:, :, : a.shape[2], :s]
        keep = jnp.arange(s)[None, None, None, :] < (t0 + jnp.arange(a.shape[2]))[None, None, :, None] * tile
        errs[2] = _row_rel_err(a, b, keep)
    except Exception as e:
        msg = error_line(e)
        errs = [x if not isinstance(x, str) else msg for x in errs]
        traceback.print_exc(limit=3)
    return errs, lse


def table(rows):
    lines = [f"{'context':>8} {'heads':>9} {'pass':<34} {'main ms':>9} {'total ms':>9} {'of 989T':>7} {'of 819T':>7}"
             f"  err / error"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['context']:>8} {r['heads']:>9} {r['name']:<34} {'-':>9} {'-':>9} {'-':>7} {'-':>7}  "
                         f"{r['error']}")
            continue
        err = r["err"] if isinstance(r["err"], str) or r["err"] is None else f"{r['err']:.2e}"
        lines.append(f"{r['context']:>8} {r['heads']:>9} {r['name']:<34} {r['main_ms']:>9.3f} {r['total_ms']:>9.3f} "
                     f"{r['frac']:>7.3f} {r['frac'] * CEILING / MEASURED:>7.3f}  {err or ''}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shape_args(ap)
    ap.add_argument("--mgpu", default="", help="MgpuTuning variants: 'field=v,field=v;field=v' (empty: defaults)")
    ap.add_argument("--fp8", action="store_true", help="also the score passes on float8_e4m3fn q and k")
    ap.add_argument("--no_exp2", action="store_true", help="also each MGPU pass without its exp2 (timing probe)")
    ap.add_argument("--few_k_rows", type=int, default=0, help="also the flash passes of the first variant with each "
                    "K / V copy cut to this many rows (timing probe: what streaming K and V costs)")
    ap.add_argument("--json", default="", help="also write the rows here")
    a = ap.parse_args(argv)
    if a.few_k_rows and (a.few_k_rows % 8 or a.few_k_rows < 8 or a.few_k_rows >= 128):
        ap.error(f"--few_k_rows must be a multiple of 8 in 8..120 (whole 8-row swizzle tiles), got {a.few_k_rows}")
    tunings = [(spec.strip(), _mgpu_tuning(spec)) for spec in a.mgpu.split(";")]
    if no_gpu("mgpu_prefill_probe"):
        return 1
    rows = []
    for s, hq, kvh, d in shapes(a):
        rows += probe(s, hq, kvh, d, a.tile, a.iters, tunings, fp8=a.fp8, drop_exp2=a.no_exp2, few_k=a.few_k_rows)
    return report(rows, table(rows), a.json)


if __name__ == "__main__":
    sys.exit(main())
