"""fp8 score probe (CPU): does selecting the prefill anchors' Top-k from fp8 (e4m3) logits keep the exact selection?

Issue 22 (session 26): the anchors' two score sweeps (the LSE pass and the pooled-score pass) are Q.K^T at bf16;
`prefill_mgpu` now runs them on float8_e4m3fn q and k (half the MMA time). Whether that is worth wiring as a lever
depends on what fp8 does to the selection, which this measures on a real model's q and k (post-RoPE), every layer:
one dense forward per prompt keeps each layer's q and k; then, per layer, KV head and query tile (tile 32, rolling
budget max(10% of the tile's prefix, min_k)), the pooled post-softmax scores (`reference.pooled_scores_prefill_
reference`) from
  bf16      q and k rounded to bf16 (what the kernels see today; the truth is the fp32 forward's q and k),
  fp8       q and k scaled by a power of two per tensor (amax -> <= 448) and rounded to e4m3,
  fp8s      as fp8 after subtracting each KV head's mean key (softmax is invariant to it: every logit of a query
            row moves by the same q . mean(k)),
  fp8sr     as fp8s after rotating q and k by one normalised Hadamard matrix (q . k is invariant; outlier channels
            are spread over all of them before rounding),
and reports the mass recall of each variant's Top-k: the exact (fp32) pooled mass on its selection over the mass on
the exact Top-k, averaged over (tile, KV head) rows whose budget is below their prefix, and the worst layer. A
variant within 0.5% of bf16's recall at every layer is a lever worth an accuracy cell; one that loses > 1% at some
layer is not, as it is. Decode rows (`--decode_rows` R, the prompt's last R query rows, each pooled over its GQA
group as a decode anchor pools): `dec_bf16` (q and k in bf16) and `dec_fp8s` (q in bf16, k centred and in fp8, as
a decode anchor reading a stored fp8 copy of K would see them), budget max(10% of the row's prefix, min_k).

    python results/accuracy/fp8_score_probe.py --model=qwen2.5-coder-0.5b --context=4096 --samples=2 \
        --out=results/accuracy/<folder>
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kascade_jax.tasks import prompt as prompt_lib  # noqa: E402
from kascade_jax.tasks import ruler  # noqa: E402
from kernels_pallas import reference as R  # noqa: E402
from kernels_pallas.dense import dense_attention  # noqa: E402
from models import load_model  # noqa: E402

VARIANTS = ("bf16", "fp8", "fp8s", "fp8sr")
DEC_VARIANTS = ("dec_bf16", "dec_fp8s")


@dataclasses.dataclass(frozen=True)
class KeepQK:
    """Dense attention that keeps every layer's q [1, T, q_heads, d] and k [1, T, kv_heads, d] in its state."""

    name: str = "keep_qk"

    def attend(self, layer, inputs, state):
        t = inputs.q.shape[1]
        out = dense_attention(inputs.q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len,
                              phase="prefill", chunk_at_zero=inputs.chunk_at_zero)
        return out, (state or ()) + ((inputs.q, inputs.k_cache[:, :t]),)

    def post_attention(self, layer, x, attn_out, state):
        return state


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _forward(graphdef, params, tokens):
    from models import generate as gen
    from models.cache import KVCache

    model = nnx.merge(graphdef, params)
    cache = KVCache.init(model.config, 1, tokens.shape[1], dtype=model.dtype)
    _, _, state = gen.forward(model, tokens, cache, KeepQK(), q_start=0, seq_len=jnp.asarray([tokens.shape[1]]))
    return state


def fp8_round(x):
    """x scaled by a power of two (`reference.fp8_scale`), rounded to float8_e4m3fn and scaled back (exact in fp32)."""
    scale = R.fp8_scale(x)
    return (x * scale).astype(jnp.float8_e4m3fn).astype(jnp.float32) / scale


def hadamard(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return jnp.asarray(h / math.sqrt(d), jnp.float32)


def variant_qk(name, q, k):
    """(q, k) fp32 as the score passes would see them under variant `name`."""
    if name == "bf16":
        return q.astype(jnp.bfloat16).astype(jnp.float32), k.astype(jnp.bfloat16).astype(jnp.float32)
    if name == "fp8s":  # the lever's own operands (`KascadeConfig.prefill_score_fp8`): the same logits
        return R.fp8_score_qk(q, k, jnp.full((q.shape[0],), k.shape[1], jnp.int32))
    if name == "fp8sr":
        h = hadamard(q.shape[-1])
        q, k = q @ h, (k - jnp.mean(k, axis=1, keepdims=True)) @ h
    return fp8_round(q), fp8_round(k)


@functools.partial(jax.jit, static_argnames=("tile", "frac", "min_k"))
def layer_recall(q, k, tile, frac, min_k):
    """{variant: [kv_heads] mean mass recall} and the number of rows counted, for one layer's q, k (fp32)."""
    t = q.shape[1]
    z = jnp.zeros((1,), jnp.int32)
    scale = 1.0 / math.sqrt(q.shape[-1])
    exact, _ = R.pooled_scores_prefill_reference(q, k, z, z + t, tile, scale=scale)  # [1, kvh, tiles, T]
    counts = R.prefill_counts(z, z + t, z + t, t, tile, frac, min_k)[0]  # [tiles]
    _, eligible = R.prefill_eligible(z, z + t, t, tile)
    rows = (counts < eligible[0]) & (counts > 0)  # tiles whose budget leaves keys out
    p = jnp.where(jnp.isfinite(exact), exact, 0.0)
    kk = jnp.arange(t)

    def mass_of_topk(sc):
        order = jnp.argsort(-jnp.where(jnp.isfinite(sc), sc, -jnp.inf), axis=-1)
        rank = jnp.argsort(order, axis=-1)  # rank of each key in this variant's order
        chosen = rank < counts[None, None, :, None]
        return jnp.sum(jnp.where(chosen & (kk < eligible[0][None, None, :, None]), p, 0.0), -1)

    best = mass_of_topk(exact)
    out = {}
    for name in VARIANTS:
        qv, kv = variant_qk(name, q, k)
        sc, _ = R.pooled_scores_prefill_reference(qv, kv, z, z + t, tile, scale=scale)
        rec = mass_of_topk(sc) / jnp.maximum(best, 1e-30)  # [1, kvh, tiles]
        out[name] = jnp.sum(jnp.where(rows[None, None], rec, 0.0), -1)[0] / jnp.maximum(jnp.sum(rows), 1)
    return out, jnp.sum(rows)


@functools.partial(jax.jit, static_argnames=("rows", "frac", "min_k"))
def decode_recall(q, k, rows, frac, min_k):
    """{variant: [kv_heads] mean mass recall} over the last `rows` query rows, each as a decode step (q fp32)."""
    t, hq, d = q.shape[1], q.shape[2], q.shape[3]
    kvh = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    pos = t - rows + jnp.arange(rows)  # each row's own position: it sees keys [0, pos]
    causal = jnp.arange(t)[None, :] <= pos[:, None]  # [rows, T]
    counts = R.topk_budget(pos + 1, frac, min_k)  # [rows]

    def probs(qq, kk):
        qr = qq[0, t - rows:].reshape(rows, kvh, hq // kvh, d)
        lg = jnp.einsum("rkgd,skd->rkgs", qr, kk[0], precision=jax.lax.Precision.HIGHEST) * scale
        lg = jnp.where(causal[:, None, None, :], lg, -jnp.inf)
        return jax.nn.softmax(lg, axis=-1).sum(2)  # [rows, kvh, T]: pooled over the group

    exact = probs(q, k)

    def mass_of_topk(p):
        order = jnp.argsort(-jnp.where(causal[:, None, :], p, -jnp.inf), axis=-1)
        chosen = jnp.argsort(order, axis=-1) < counts[:, None, None]
        return jnp.sum(jnp.where(chosen & causal[:, None, :], exact, 0.0), -1)

    best = mass_of_topk(exact)
    qb = q.astype(jnp.bfloat16).astype(jnp.float32)
    out = {"dec_bf16": mass_of_topk(probs(qb, k.astype(jnp.bfloat16).astype(jnp.float32)))}
    out["dec_fp8s"] = mass_of_topk(probs(qb, fp8_round(k - jnp.mean(k, axis=1, keepdims=True))))
    return {n: jnp.mean(v / jnp.maximum(best, 1e-30), 0) for n, v in out.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tasks", default="niah_multikey_2,qa_1,vt")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=2, help="prompts per task")
    ap.add_argument("--split", default="dev", choices=("dev", "test"))
    ap.add_argument("--tile", type=int, default=32)
    ap.add_argument("--topk_frac", type=float, default=0.1)
    ap.add_argument("--min_k", type=int, default=128)
    ap.add_argument("--decode_rows", type=int, default=16, help="the prompt's last rows probed as decode steps")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if os.path.exists(os.path.join(args.out, "fp8_score_probe.json")):
        raise SystemExit(f"error: {args.out}/fp8_score_probe.json exists; choose another --out")
    model, tok = load_model(args.model, "float32")
    graphdef, params = nnx.split(model)
    L = model.config.num_layers
    sums = {n: np.zeros((L, model.config.kv_heads)) for n in VARIANTS + DEC_VARIANTS}
    prompts = []
    t0 = time.perf_counter()
    for task in args.tasks.split(","):
        for s in ruler.generate_samples(task, tok, args.context, args.samples, split=args.split):
            ids = list(prompt_lib.encode(tok, s["input"]))
            t = len(ids) // args.tile * args.tile  # whole tiles (the prompt's end is dropped, not padded)
            state = _forward(graphdef, params, jnp.asarray([ids[:t]], jnp.int32))
            per = {n: [] for n in VARIANTS + DEC_VARIANTS}
            for layer, (q, k) in enumerate(state):
                rec, n_rows = layer_recall(q.astype(jnp.float32), k.astype(jnp.float32), args.tile, args.topk_frac,
                                           args.min_k)
                rec.update(decode_recall(q.astype(jnp.float32), k.astype(jnp.float32), args.decode_rows,
                                         args.topk_frac, args.min_k))
                for n in VARIANTS + DEC_VARIANTS:
                    v = np.asarray(rec[n])
                    sums[n][layer] += v
                    per[n].append(float(v.mean()))
            prompts.append(dict(task=task, index=s["index"], tokens=t, rows=int(n_rows), recall=per))
            print(f"{task}[{s['index']}] {t} tokens, {time.perf_counter() - t0:.0f} s: "
                  + ", ".join(f"{n} {np.mean(per[n]):.4f} (min layer {np.min(per[n]):.4f})"
                              for n in VARIANTS + DEC_VARIANTS),
                  flush=True)
    cols = VARIANTS + DEC_VARIANTS
    mean = {n: (sums[n] / len(prompts)).mean(-1) for n in cols}  # [L]
    os.makedirs(args.out, exist_ok=True)
    result = dict(model=args.model, context=args.context, tasks=args.tasks, split=args.split, samples=args.samples,
                  tile=args.tile, topk_frac=args.topk_frac, min_k=args.min_k, prompts=len(prompts),
                  seconds=time.perf_counter() - t0, jax=jax.__version__, device=str(jax.devices()[0]),
                  decode_rows=args.decode_rows, mean_recall={n: [float(x) for x in mean[n]] for n in cols},
                  per_prompt=prompts)
    with open(os.path.join(args.out, "fp8_score_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| layer | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for layer in range(L):
        lines.append(f"| {layer} | " + " | ".join(f"{mean[n][layer]:.4f}" for n in cols) + " |")
    lines.append("| mean | " + " | ".join(f"{mean[n].mean():.4f}" for n in cols) + " |")
    lines.append("| worst | " + " | ".join(f"{mean[n].min():.4f}" for n in cols) + " |")
    with open(os.path.join(args.out, "fp8_score_probe.md"), "w") as f:
        f.write(f"fp8 score probe: {args.model}, {args.tasks} at {args.context} ({args.split}, {len(prompts)} prompts), "
                f"tile {args.tile}, Top-k {args.topk_frac:g} (min {args.min_k}): mass recall of each variant's "
                f"Top-k against the exact (fp32) Top-k, per layer (mean over KV heads and prompts); dec_*: the "
                f"last {args.decode_rows} rows as decode steps.\n\n"
                + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
