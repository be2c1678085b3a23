"""Tail probe (CPU): does an estimate of the unselected keys' attention recover what Top-k decode loses on fwe?

Session 17: fwe (the three most frequent words) loses 4-12 points in every decode cell on both Qwens, each layer's
own Top-k 10% (oracle_topk) included. Hypothesis: the frequent words fill far more than k of the context, so any
Top-k keeps an arbitrary part of their occurrences and the counts behind the answer are lost with the tail. Test,
teacher-forced on the gold answer: every layer attends densely over the prompt, and the answer rows (the decode
steps) attend with
  dense     exact attention (the reference);
  topk      each layer's own Top-k (pooled over the GQA group, k = max(frac x keys, min_k)), as oracle_topk decodes;
  topk+tail the same, plus every block of BLOCK keys summarised by its unselected keys' mean key and value, weighted
            by their count (a softmax term log(count) + q.mean_key): an estimate of the lost mass and its value;
  topk+tailb the same, but only blocks with no selected key (what a kernel gets cheaply from per-block sums);
  topk+tailm every block's mean over all its keys, weighted by its unselected count (per-block sums kept with the
            cache and a histogram of the selected indices: the kernel-friendly estimate of the whole tail);
  top3k     each layer's own Top-3k (the budget lever of session 17); topCk any multiple C of the budget;
  topk+samp the Top-k plus every STRIDE-th unselected key, each weighted by STRIDE (a softmax term + log STRIDE):
            a ratio estimate of the unselected keys' numerator and denominator from a uniform sample (as vAttention
            and MagicPIG sample the tail), at 1/STRIDE more budget (session 19: at dense on fwe here, over each
            layer's own Top-k; over a reuse layer's anchor selection, the strategy lever `decode_tail_stride`,
            it lost 4-6 points in the eval: keys the anchor missed get STRIDE times their weight);
  topk+stride the same keys without the weight (a larger selection, no estimate);
  toppP     per row and KV head the fewest keys that hold mass P of the pooled attention (at least min_k): an
            adaptive budget (as Twilight's top-p), large where attention is flat (counting) and small where it is
            peaked; its mean budget is measured and reported beside the fixed ones;
and the answer tokens' log-probability and argmax agreement with dense are compared. If topk+tail recovers more
than half of topk's log-probability gap on fwe and changes nothing on niah, a tail term is worth a kernel.
Session 18 (16K, GPU): the block-mean tails are worse than topk on fwe, top3k is at dense. Session 19's question:
does the sampled tail beat the same budget spent on the Top-k (topk+samp vs top1.5k at STRIDE 20)?

    python results/accuracy/tail_probe.py --model=qwen2.5-coder-0.5b --tasks=fwe,niah_multikey_2 --context=4096 \
        --samples=4 --out=results/accuracy/<folder>
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kascade_jax.tasks import prompt as prompt_lib  # noqa: E402
from kascade_jax.tasks import ruler  # noqa: E402
from kernels_pallas.dense import dense_attention  # noqa: E402
from models import load_model  # noqa: E402
from shift_probe import _probe_forward  # noqa: E402  (the same one-forward helper, out="logprobs")

VARIANTS = ("dense", "topk", "topk+tail", "topk+tailb", "topk+tailm", "top3k")  # the default set (session 17)
EXTRA = ("top1.5k", "topk+samp", "topk+stride", "topp0.9")  # session 19 (--variants)
_MULT = re.compile(r"top(\d+(?:\.\d+)?)k$")
_TOPP = re.compile(r"topp(0?\.\d+)$")
_BUDGETS: list[float] = []  # toppP: each layer's mean fraction of the keys selected, appended as the forward runs


def _record_budget(x):
    _BUDGETS.append(float(x))


def fixed_budget(variant: str, frac: float, stride: int) -> float | None:
    """The fraction of keys a variant attends (before min_k), None for toppP (measured) and dense."""
    mult = _MULT.match(variant)
    if mult or variant.startswith("topk"):
        return frac * (float(mult.group(1)) if mult else 1.0) + (1 / stride if variant in ("topk+samp",
                                                                                           "topk+stride") else 0.0)
    return None


def check_variant(v: str) -> str:
    if v in VARIANTS or v in EXTRA or _MULT.match(v) or (_TOPP.match(v) and 0 < float(_TOPP.match(v).group(1)) < 1):
        return v
    raise ValueError(f"unknown variant {v!r}; have {', '.join(VARIANTS + EXTRA)}, topCk (C times the budget) "
                     f"or toppP (0 < P < 1)")


@dataclasses.dataclass(frozen=True)
class TailProbe:
    """Dense attention for every row but the last `rows` valid ones (the answer steps), which attend as `variant`."""

    rows: int
    variant: str
    frac: float = 0.1
    min_k: int = 128
    block: int = 64
    stride: int = 20  # topk+samp / topk+stride: every stride-th key
    name: str = "tail_probe"

    def attend(self, layer, inputs, state):
        q = inputs.q  # [1, T, hq, d]
        t, hq, d = q.shape[1], q.shape[2], q.shape[3]
        out = dense_attention(q, inputs.k_cache, inputs.v_cache, inputs.q_start, inputs.kv_len, phase="prefill",
                              chunk_at_zero=inputs.chunk_at_zero)
        if self.variant == "dense":
            return out, state
        k = inputs.k_cache[0, :t].astype(jnp.float32)  # [T, kvh, d]
        v = inputs.v_cache[0, :t].astype(jnp.float32)
        kvh, g = k.shape[1], hq // k.shape[1]
        first = inputs.kv_len[0] - self.rows
        qr = jax.lax.dynamic_slice_in_dim(q[0], first, self.rows, axis=0).astype(jnp.float32)
        qr = qr.reshape(self.rows, kvh, g, d)
        pos = first + jnp.arange(self.rows)
        valid = jnp.arange(t)[None, :] <= pos[:, None]  # [rows, T]
        logits = jnp.einsum("rkgd,skd->rkgs", qr, k, precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
        logits = jnp.where(valid[:, None, None, :], logits, -jnp.inf)
        pooled = jax.nn.softmax(logits, axis=-1).sum(2)  # [rows, kvh, T]
        mult = _MULT.match(self.variant)
        frac = self.frac * (float(mult.group(1)) if mult else 1.0)
        n = pos + 1
        kk = jnp.minimum(jnp.maximum(jnp.ceil(frac * n).astype(jnp.int32), self.min_k), n)  # [rows]
        srt = -jnp.sort(-pooled, axis=-1)  # descending
        kk = kk[:, None].repeat(kvh, 1)  # [rows, kvh]
        topp = _TOPP.match(self.variant)
        if topp:  # the fewest keys reaching mass P (pooled over the group: the total is g), at least min_k
            reach = (jnp.cumsum(srt, axis=-1) / g < float(topp.group(1))).sum(-1) + 1
            kk = jnp.minimum(jnp.maximum(reach, jnp.minimum(self.min_k, n)[:, None]), n[:, None])
            jax.debug.callback(_record_budget, (kk / n[:, None]).mean())
        thr = jnp.take_along_axis(srt, (kk - 1)[..., None], axis=-1)  # [rows, kvh, 1]
        sel = (pooled >= thr) & valid[:, None, :]  # [rows, kvh, T]
        sl = jnp.where(sel[:, :, None, :], logits, -jnp.inf)  # [rows, kvh, g, T]
        if self.variant == "topk" or mult or topp:
            o = jnp.einsum("rkgs,skd->rkgd", jax.nn.softmax(sl, axis=-1), v, precision=jax.lax.Precision.HIGHEST)
        elif self.variant in ("topk+samp", "topk+stride"):
            samp = ((jnp.arange(t) % self.stride) == 0)[None, None, :] & valid[:, None, :] & ~sel  # [rows, kvh, T]
            w = math.log(self.stride) if self.variant == "topk+samp" else 0.0
            sl = jnp.where(samp[:, :, None, :], logits + w, sl)
            o = jnp.einsum("rkgs,skd->rkgd", jax.nn.softmax(sl, axis=-1), v, precision=jax.lax.Precision.HIGHEST)
        else:
            nb = -(-t // self.block)
            pad = nb * self.block - t
            unsel = (valid[:, None, :] & ~sel).astype(jnp.float32)  # [rows, kvh, T]
            if self.variant == "topk+tailb":  # only blocks no selected key falls in
                touched = jnp.pad(sel, ((0, 0), (0, 0), (0, pad))).reshape(self.rows, kvh, nb, self.block).any(-1)
                unsel = unsel * jnp.repeat(~touched, self.block, axis=-1)[..., :t]
            ub = jnp.pad(unsel, ((0, 0), (0, 0), (0, pad))).reshape(self.rows, kvh, nb, self.block)
            kb = jnp.pad(k, ((0, pad), (0, 0), (0, 0))).reshape(nb, self.block, kvh, d)
            vb = jnp.pad(v, ((0, pad), (0, 0), (0, 0))).reshape(nb, self.block, kvh, d)
            cnt = ub.sum(-1)  # [rows, kvh, nb]
            # tailm: the mean of every valid key of the block (a kernel keeps per-block sums with the cache),
            # weighted by the unselected count (a histogram of the selected indices); else the unselected keys' mean
            w = (jnp.pad(valid, ((0, 0), (0, pad))).reshape(self.rows, 1, nb, self.block).astype(jnp.float32)
                 * jnp.ones((1, kvh, 1, 1)) if self.variant == "topk+tailm" else ub)
            kmean = jnp.einsum("rkbj,bjkd->rkbd", w, kb, precision=jax.lax.Precision.HIGHEST) / jnp.maximum(
                w.sum(-1), 1)[..., None]
            vmean = jnp.einsum("rkbj,bjkd->rkbd", w, vb, precision=jax.lax.Precision.HIGHEST) / jnp.maximum(
                w.sum(-1), 1)[..., None]
            bl = jnp.einsum("rkgd,rkbd->rkgb", qr, kmean, precision=jax.lax.Precision.HIGHEST) / math.sqrt(d)
            bl = jnp.where(cnt[:, :, None, :] > 0, bl + jnp.log(jnp.maximum(cnt, 1))[:, :, None, :], -jnp.inf)
            p = jax.nn.softmax(jnp.concatenate([sl, bl], axis=-1), axis=-1)
            o = (jnp.einsum("rkgs,skd->rkgd", p[..., :t], v, precision=jax.lax.Precision.HIGHEST)
                 + jnp.einsum("rkgb,rkbd->rkgd", p[..., t:], vmean, precision=jax.lax.Precision.HIGHEST))
        o = o.reshape(1, self.rows, hq, d).astype(out.dtype)
        return jax.lax.dynamic_update_slice_in_dim(out, o, first, axis=1), state

    def post_attention(self, layer, x, attn_out, state):
        return state


def _save(args, per_prompt, t0, done: bool) -> str:
    """Write tail_probe.json / .md from the prompts so far (after every prompt: a stopped run keeps them)."""
    summary = {}
    for task in args.tasks.split(","):
        recs = [r for r in per_prompt if r["task"] == task]
        if not recs:
            continue
        summary[task] = dict(prompts=len(recs), **{
            f"{v}_dlogprob": float(np.mean([r[f"{v}_logprob"] - r["dense_logprob"] for r in recs]))
            for v in args.variants[1:]},
            **{f"{v}_agree": float(np.mean([r[f"{v}_agree"] for r in recs])) for v in args.variants[1:]},
            **{f"{v}_budget": float(np.mean([r[f"{v}_budget"] for r in recs])) for v in args.variants[1:]
               if all(r.get(f"{v}_budget") is not None for r in recs)})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tail_probe.json"), "w") as f:
        json.dump(dict(vars(args), jax=jax.__version__, device=str(jax.devices()[0]), seconds=time.perf_counter() - t0,
                       done=done, summary=summary, per_prompt=per_prompt), f, indent=1)
    lines = ["| task | prompts | " + " | ".join(f"{v} dlogp / agree" for v in args.variants[1:]) + " |",
             "|---|---|" + "---|" * (len(args.variants) - 1)]
    for task, m in summary.items():
        lines.append(f"| {task} | {m['prompts']} | " + " | ".join(
            f"{m[f'{v}_dlogprob']:+.3f} / {m[f'{v}_agree']:.3f}" for v in args.variants[1:]) + " |")
    for task, m in summary.items():  # the fraction of keys each variant attends (toppP: measured, mean over layers)
        lines.append(f"| {task}: budget | | " + " | ".join(
            f"{m[f'{v}_budget']:.3f}" if f"{v}_budget" in m else "-" for v in args.variants[1:]) + " |")
    text = (f"Tail probe: {args.model} ({args.dtype}), {args.tasks} at {args.context} ({args.split}), Top-k "
            f"{args.topk_frac} (min_k {args.min_k}), tail blocks of {args.block}, sample stride {args.stride}. The first {args.answer_steps} gold "
            "answer tokens teacher-forced; dlogp: the answer's log-probability minus dense's, mean per prompt "
            "(nats); agree: the share of answer steps whose argmax equals dense's."
            + ("" if done else " **Partial: the run has not finished.**") + "\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(args.out, "tail_probe.md"), "w") as f:
        f.write(text)
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--tasks", default="fwe,niah_multikey_2")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--split", default="dev", choices=("dev", "test"))
    ap.add_argument("--topk_frac", type=float, default=0.1)
    ap.add_argument("--min_k", type=int, default=128)
    ap.add_argument("--block", type=int, default=64, help="keys per tail block")
    ap.add_argument("--stride", type=int, default=20, help="topk+samp / topk+stride: every STRIDE-th key")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"dense first, then any of {', '.join(VARIANTS[1:] + EXTRA)} or topCk")
    ap.add_argument("--answer_steps", type=int, default=8, help="answer tokens probed per prompt (the first ones)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        args.variants = [check_variant(v) for v in args.variants.split(",")]
    except ValueError as e:
        raise SystemExit(f"error: --variants: {e}") from None
    if args.variants[0] != "dense" or len(set(args.variants)) != len(args.variants) or len(args.variants) < 2:
        raise SystemExit(f"error: --variants must start with dense, name each variant once and at least one more; got "
                         f"{','.join(args.variants)}")
    if args.stride < 1:
        raise SystemExit(f"error: --stride must be >= 1, got {args.stride}")
    if os.path.exists(os.path.join(args.out, "tail_probe.json")):
        raise SystemExit(f"error: {args.out}/tail_probe.json exists; choose another --out")
    model, tok = load_model(args.model, args.dtype)
    graphdef, params = nnx.split(model)
    width = -(-(args.context + args.answer_steps) // 64) * 64  # one padded length and row count: one compile a variant
    t0, per_prompt = time.perf_counter(), []
    for task in args.tasks.split(","):
        for s in ruler.generate_samples(task, tok, args.context, args.samples, split=args.split):
            prompt = prompt_lib.encode(tok, s["input"])
            answer = list(prompt_lib.encode(tok, " " + ", ".join(s["answers"])))
            if len(answer) < args.answer_steps:
                raise SystemExit(f"error: {task}[{s['index']}]'s answer has {len(answer)} tokens, fewer than "
                                 f"--answer_steps={args.answer_steps}")
            answer = answer[: args.answer_steps]
            ids = list(prompt) + answer[:-1]  # row len(prompt) - 1 + i predicts answer token i
            if len(ids) > width:
                raise SystemExit(f"error: {task}[{s['index']}] has {len(ids)} tokens, more than the {width} padded")
            tokens = np.zeros((1, width), np.int32)
            tokens[0, : len(ids)] = ids
            rows = len(answer)
            res = {}
            for var in args.variants:
                strat = TailProbe(rows=rows, variant=var, frac=args.topk_frac, min_k=args.min_k, block=args.block,
                                  stride=args.stride)
                _BUDGETS.clear()
                lp = np.asarray(_probe_forward(graphdef, params, jnp.asarray(tokens),
                                               jnp.asarray([len(ids)], jnp.int32), strat, out="logprobs"))
                jax.effects_barrier()
                budget = float(np.mean(_BUDGETS)) if _BUDGETS else fixed_budget(var, args.topk_frac, args.stride)
                steps = lp  # [rows, vocab]: row i predicts answer token i
                res[var] = dict(logprob=float(sum(steps[i, a] for i, a in enumerate(answer))),
                                argmax=[int(x) for x in steps.argmax(-1)], budget=budget)
            dense_arg = res["dense"]["argmax"]
            rec = dict(task=task, index=s["index"], prompt_tokens=len(prompt), answer_tokens=rows,
                       **{f"{v}_logprob": res[v]["logprob"] for v in args.variants},
                       **{f"{v}_agree": float(np.mean([a == b for a, b in zip(res[v]["argmax"], dense_arg)]))
                          for v in args.variants[1:]},
                       **{f"{v}_budget": res[v]["budget"] for v in args.variants[1:]},
                       dense_gold_argmax=float(np.mean([a == b for a, b in zip(dense_arg, answer)])))
            per_prompt.append(rec)
            _save(args, per_prompt, t0, done=False)
            print(f"{task}[{s['index']}] {len(prompt)}+{rows} tokens, {time.perf_counter() - t0:.0f} s: "
                  + ", ".join(f"{v} {rec[f'{v}_logprob']:.2f}" for v in args.variants), flush=True)
    print(_save(args, per_prompt, t0, done=True))


if __name__ == "__main__":
    main()
