"""Decode shift probe (CPU): where does a reuse layer's lost decode mass lie, relative to its anchor's selection?

Session 7 found the whole decode loss of `dps` in the reuse (oracle Top-k per layer is within noise of dense) and
miscopied digits on niah_multikey_2. Hypothesis: copying heads in a reuse layer attend to the key right after one
the anchor attends to (the induction offset), so the anchor's set misses it. Test: per reuse layer, the decode
attention mass on
  sel     the anchor's Top-k (through the head map), as Kascade decodes;
  orc     the layer's own Top-k (oracle_topk);
  half+1  the anchor's Top-(k/2) and each of those keys' right neighbours (at most k keys: the same budget);
  sel+1   the anchor's Top-k and their right neighbours (at most 2k keys), against
  sel2k   the anchor's Top-2k (the same 2k budget spent on more of the anchor's order).
If half+1 > sel and sel+1 > sel2k, a shifted selection is a decode lever worth a dev cell; if not, it is not.

One dense forward per prompt over prompt + gold answer (teacher forcing): the query of answer step s is the row
before answer token s, and it sees exactly the keys a decode step would. Masses are means over the GQA group of
post-softmax mass (pooled over the group, as the decode Top-k is), over answer steps and prompts.

    python results/accuracy/shift_probe.py --model=qwen2.5-coder-0.5b --recipe=candidate:dps \
        --tasks=niah_multikey_2,niah_multikey_3,vt --context=4096 --samples=4 --out=results/accuracy/<folder>
(on a GPU add --dtype=bfloat16: the dense outputs then run through cuDNN, and 16K takes seconds per prompt)
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
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from kascade_jax import api  # noqa: E402
from kascade_jax.calibration.head_map import anchor_of_layers  # noqa: E402
from kascade_jax.tasks import prompt as prompt_lib  # noqa: E402
from kascade_jax.tasks import ruler  # noqa: E402
from kernels_pallas.dense import dense_attention  # noqa: E402
from kernels_pallas.reference import decode_counts  # noqa: E402
from models import load_model  # noqa: E402


@dataclasses.dataclass(frozen=True)
class ProbeStrategy:
    """Dense attention that also keeps, per layer, the group-pooled post-softmax probabilities of the last `rows`
    valid query rows of each sequence (the answer steps): state = tuple of [batch, rows, kv_heads, T] fp32. The
    rows follow the traced sequence length, so one compile serves every prompt of a padded length."""

    rows: int
    label: int = 0  # > 0: also the group-pooled probabilities from `label` channels of q.k (approximate reranks)
    name: str = "shift_probe"

    def attend(self, layer, inputs, state):
        q = inputs.q  # [1, T, hq, d]
        t, hq, d = q.shape[1], q.shape[2], q.shape[3]
        k = inputs.k_cache[:, :t]
        kvh = k.shape[2]
        out = dense_attention(q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len, phase="prefill",
                              chunk_at_zero=inputs.chunk_at_zero)  # cuDNN on a GPU (bf16): no [T, T] scores
        first = inputs.kv_len[0] - self.rows
        qr = jax.lax.dynamic_slice_in_dim(q, first, self.rows, axis=1).astype(jnp.float32)
        qr = qr.reshape(1, self.rows, kvh, hq // kvh, d)
        logits = jnp.einsum("brkgd,bskd->brkgs", qr, k.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
        pos = first + jnp.arange(self.rows)
        logits = jnp.where(jnp.arange(t)[None, None, None, None, :] <= pos[None, :, None, None, None], logits, -jnp.inf)
        causal = jnp.arange(t)[None, None, None, None, :] <= pos[None, :, None, None, None]
        p = jax.nn.softmax(logits, axis=-1).sum(3)  # [1, rows, kv_heads, T]: pooled over the group
        variants = [p]
        if self.label:  # scores from `label` channels: per query (SparQ) and fixed per KV head (in-sample)
            kf = k.astype(jnp.float32)
            aq = jnp.abs(qr)
            thr = jax.lax.top_k(aq, self.label)[0][..., -1:]
            per_query = (aq >= thr).astype(jnp.float32)
            first_key = jnp.arange(t) < first  # the prompt's keys before the probed rows
            kmag = jnp.sum(jnp.abs(kf) * first_key[None, :, None, None], axis=1) / jnp.maximum(first, 1)  # [1, kvh, d]
            imp = aq.mean(axis=(1, 3)) * kmag  # [1, kvh, d]
            fthr = jax.lax.top_k(imp, self.label)[0][..., -1:]
            fixed = (imp >= fthr).astype(jnp.float32)[:, None, :, None, :]
            for m in (per_query, fixed):
                qm = qr * m
                temp = jnp.sqrt(d * jnp.sum(jnp.abs(qm), -1, keepdims=True) / jnp.maximum(jnp.sum(aq, -1, keepdims=True), 1e-30))
                lg = jnp.einsum("brkgd,bskd->brkgs", qm / jnp.maximum(temp, 1e-30), kf, precision=jax.lax.Precision.HIGHEST)
                variants.append(jax.nn.softmax(jnp.where(causal, lg, -jnp.inf), axis=-1).sum(3))
        return out, (state or ()) + (jnp.stack(variants),)

    def post_attention(self, layer, x, attn_out, state):
        return state


@functools.partial(jax.jit, static_argnames=("graphdef", "strategy", "out"))
def _probe_forward(graphdef, params, tokens, seq_len, strategy, out="state"):
    """One forward of a padded prompt [1, T] under a probe strategy (its `rows`: the last valid rows probed).
    out="state": the strategy's per-layer state stacked, [L, ...]; "logprobs": the log-softmax of those rows'
    logits, [rows, vocab] (tail_probe.py)."""
    from models import generate as gen
    from models.cache import KVCache

    model = nnx.merge(graphdef, params)
    cache = KVCache.init(model.config, 1, tokens.shape[1], dtype=model.dtype)
    logits, _, state = gen.forward(model, tokens, cache, strategy, q_start=0, seq_len=seq_len)
    if out == "state":
        return jnp.stack(state)  # [L, variants, 1, rows, kv_heads, T]
    rows = jax.lax.dynamic_slice_in_dim(logits[0], seq_len[0] - strategy.rows, strategy.rows, axis=0)
    return jax.nn.log_softmax(rows, axis=-1)


def _mass(p, keys):
    """p [T] pooled mass of one (row, KV head), keys: int array (may hold duplicates / out-of-range) -> mass."""
    keys = np.unique(keys[(keys >= 0) & (keys < p.shape[0])])
    return float(p[keys].sum())


def _topk_mass(p, src, k, sinks, window):
    """Mass of p on the Top-k of src with the forced keys (the first `sinks`, the last `window`) first, as the
    kernels order them; also returns the order (for the variants)."""
    kv_len = src.shape[0]
    src = src.copy()
    src[:sinks] = np.inf
    src[max(kv_len - window, 0):] = np.inf
    order = np.argsort(-src, kind="stable")
    return _mass(p, order[:k]), order


def _fill(first, order, k):
    """The keys `first` (in order, unique), then `order`'s keys not among them, up to k keys in all."""
    first = list(dict.fromkeys(int(x) for x in first))[:k]
    seen = set(first)
    rest = [int(x) for x in order[: k + len(first)] if int(x) not in seen]
    return np.asarray(first + rest[: k - len(first)], np.int64)


def layer_masses(probs, first_row, anchors, head_map, group, topk_frac, min_k, sinks=0, window=0, obs=None,
                 pool_all=False, approx=None):
    """probs [L, rows, kv_heads, T] (pooled, row r sees keys <= first_row + r) -> ({metric: [L] mean mass},
    src [L, kv_heads, anchors, kv_heads]: the mean mass of every possible source (earlier anchor a, its head g),
    NaN where a is after the layer). Masses are of the layer's group-mean attention, over the answer steps."""
    L, rows, kvh, _ = probs.shape
    anchor_of = anchor_of_layers(anchors, L)
    names = ("sel", "orc", "half+1", "sel+1", "sel2k", "sel3k", "sel-1", "best_step", "rerank2", "rerank4")
    if obs is not None:  # obs [L, kv_heads, T]: each layer's pooled mass over the prompt's last rows (its own static set)
        names += ("snap", "snap+sel", "sel+snap4", "sel1.25k")
    approx = approx or {}  # name -> [L, rows, kv_heads, T] approximate pooled probabilities (the rerank's ranking)
    names += tuple(f"rerank{c}_{a}" for a in approx for c in (2, 4))
    out = {n: np.full(L, np.nan) for n in names}
    src_mass = np.full((L, kvh, len(anchors), kvh), np.nan)
    for layer in range(L):
        if layer in anchors:
            continue
        acc = {n: [] for n in names}
        cand = np.zeros((rows, kvh, len(anchors), kvh))
        for r in range(rows):
            kv_len = first_row + r + 1
            k = int(decode_counts(jnp.asarray([kv_len]), topk_frac, min_k)[0])
            forced = min(sinks, kv_len) + min(window, kv_len)
            for h in range(kvh):
                p = probs[layer, r, h, :kv_len] / group
                a_src = (probs[anchor_of[layer], r, :, :kv_len].sum(0) if pool_all
                         else probs[anchor_of[layer], r, head_map[layer][h], :kv_len])
                sel, order = _topk_mass(p, a_src, k, sinks, window)
                top, top2 = order[:k], order[:2 * k]
                half = order[:forced + max(k - forced, 0) // 2]  # the forced keys + half of the rest
                acc["sel"].append(sel)
                acc["orc"].append(float(np.sort(p)[::-1][:k].sum()))
                acc["half+1"].append(_mass(p, np.concatenate([half, half + 1])))
                acc["sel+1"].append(_mass(p, np.concatenate([top, top + 1])))
                acc["sel2k"].append(_mass(p, top2))
                acc["sel3k"].append(_mass(p, order[: 3 * k]))
                acc["sel-1"].append(_mass(p, np.concatenate([top, top - 1])))
                if obs is not None:  # the layer's own static set from the prompt's end (SnapKV-like), alone and mixed
                    o = np.zeros(kv_len)
                    o[: min(obs.shape[-1], kv_len)] = obs[layer, h, :kv_len]
                    _, sorder = _topk_mass(p, o, k, sinks, window)
                    acc["snap"].append(_mass(p, sorder[:k]))
                    acc["snap+sel"].append(_mass(p, _fill(sorder[: forced + max(k - forced, 0) // 2], order, k)))
                    acc["sel+snap4"].append(_mass(p, np.concatenate([order[:k], sorder[: forced + k // 4]])))
                    acc["sel1.25k"].append(_mass(p, order[: k + k // 4]))
                for c in (2, 4):  # the layer's own Top-k among the anchor's Top-(c k): a rerank by its own scores
                    cands = order[: c * k]
                    acc[f"rerank{c}"].append(float(np.sort(p[cands])[::-1][:k].sum()))
                    for a, ap in approx.items():  # the same rerank, ranked by the approximate scores
                        ranked = cands[np.argsort(-ap[layer, r, h, cands], kind="stable")[:k]]
                        acc[f"rerank{c}_{a}"].append(_mass(p, ranked))
                for ai, a in enumerate(anchors):
                    for g in range(kvh):
                        cand[r, h, ai, g] = (_topk_mass(p, probs[a, r, g, :kv_len], k, sinks, window)[0]
                                             if a <= layer else np.nan)
                acc["best_step"].append(float(np.nanmax(cand[r, h])))
        for n in names:
            out[n][layer] = float(np.mean(acc[n]))
        src_mass[layer] = cand.mean(0)
    return out, src_mass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--recipe", default="candidate:dps")
    ap.add_argument("--tasks", default="niah_multikey_2,vt")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--split", default="dev", choices=("dev", "test"))
    ap.add_argument("--answer_steps", type=int, default=8, help="decode steps probed per prompt (answer tokens)")
    ap.add_argument("--obs_rows", type=int, default=0,
                    help="also probe each layer's own static set from the prompt's last OBS_ROWS query rows (snap*)")
    ap.add_argument("--label", type=int, default=0,
                    help="also rerank by scores from LABEL channels of q.k: the query's largest |q| (sparq) and fixed "
                         "per KV head by mean |q| x mean |k| over the prompt (fix, chosen in-sample)")
    ap.add_argument("--topk_frac", type=float, default=0.1)
    ap.add_argument("--min_k", type=int, default=128)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the model's dtype (bfloat16 on a GPU: the dense output through cuDNN)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if os.path.exists(os.path.join(args.out, "shift_probe.json")):
        raise SystemExit(f"error: {args.out}/shift_probe.json exists; choose another --out")
    model, tok = load_model(args.model, args.dtype)
    strat = api.strategy_for(model, recipe=args.recipe, model_name=args.model, tokenizer=tok, calibrate=False)
    cfg = strat.config
    anchors = tuple(cfg.anchors)
    head_map = ([[h for h in range(model.config.kv_heads)]] * model.config.num_layers if cfg.head_map is None
                else [list(cfg.head_map_row(i)) for i in range(model.config.num_layers)])
    group = model.config.q_heads // model.config.kv_heads
    graphdef, params = nnx.split(model)
    probe = ProbeStrategy(rows=args.obs_rows + args.answer_steps, label=args.label)
    pool_all = getattr(cfg, "pool", "gqa") == "all"
    width = -(-(args.context + args.answer_steps) // 64) * 64  # one padded length: one compile
    per_prompt, src_sum = [], None
    t0 = time.perf_counter()
    for task in args.tasks.split(","):
        for s in ruler.generate_samples(task, tok, args.context, args.samples, split=args.split):
            prompt = prompt_lib.encode(tok, s["input"])
            answer = prompt_lib.encode(tok, " " + ", ".join(s["answers"]))
            if len(answer) < args.answer_steps:
                raise SystemExit(f"error: {task}[{s['index']}]'s answer has {len(answer)} tokens, fewer than "
                                 f"--answer_steps={args.answer_steps}")
            ids = list(prompt) + list(answer[: args.answer_steps - 1])  # step s predicts answer token s
            if len(ids) > width:
                raise SystemExit(f"error: {task}[{s['index']}] has {len(ids)} tokens, more than the {width} padded")
            tokens = np.zeros((1, width), np.int32)
            tokens[0, : len(ids)] = ids
            probs = np.asarray(_probe_forward(graphdef, params, jnp.asarray(tokens),
                                              jnp.asarray([len(ids)], jnp.int32), probe))[:, :, 0]
            variants, probs = probs[:, 1:, args.obs_rows:], probs[:, 0]
            approx = {f"{n}{args.label}": variants[:, i] for i, n in enumerate(("sparq", "fix")[: variants.shape[1]])}
            first_row = len(prompt) - 1
            obs = probs[:, : args.obs_rows].sum(1) if args.obs_rows else None  # [L, kv_heads, T]: prompt rows
            m, src_mass = layer_masses(probs[:, args.obs_rows:], first_row, anchors, head_map, group, args.topk_frac,
                                       args.min_k, cfg.sink_tokens, cfg.recent_window, obs=obs, pool_all=pool_all,
                                       approx=approx)
            src_sum = src_mass if src_sum is None else src_sum + src_mass
            per_prompt.append(dict(task=task, index=s["index"], prompt_tokens=len(prompt), answer_steps=args.answer_steps,
                                   masses={k: [None if np.isnan(x) else float(x) for x in v] for k, v in m.items()}))
            print(f"{task}[{s['index']}] {len(prompt)}+{args.answer_steps} tokens, {time.perf_counter() - t0:.0f} s: "
                  + ", ".join(f"{k} {np.nanmean(v):.3f}" for k, v in m.items()), flush=True)
    L = model.config.num_layers
    with warnings.catch_warnings():  # anchor layers are NaN in every prompt
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = {k: np.nanmean(np.asarray([p["masses"][k] for p in per_prompt], float), axis=0)
                for k in per_prompt[0]["masses"]}
        src_mean = src_sum / len(per_prompt)  # [L, kv_heads, anchors, kv_heads]
        flat = src_mean.reshape(L, src_mean.shape[1], -1)
        best = np.where(np.isnan(flat).all(-1), -1, np.argmax(np.nan_to_num(flat, nan=-1.0), -1))  # [L, kv_heads]
        mean["best_src"] = np.nanmax(flat, -1).mean(-1)  # in-sample: the best (anchor, head) per (layer, head)
    best_src = [[None if b < 0 else [int(anchors[b // src_mean.shape[3]]), int(b % src_mean.shape[3])] for b in row]
                for row in best]
    os.makedirs(args.out, exist_ok=True)
    cols = ("sel", "orc", "best_src", "best_step", "rerank2", "rerank4", "half+1", "sel+1", "sel2k", "sel3k", "sel-1")
    cols += tuple(c for c in ("snap", "snap+sel", "sel+snap4", "sel1.25k") if c in mean)
    cols += tuple(c for c in mean if c.startswith("rerank") and "_" in c)
    result = dict(model=args.model, dtype=args.dtype, recipe=args.recipe, anchors=anchors, head_map=head_map, context=args.context,
                  tasks=args.tasks, split=args.split, samples=args.samples, topk_frac=args.topk_frac, min_k=args.min_k,
                  answer_steps=args.answer_steps, obs_rows=args.obs_rows, label=args.label, pool=getattr(cfg, "pool", "gqa"), seconds=time.perf_counter() - t0, jax=jax.__version__,
                  device=str(jax.devices()[0]),
                  mean={k: [None if np.isnan(x) else float(x) for x in mean[k]] for k in cols},
                  best_source=best_src, source_mass=np.where(np.isnan(src_mean), -1.0, src_mean).round(4).tolist(),
                  per_prompt=per_prompt)
    with open(os.path.join(args.out, "shift_probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| layer | anchor (head map) | " + " | ".join(cols) + " | best source (anchor:head per KV head) |",
             "|---|---|" + "---|" * len(cols) + "---|"]
    anchor_of = anchor_of_layers(anchors, L)
    for layer in range(L):
        if layer in anchors:
            continue
        lines.append(f"| {layer} | {anchor_of[layer]} ({','.join(map(str, head_map[layer]))}) | "
                     + " | ".join(f"{mean[k][layer]:.3f}" for k in cols) + " | "
                     + " ".join(f"{a}:{g}" for a, g in best_src[layer]) + " |")
    lines.append("| mean | | " + " | ".join(f"{np.nanmean(mean[k]):.3f}" for k in cols) + " | |")
    with open(os.path.join(args.out, "shift_probe.md"), "w") as f:
        f.write(f"Shift probe: {args.model}, recipe {args.recipe} (anchors {list(anchors)}), {args.tasks} at "
                f"{args.context} ({args.split}, {len(per_prompt)} prompts, {args.answer_steps} gold answer tokens "
                f"teacher-forced), Top-k {args.topk_frac}, min_k {args.min_k}. Decode attention mass per reuse layer "
                f"(mean over the GQA group, answer steps and prompts). sel: the anchor's Top-k through the head map "
                f"(Kascade); orc: the layer's own Top-k; best_src: the best single (earlier anchor, head) per KV "
                f"head, chosen on these prompts; best_step: the best source per step; rerankC: the layer's own Top-k among the "
                f"anchor's Top-(C k) (exact p, so an upper bound of a rerank by the layer's own scores); half+1: the anchor's Top-k/2 "
                f"and their right neighbours (budget k); sel+1 / sel2k / sel-1: budget 2k; sel3k: the anchor's Top-3k; snap: the layer's own Top-k of its "
                f"pooled mass over the prompt's last {args.obs_rows} rows (a static set, budget k); snap+sel: half of "
                f"that, filled to k from the anchor's order; sel+snap4: the anchor's Top-k and the static Top-k/4; "
                f"sel1.25k: the anchor's Top-1.25k (the same budget); rerankC_sparqR / rerankC_fixR: rerankC ranked by "
                f"scores from R channels of q.k (the query's largest |q|, SparQ-like; or fixed per KV head, chosen "
                f"in-sample by mean |q| x mean |k|), its mass under the exact p.\n\n"
                + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
