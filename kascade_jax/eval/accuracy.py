"""The accuracy report: every strategy against dense on the same prompts, with paired bootstrap intervals.

Input: the `examples.jsonl` of one or more `experiments.eval` runs (one record per prompt and strategy, failures
included with score 0). Cells are (model, context length, split, strategy, config). For each cell:
- per-task scores (mean over its prompts, in %) and the RULER average `ruler_avg` (the unweighted mean of the
  13 task means, as RULER reports it);
- a 95% interval from a stratified bootstrap (prompts resampled within each task, 2000 draws, seeded);
- the difference to dense on the SAME prompts, `diff_vs_dense`, with a paired stratified bootstrap interval (one
  draw of prompt indices per task, applied to both the strategy and dense), so prompt difficulty cancels.
A cell without its dense twin (same model, length, split, task and prompt indices) gets no difference.

Also here: the recipe choice on the development split (`choose_recipe`): the fastest candidate within
`within_dense` points of dense, or without `within_dense` the best dev score within `max_slowdown` of the paper
recipe's speed. The speed model is `attention_cost`: per-layer kernel ratios to cuDNN, the constants below or
those measured at the model's own shape (`bench_ratios`).

Deliberately not here: running evaluations (`suite`), plotting beyond the two report figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

REPS = 2000
CELL_KEYS = ("model", "context_length", "split", "strategy", "config")

# Per-layer attention time relative to cuDNN dense, measured on the H200 (benchmarks/decode.md batch 64 and
# benchmarks/prefill.md, bf16, Top-k 10%, 128K; 32 query / 8 KV heads, d 128): anchor 0, other anchors, reuse.
DECODE_RATIOS = dict(a0=1.206, anchor=0.766, reuse=0.107)
PREFILL_RATIOS = dict(a0=1.899, anchor=1.700, reuse=0.194)


def load_examples(run_dirs) -> list[dict]:
    """Every example record of the runs (examples.jsonl, or .gz), with the run's model and split attached. A run with
    another sample seed than 0 (`--seed`) draws other prompts under the same indices: its split is labelled
    `<split>-seed<N>`, so it pairs with its own dense cell and never with seed 0's (a replicate)."""
    from kascade_jax.eval.report import examples_path, iter_examples, read_results_file  # noqa: PLC0415

    out = []
    for d in run_dirs:
        d = Path(d)
        res = read_results_file(d / "results.json")
        env = res.get("environment", {})
        split = "dev" if "--split=dev" in env.get("command", "") else "test"
        seed = (res.get("spec") or {}).get("seed")
        if seed is None:  # runs older than the saved spec: the command line says it, else the default 0
            m = re.search(r"--seed[= ](\d+)", env.get("command", ""))
            seed = int(m.group(1)) if m else 0
        if seed:
            split = f"{split}-seed{seed}"
        models = {r["strategy"] + "|" + r["config"]: r["model"] for r in res.get("rows", [])}
        ex = examples_path(d)
        if ex is None:
            raise ValueError(f"{d} holds no examples.jsonl (nor examples.jsonl.gz)")
        for _, r in iter_examples(ex):
            r.setdefault("model", models.get(r["strategy"] + "|" + r["config"], ""))
            r["split"] = split
            r["source"] = str(d)
            out.append(r)
    return out


def recipe_of(config: str) -> str:
    m = re.search(r"recipe=(\S+)", config or "")
    return m.group(1) if m else ""


def _cells(examples):
    """{cell: {task: {prompt index: score %}}}. A prompt of one cell found in two runs is an error, not an
    overwrite: a repeated run is a replicate, to be compared on its own."""
    cells: dict = {}
    seen: dict = {}
    for r in examples:
        key = tuple(r[k] for k in CELL_KEYS)
        where = (key, r["task"], int(r["index"]))
        src = r.get("source", "")
        if seen.setdefault(where, src) != src:
            raise ValueError(f"{r['strategy']} {r['config'] or ''} ({r['model']}, {r['context_length']}, "
                             f"{r['split']}) {r['task']} prompt {r['index']} is in two runs, {seen[where]} and {src}: "
                             "give each cell's run once (a repeat is a replicate; report it separately)")
        cells.setdefault(key, {}).setdefault(r["task"], {})[int(r["index"])] = 100.0 * float(r["score"])
    return cells


def pool_draws(examples, splits, into: str = "dev") -> tuple[list[dict], list[tuple]]:
    """The examples of several draws of one split (`dev`, `dev-seed1`, ...) as the one split `into`, so that a choice
    or a report sees all their prompts: each draw's prompt indices are offset (draw j: + j * 10**6) so that pairs stay
    within their draw. Only cells (model, context, strategy, config) run on every draw are pooled (a cell on fewer
    draws would be scored on other prompts than its peers); examples of other splits pass unchanged.
    Returns (examples, the dropped cells)."""
    splits = list(dict.fromkeys(splits))
    if len(splits) < 2:
        raise ValueError(f"pooling needs at least two draws, got {splits}")
    where: dict = {}
    for r in examples:
        if r["split"] in splits:
            where.setdefault((r["model"], int(r["context_length"]), r["strategy"], r["config"]), set()).add(r["split"])
    full = {c for c, s in where.items() if s == set(splits)}
    if not full:
        raise ValueError(f"no cell was run on every draw of {','.join(splits)}: nothing to pool")
    out = []
    for r in examples:
        if r["split"] not in splits:
            out.append(r)
        elif (r["model"], int(r["context_length"]), r["strategy"], r["config"]) in full:
            out.append(dict(r, split=into, index=int(r["index"]) + splits.index(r["split"]) * 10**6))
    return out, sorted(set(where) - full, key=str)


def _stratified(per_task: dict, rng, reps: int):
    """[reps] bootstrap means of the task-mean average, prompts resampled within each task."""
    tasks = sorted(per_task)
    draws = np.zeros((reps, len(tasks)))
    for j, t in enumerate(tasks):
        s = np.asarray(per_task[t])
        draws[:, j] = s[rng.integers(0, len(s), size=(reps, len(s)))].mean(axis=1)
    return draws.mean(axis=1)


def summarize(examples, *, ruler_tasks=None, reps: int = REPS, seed: int = 0) -> list[dict]:
    """summary.json rows: per task and `ruler_avg`, score with its interval and the paired difference to dense."""
    cells = _cells(examples)
    rows = []
    for key, tasks in sorted(cells.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        model, ctx, split, strategy, config = key
        dense = cells.get((model, ctx, split, "dense", ""))
        names = [t for t in sorted(tasks) if ruler_tasks is None or t in ruler_tasks]
        groups = [(t, [t]) for t in names]
        if ruler_tasks is not None and set(ruler_tasks) <= set(tasks):
            groups.append(("ruler_avg", list(ruler_tasks)))
        for label, members in groups:
            rng = np.random.default_rng(seed)
            per = {t: [tasks[t][i] for i in sorted(tasks[t])] for t in members}
            score = float(np.mean([np.mean(v) for v in per.values()]))
            boot = _stratified(per, rng, reps)
            row = dict(model=model, task=label, context=int(ctx), split=split, strategy=strategy,
                       recipe=recipe_of(config), config=config, topk_frac=_frac(config), anchors=_anchors(config),
                       score=round(score, 2), n=int(sum(len(v) for v in per.values())),
                       ci_low=round(float(np.percentile(boot, 2.5)), 2),
                       ci_high=round(float(np.percentile(boot, 97.5)), 2),
                       diff_vs_dense=None, diff_ci_low=None, diff_ci_high=None)
            if dense is not None and strategy != "dense" and all(t in dense for t in members):
                common = {t: sorted(set(tasks[t]) & set(dense[t])) for t in members}
                if all(common.values()):
                    diff = {t: [tasks[t][i] - dense[t][i] for i in common[t]] for t in members}
                    rng = np.random.default_rng(seed + 1)
                    dboot = _stratified(diff, rng, reps)
                    row.update(diff_vs_dense=round(float(np.mean([np.mean(v) for v in diff.values()])), 2),
                               diff_ci_low=round(float(np.percentile(dboot, 2.5)), 2),
                               diff_ci_high=round(float(np.percentile(dboot, 97.5)), 2))
            rows.append(row)
    return rows


def _find_cell(cells, spec: str, model: str, ctx: int, split: str):
    """The cell of `spec` ("STRATEGY", "STRATEGY:RECIPE" or "STRATEGY:RECIPE@ANCHORS") among `_cells` at (model,
    ctx, split): its {task: {index: score}}, or None when absent. Several matches are an error naming them."""
    strategy, _, rest = spec.partition(":")
    recipe, _, anchors = rest.partition("@")
    hits = [(k, v) for k, v in cells.items() if k[0] == model and int(k[1]) == ctx and k[2] == split
            and k[3] == strategy and (not recipe or recipe_of(k[4]) == recipe)
            and (not anchors or _anchors(k[4]) == anchors)]
    if len(hits) > 1:
        raise ValueError(f"{spec!r} matches {len(hits)} cells of {model} at {ctx} ({split}): "
                         + "; ".join(k[4] for k, _ in hits) + ": add @ANCHORS (e.g. kascade:dps@0,1,3,5,9)")
    return hits[0][1] if hits else None


def compare(examples, a: str, b: str, *, model: str, context: int, splits, ruler_tasks, reps: int = REPS,
            seed: int = 0) -> list[dict]:
    """Paired RULER-average difference a - b (cell specs as `_find_cell`) on the same prompts, per split and pooled
    over `splits` (prompts resampled within each (split, task): draws of other prompts add up, each paired with
    itself). Rows: split ("+"-joined for the pool), diff, ci_low, ci_high, n (paired prompts)."""
    cells = _cells(examples)
    per_split = {}
    for split in splits:
        ca, cb = (_find_cell(cells, x, model, context, split) for x in (a, b))
        missing = [x for x, c in ((a, ca), (b, cb)) if c is None or not set(ruler_tasks) <= set(c)]
        if missing:
            raise ValueError(f"no complete RULER cell {missing[0]!r} of {model} at {context} on split {split!r}")
        per_split[split] = {(split, t): [ca[t][i] - cb[t][i] for i in sorted(set(ca[t]) & set(cb[t]))]
                            for t in ruler_tasks}
    out = []
    groups = [[sp] for sp in splits] + ([list(splits)] if len(splits) > 1 else [])
    for group in groups:
        strata = {k: v for sp in group for k, v in per_split[sp].items()}
        if not all(strata.values()):
            raise ValueError(f"{a!r} and {b!r} share no prompt of some task on {'+'.join(group)}")
        boot = _stratified(strata, np.random.default_rng(seed + 1), reps)
        out.append(dict(split="+".join(group), a=a, b=b,
                        diff=round(float(np.mean([np.mean(v) for v in strata.values()])), 2),
                        ci_low=round(float(np.percentile(boot, 2.5)), 2),
                        ci_high=round(float(np.percentile(boot, 97.5)), 2),
                        n=int(sum(len(v) for v in strata.values()))))
    return out


def _frac(config: str):
    m = re.search(r"(?:k|budget)=([0-9.]+)", config or "")
    return float(m.group(1)) if m else None


def _anchors(config: str) -> str:
    m = re.search(r"anchors=(\S+)", config or "")
    return m.group(1) if m else ""


def config_fields(config: str) -> dict:
    """The recipe fields an eval row's config string states (`Recipe.describe()`: M=, pinned= anchors,
    calib=k<k>/<reduce>/w=<w>, then the levers that are on)."""
    from kascade_jax.recipes import BOOL_LEVERS, LEVERS  # noqa: PLC0415

    out = {}
    for tok in (config or "").split():
        key, eq, val = tok.partition("=")
        if key == "M" and val.isdigit():
            out["num_anchors"] = int(val)
        elif key == "calib" and (m := re.fullmatch(r"k(\d+)/(\w+)/w=(\w+)(?:/d=(\S+))?", val)):
            out.update(calib_k=int(m.group(1)), calib_reduce=m.group(2), calib_importance=m.group(3))
            if m.group(4):
                out["calib_dataset"] = m.group(4)
        elif key in BOOL_LEVERS and not eq:
            out[key] = True
        elif key == "pool" and eq:
            out[key] = val
        elif key == "pinned" and re.fullmatch(r"\d+(,\d+)*", val):
            out["anchors"] = tuple(int(x) for x in val.split(","))
        elif key == "decode_dense_layers" and re.fullmatch(r"-?\d+(,-?\d+)*", val):
            out[key] = tuple(int(x) for x in val.split(","))
        elif (key in LEVERS or key == "decode_rerank_worst") and eq:
            out[key] = float(val) if "." in val else int(val)
    return out


_PREFILL_ONLY = ("dense_suffix", "local_window", "prefill_topk_frac", "tile_size", "prefill_dense_anchors",
                 "prefill_key_block", "prefill_score_fp8")


def _decode_side(fields: dict) -> dict:
    """What a dense-prefill (decode_only) run depends on: the fields minus the prefill-only levers."""
    from kascade_jax.recipes import Recipe  # noqa: PLC0415

    full = dataclasses.asdict(Recipe(**{k: v for k, v in fields.items() if k in Recipe.__dataclass_fields__}))
    return {k: v for k, v in full.items()
            if k not in _PREFILL_ONLY + ("decode_only", "name", "note", "calib_dtype", "calib_num_prompts",
                                         "calib_max_tokens")}


def _decode_only_cell(summary_rows, fields: dict, *, model: str, context: int):
    """The dev ruler_avg row of a `--strategies=decode_only` run whose recipe equals the dense-prefill candidate
    `fields` on every field a dense prefill leaves in play (Top-k 10%), or None."""
    want = _decode_side(fields)
    for r in summary_rows:
        if (r["task"] == "ruler_avg" and r["split"] == "dev" and r["model"] == model and r["context"] == context
                and r["strategy"] == "decode_only" and _frac(r["config"]) == 0.1
                and _decode_side(config_fields(r["config"])) == want):
            return r
    return None


# ---- speed model and the recipe choice ---------------------------------------------------------------------------


def bench_paths(path) -> list[Path]:
    """A benchmark file, or several joined by '+' (e.g. the rerank's and the pools' decode runs of one shape)."""
    return [Path(p) for p in str(path).split("+")]


def bench_ratios(decode_json, prefill_json, *, context: int, decode_batch: int = 32) -> dict:
    """Per-layer times relative to cuDNN dense measured by `experiments.bench` (its decode/prefill json: rows with
    dense, A0, A, R milliseconds) at one context and decode batch: {"decode" | "prefill": {topk_frac: {a0, anchor,
    reuse}}}, the `ratios` argument of `attention_cost`. A missing shape is an error naming what the files have.
    A '+'-joined decode path: the plain layers come from the first file, the levers' rows (rerank, pools) from all."""
    out = {}
    for phase, path, want in (("decode", decode_json, dict(context=context, batch=decode_batch)),
                              ("prefill", prefill_json, dict(context=context))):
        docs = [json.loads(Path(p).read_text())["rows"] for p in bench_paths(path)]
        rows = docs[0]  # the plain layers from the first file; the levers' rows from every file
        at = [[r for r in d if all(r.get(k) == v for k, v in want.items()) and r.get("dense")] for d in docs]
        got = {float(r["topk_frac"]): dict(a0=r["A0"] / r["dense"], anchor=r["A"] / r["dense"],
                                           reuse=r["R"] / r["dense"]) for r in at[0] if r.get("R")}
        if 0.1 not in got:
            have = sorted({(r.get("context"), r.get("batch")) for r in rows})
            raise ValueError(f"{path}: no {phase} row at {want} with Top-k 0.1 (have context, batch: {have})")
        out[phase] = got
        if phase == "decode":  # the decode_rerank lever through the strategy's path (bench --decode_reranks)
            ten = [r for d in at for r in d if float(r.get("topk_frac", 0)) == 0.1]
            for name, pattern, pieces in (("decode_rerank", r"R_(rr(\d+))", ("A0", "A")),
                                          ("decode_rerank_worst", r"R_(rr(\d+)w(\d+))", ("A0", "A", "F"))):
                found = {tuple(int(x) for x in m.groups()[1:]): dict(
                    zip(("a0", "anchor", "first"), (r[f"{p}_{m.group(1)}"] / r["dense"] for p in pieces)),
                    reuse=r[k] / r["dense"]) for r in ten for k in r if (m := re.fullmatch(pattern, k))}
                if found:  # keyed by C, or by (C, N) for the worst-layers mix
                    out[name] = {(key[0] if len(key) == 1 else key): v for key, v in found.items()}
            pools = {m.group(1): dict(a0=r[f"A0_pool{m.group(1)}"] / r["dense"], anchor=r[k] / r["dense"],
                                      reuse=r[f"R_pool{m.group(1)}"] / r["dense"])
                     for r in ten for k in r
                     if not k.endswith("_kernels") and (m := re.fullmatch(r"A_pool(\w+)", k))}
            if pools:  # the selection pools through the strategy's path (bench --decode_pools), keyed by pool
                out["pool"] = pools
            fp8 = {float(r["topk_frac"]): r["A_fp8"] / r["A"] for d in at for r in d if r.get("A_fp8")}
            if fp8:  # the anchor on the fp8 K copy over the plain anchor, same run (bench --decode_score_fp8)
                out["decode_score_fp8"] = fp8
    return out


def _pool_anchor(ratios: dict, pool: str, r: dict) -> float:
    """The decode anchor's ratio under `pool` (its measured ratio to the gqa anchor applied to r's)."""
    p, g = ratios["pool"][pool], ratios["pool"]["gqa"]
    return r["anchor"] * p["anchor"] / g["anchor"]


def attention_cost(num_layers: int, num_anchors: int, *, context: int, dense_suffix: int = 0, oracle: bool = False,
                   dense_prefill: bool = False, topk_frac: float = 0.1, prefill_topk_frac: float | None = None,
                   decode_topk_frac: float | None = None, local_window: int = 0, prefill_dense_anchors: bool = False,
                   decode_rerank: int = 1, decode_rerank_worst: int | None = None, pool: str = "gqa",
                   decode_tail_stride: int = 0, decode_dense_layers: tuple[int, ...] | None = None,
                   anchors: tuple[int, ...] | None = None, ratios: dict | None = None,
                   decode_prefill_keys: float = 0.0, decode_score_fp8: bool = False) -> dict:
    """Estimated attention time per forward relative to dense cuDNN (decode and prefill) and the weighted speedups.

    (1 * a0 + (M - 1) * anchor + (L - M) * reuse) / L with the measured per-layer ratios above. The dense suffix
    adds, to every layer but 0, the dense-attention share of its rows: 2 * n / context of a causal dense layer (an
    upper bound for the suffix's own flash pass). Forced keys (sinks, recent window) cost nothing: they are part
    of the same budget and kernels. A reuse layer's time scales with the keys it gathers: decode topk_frac / 0.1 of
    the measured ratio (decode_topk_frac, else topk_frac); prefill (prefill_topk_frac + 2 * local_window / context)
    / 0.1 (a rolling tile attends f * position + W keys, on average f * L / 2 + W against the dense L / 2).
    `ratios` (`bench_ratios`): per-layer ratios measured at the model's own shape instead of the constants above;
    a budget measured there is used as it is, others are scaled from the 10% row as described.
    `prefill_dense_anchors`: every prefill anchor costs what anchor 0 costs (dense output + scores + select,
    measured with a prompt in one chunk: cuDNN's output and LSE); `dense_prefill` (decode_only): prefill cost 1.
    `decode_rerank` C: with `ratios` holding the lever's measured layers (`bench_ratios`' decode_rerank: the anchors
    selecting C k, a reranking reuse layer's gather, scores, top-k and attention), those; with `decode_rerank_worst`
    N only N reuse layers pay the reranking cost and the others a plain one (the anchors' ordering of their
    candidates left out: a lower bound), unless the benchmark timed that mix (`--decode_rerank_worst`: its A, R and F
    layers, bench_ratios' decode_rerank_worst), which is then used as measured. Without measured ratios, an estimate
    from bytes, (C + 1) / 2 of a plain reuse layer: as built it is 7-13x (session 11's benchmark), so treat it as the
    floor of a fused kernel, not as today's speed.
    `pool` other than "gqa" (all_heads_pooled's one shared set): each decode piece scaled by its measured ratio
    to the gqa selection through the same strategy path (`bench_ratios`' pool, bench --decode_pools=gqa,<pool>);
    without that measurement the decode speed is unknown (None), never assumed equal. The prefill keeps the
    plain ratios (a dense-prefill recipe does not use them).
    `decode_tail_stride` S: every sparse decode layer (all but layer 0) also reads 1/S of the keys, priced at the
    reuse layer's cost per key: the floor of a fused kernel (as built, plain JAX around the reuse kernel and one more
    reuse pass per anchor, it costs more: measure it before it ships).
    `decode_dense_layers` (negatives from the end): in decode a listed reuse layer costs a dense layer (1.0) and a
    listed anchor what a dense-output anchor costs (layer 0's a0: scores, select and a dense P.V); neither reranks or
    takes the tail. Which listed layers are anchors: `anchors` (the layers, when known), every one with `oracle`;
    without `anchors` each is priced as a reuse layer, the dearer case with the measured ratios.
    `decode_prefill_keys` s: a sparse reuse layer reads its anchor's k and its own s of the keys in decode, priced as
    its reuse cost times (df + s) / df (the union's per-step index merge left out: a floor).
    Layer 0 is priced as a0 even where no layer reads its indices (`KascadeStrategy.dense_unread`: the strategy then
    runs it as plain dense attention, 1.0): an upper bound, kept until the recipes' prices are re-chosen with it.
    `decode_score_fp8`: every sparse decode anchor past layer 0 costs its plain ratio times the measured A_fp8 / A
    (`bench_ratios`' decode_score_fp8, at the decode budget if timed, else at 10%; measured with the gqa pool and
    applied to any pool); without that measurement the decode speed is unknown (None).
    """
    m = num_layers if oracle else num_anchors
    pf = topk_frac if prefill_topk_frac is None else prefill_topk_frac
    df = topk_frac if decode_topk_frac is None else decode_topk_frac
    frac = dict(decode=df, prefill=pf)
    scale = dict(decode=df / 0.1, prefill=(pf + 2.0 * local_window / context) / 0.1)
    listed = {x + num_layers if x < 0 else x for x in decode_dense_layers or ()}
    if not all(0 < x < num_layers for x in listed):
        raise ValueError(f"decode_dense_layers {list(decode_dense_layers)} do not fit {num_layers} layers (layer 0 "
                         "is not one)")
    n_reuse = num_layers - m
    known = set(range(num_layers)) if oracle else {int(a) for a in anchors or ()}
    n_dr = min(n_reuse, len(listed - known))  # dense reuse layers (every listed one where the anchors are unknown)
    n_da = len(listed) - n_dr  # dense-output anchors
    n_rr = n_reuse - n_dr if decode_rerank_worst is None else min(decode_rerank_worst, n_reuse - n_dr)
    rr = 1.0 + ((decode_rerank + 1) / 2.0 - 1.0) * (n_rr / (n_reuse - n_dr) if n_reuse > n_dr else 0.0)
    rerank = dict(decode=rr, prefill=1.0)
    out = {}
    for phase, r in (("decode", DECODE_RATIOS), ("prefill", PREFILL_RATIOS)):
        if ratios is not None:
            measured = ratios[phase]
            exact = frac[phase] in measured and not (phase == "prefill" and local_window)
            r = measured[frac[phase]] if exact else measured[0.1]
            if exact:
                scale[phase] = 1.0
        measured_rr = (phase == "decode" and decode_rerank > 1 and ratios is not None
                       and decode_rerank in ratios.get("decode_rerank", {}))
        reuse = r["reuse"] * scale[phase] * (1.0 if measured_rr else rerank[phase])
        if phase == "decode" and decode_prefill_keys:
            reuse *= (df + decode_prefill_keys) / df
        dense_anchors = phase == "prefill" and prefill_dense_anchors
        anchor = r["a0"] if dense_anchors else r["anchor"]
        # decode: the dense layers' places (n_da anchors priced as a0, n_dr reuse layers as dense 1.0)
        da, dr = (n_da, n_dr) if phase == "decode" else (0, 0)
        sa, sr = m - 1 - da, num_layers - m - dr  # the sparse anchors past layer 0, the sparse reuse layers
        cost = (r["a0"] * (1 + da) + sa * anchor + sr * reuse + dr) / num_layers
        if measured_rr:
            q = ratios["decode_rerank"][decode_rerank]
            cost = (q["a0"] * (1 + da) + sa * q["anchor"] + n_rr * q["reuse"] * scale[phase]
                    + (sr - n_rr) * reuse + dr) / num_layers
            w = (ratios.get("decode_rerank_worst") or {}).get((decode_rerank, decode_rerank_worst))
            if decode_rerank_worst is not None and w is not None:  # timed as such: the anchors' ordering included
                cost = (w["a0"] * (1 + da) + sa * w["anchor"] + n_rr * w["reuse"] * scale[phase]
                        + (sr - n_rr) * w["first"] * scale[phase] + dr) / num_layers
        if phase == "decode" and pool != "gqa" and ratios is not None:  # (without ratios all is an estimate)
            pools = ratios.get("pool", {})
            if pool not in pools or "gqa" not in pools:
                out.update(decode_cost=None, decode_speedup=None)
                continue
            p, g = pools[pool], pools["gqa"]
            cost = (r["a0"] * p["a0"] / g["a0"] * (1 + da) + sa * _pool_anchor(ratios, pool, r)
                    + sr * reuse * p["reuse"] / g["reuse"] + dr) / num_layers
        if phase == "decode" and decode_score_fp8:
            f8 = (ratios or {}).get("decode_score_fp8", {})
            f8 = f8.get(df, f8.get(0.1))
            if f8 is None:
                out.update(decode_cost=None, decode_speedup=None)
                continue
            pooled = _pool_anchor(ratios, pool, r) if pool != "gqa" and ratios is not None else anchor
            cost -= sa * pooled * (1.0 - f8) / num_layers
        if phase == "decode" and decode_tail_stride:
            cost += (num_layers - 1 - da - dr) / num_layers * reuse / df / decode_tail_stride
        if phase == "prefill":
            if dense_prefill:
                cost = 1.0
            elif dense_suffix:  # every layer whose prefill output is not dense already
                sparse_layers = num_layers - (m if dense_anchors else 1)
                cost += sparse_layers / num_layers * min(1.0, 2.0 * dense_suffix / context)
        out[f"{phase}_cost"] = round(cost, 4)
        out[f"{phase}_speedup"] = round(1.0 / cost, 3)
    return out


def recipe_cost(fields: dict, *, num_layers: int, context: int, ratios: dict | None = None, oracle: bool = False,
                topk_frac: float = 0.1) -> dict:
    """attention_cost of one candidate recipe's fields (`oracle`: every layer selects; `topk_frac`: the cell's)."""
    return attention_cost(num_layers, fields["num_anchors"], context=context, oracle=oracle, topk_frac=topk_frac,
                          dense_suffix=fields.get("dense_suffix", 0), prefill_topk_frac=fields.get("prefill_topk_frac"),
                          decode_topk_frac=fields.get("decode_topk_frac"), local_window=fields.get("local_window", 0),
                          dense_prefill=bool(fields.get("decode_only")),
                          prefill_dense_anchors=bool(fields.get("prefill_dense_anchors")),
                          decode_rerank=fields.get("decode_rerank") or 1,
                          decode_rerank_worst=fields.get("decode_rerank_worst"), pool=fields.get("pool") or "gqa",
                          decode_tail_stride=fields.get("decode_tail_stride") or 0,
                          decode_dense_layers=fields.get("decode_dense_layers"), anchors=fields.get("anchors"),
                          ratios=ratios, decode_prefill_keys=fields.get("decode_prefill_keys") or 0.0,
                          decode_score_fp8=bool(fields.get("decode_score_fp8")))


def _cell_anchors(fields: dict, row: dict) -> dict:
    """A recipe's fields with the anchor layers its cell ran with (the row's `anchors`), which `recipe_cost` needs
    to price `decode_dense_layers`; the fields unchanged where the row names none."""
    have = [int(a) for a in str(row.get("anchors") or "").split(",") if a.strip().isdigit()]
    return dict(fields, anchors=tuple(have)) if have else fields


def _recipe_cells(rows) -> dict:
    """{recipe: its dev cell}. A recipe also run with explicit anchors (an anchor experiment) has several cells; its
    own is the one with the anchor set most cells of the same M share (the DP's choice, which every auto run gets)."""
    def shape(r):
        return config_fields(r["config"]).get("num_anchors"), r.get("anchors", "")

    count = Counter(shape(r) for r in rows)
    out = {}
    for r in rows:
        if r["recipe"] not in out or count[shape(r)] > count[shape(out[r["recipe"]])]:
            out[r["recipe"]] = r
    return out


def _dev_cells(summary_rows, candidates: dict, *, model: str, context: int) -> dict:
    """{candidate: its dev ruler_avg cell at `context`} (`_recipe_cells`; a dense-prefill candidate also as the
    decode_only strategy's cell, with `measured_as`)."""
    dev = _recipe_cells([r for r in summary_rows if r["task"] == "ruler_avg" and r["split"] == "dev"
                         and r["model"] == model and r["context"] == context and r["strategy"] == "kascade"
                         and r["recipe"]])
    for name, fields in candidates.items():  # a dense-prefill candidate: also measured as the decode_only strategy
        if name not in dev and fields.get("decode_only"):
            cell = _decode_only_cell(summary_rows, fields, model=model, context=context)
            if cell is not None:
                dev[name] = dict(cell, measured_as=f"strategy decode_only, {cell['config']}")
    return dev


def _worst_diff(row) -> float:
    """A choice-table row's lowest dev difference to dense over its dev lengths (-inf where a length is missing)."""
    diffs = [row["dev_diff_vs_dense"], *row.get("also_dev_diff_vs_dense", {}).values()]
    return min(diffs) if all(d is not None and finite(d) for d in diffs) else -math.inf


def _faster_than_dense(row) -> bool:
    """Whether a choice-table row's estimated decode or prefill beats dense (a sparse recipe that beats neither has
    nothing to offer; an unpriced one is not known to)."""
    return any((row.get(f"{p}_speedup") or 0) > 1 for p in ("decode", "prefill"))


def choose_recipe(summary_rows, candidates: dict, *, model: str, context: int, num_layers: int,
                  max_slowdown: float = 0.15, baseline: str = "paper", within_dense: float | None = None,
                  ratios: dict | None = None, speed_tie: float = 0.0, also_contexts=()) -> dict:
    """The default recipe from dev-split results.

    candidates: {name: recipe fields (kascade_jax.recipes.Recipe)}; each name must be the `recipe=` of one dev cell
    (`ruler_avg`; of several, the one with the DP's anchors: `_recipe_cells`), or, for a dense-prefill candidate
    (`decode_only`), a `decode_only` strategy cell whose recipe matches it on every field a dense prefill leaves in
    play (`measured_as` says which).
    With `within_dense` (issue 21's rule): the FASTEST candidate (lowest estimated decode + prefill cost; faster
    than dense in decode or prefill) whose dev score is at most `within_dense` points below dense on the same
    prompts wins; when none is, among candidates faster than dense, the smallest loss at its worst dev length (one
    length: the best dev score), and the note says the target was missed. `speed_tie`: qualifying candidates whose
    estimated cost is within this fraction of the cheapest one count as equally fast (two benchmark runs of the
    same kernels differ by a few per cent), and the best dev score among them wins. `also_contexts`: other dev
    lengths where a candidate must also be within `within_dense` of dense (a candidate without a dev cell there does
    not qualify); speed and the dev score that breaks ties stay those at `context`.
    Without it (issue 17's rule): a candidate qualifies when both its decode and prefill weighted speedups are at
    least (1 - max_slowdown) x the baseline's, and the best qualifying dev score wins if it beats the baseline, else
    the baseline. Returns {"default": fields, "measured": the table it was chosen from}.
    """
    dev = _dev_cells(summary_rows, candidates, model=model, context=context)
    also_contexts = sorted({int(c) for c in also_contexts} - {int(context)})
    if also_contexts and within_dense is None:
        raise ValueError("also_contexts needs within_dense (the rule 'within N points of dense at every dev length')")
    also = {c: _dev_cells(summary_rows, candidates, model=model, context=c) for c in also_contexts}
    if within_dense is None and baseline not in dev:  # issue 17's rule compares with the baseline
        raise ValueError(f"no dev ruler_avg for the {baseline!r} recipe of {model} at {context}; have {sorted(dev)}")
    if not any(name in dev for name in candidates):
        raise ValueError(f"no dev ruler_avg for any candidate recipe of {model} at {context}; have {sorted(dev)}")
    table = []
    base_speed = recipe_cost(candidates[baseline], num_layers=num_layers, context=context, ratios=ratios)
    for name, fields in candidates.items():
        if name not in dev:
            continue
        speed = recipe_cost(_cell_anchors(fields, dev[name]), num_layers=num_layers, context=context, ratios=ratios)
        timed = all(speed[f"{p}_cost"] is not None for p in ("decode", "prefill"))  # else its price is unknown
        extra = {}
        if within_dense is not None:
            diffs = [dev[name]["diff_vs_dense"]] + [also[c][name]["diff_vs_dense"] if name in also[c] else None
                                                   for c in also_contexts]
            ok = timed and _faster_than_dense(speed) and all(d is not None and finite(d) and d >= -within_dense
                                                              for d in diffs)
            if also_contexts:
                extra["also_dev_diff_vs_dense"] = {str(c): d for c, d in zip(also_contexts, diffs[1:])}
        else:
            ok = timed and all(speed[f"{p}_speedup"] >= (1 - max_slowdown) * base_speed[f"{p}_speedup"]
                               for p in ("decode", "prefill"))
        table.append(dict(recipe=name, dev_score=dev[name]["score"], dev_n=dev[name]["n"],
                          dev_ci=[dev[name]["ci_low"], dev[name]["ci_high"]],
                          dev_diff_vs_dense=dev[name]["diff_vs_dense"],
                          dev_diff_ci=[dev[name]["diff_ci_low"], dev[name]["diff_ci_high"]], qualifies=ok, **extra,
                          **speed,
                          **({"measured_as": dev[name]["measured_as"]} if "measured_as" in dev[name] else {})))
    if within_dense is not None:
        if not math.isfinite(speed_tie) or speed_tie < 0:
            raise ValueError(f"speed_tie must be a finite fraction >= 0, got {speed_tie}")
        cost = {r["recipe"]: r["prefill_cost"] + r["decode_cost"] for r in table if r["qualifies"]}
        tied = min(cost.values(), default=0.0) * (1 + speed_tie)
        if cost:  # the cheapest qualifying candidate (ties: the best dev score), then the rest by dev score
            table.sort(key=lambda r: (not r["qualifies"], 0 if cost.get(r["recipe"], 0) <= tied else
                                      cost[r["recipe"]], -r["dev_score"], cost.get(r["recipe"], 0)))
        else:  # the target missed: the smallest loss at its worst dev length, among candidates faster than dense
            table.sort(key=lambda r: (not _faster_than_dense(r), -_worst_diff(r), -r["dev_score"]))
        pick = table[0]
        fields = dict(candidates[pick["recipe"]])
        d = dev[pick["recipe"]]
        tie = f" (costs within {speed_tie:.0%} of the cheapest count as equal: the best dev score)" if speed_tie else ""
        at = f" here and at {', '.join(map(str, also_contexts))} tokens" if also_contexts else ""
        best = "the smallest loss at its worst dev length" if also_contexts else "the best dev score"
        best += " among those faster than dense" if _faster_than_dense(pick) else " (none is faster than dense)"
        how = (f"the fastest candidate within {within_dense:g} point(s) of dense{at}{tie}" if pick["qualifies"] else
               f"no candidate within {within_dense:g} point(s) of dense{at}: {best}")
        src = "measured per-layer kernels at this shape" if ratios is not None else "estimated"
        fields["note"] = (f"chosen on the dev split of real RULER at {context} tokens ({d['n']} prompts): {how}; dev "
                          f"ruler_avg {d['score']:.1f}, {d['diff_vs_dense']:+.1f} vs dense; weighted attention "
                          f"speedup ({src}) decode {pick['decode_speedup']:.2f}x, prefill {pick['prefill_speedup']:.2f}x")
        fields["name"] = "default"
        return {"default": fields, "chosen_from": pick["recipe"], "measured": table, "model": model,
                "context": context, "speed": src, "rule": f"fastest within {within_dense:g} of dense"
                + (f" (also at {','.join(map(str, also_contexts))})" if also_contexts else "")
                + (f", speed ties {speed_tie:g}" if speed_tie else "")}
    table.sort(key=lambda r: (-r["dev_score"], (r["prefill_cost"] or math.inf) + (r["decode_cost"] or math.inf)))
    best = next((r for r in table if r["qualifies"]), None)
    base_score = dev[baseline]["score"]
    name = best["recipe"] if best is not None and best["dev_score"] > base_score else baseline
    fields = dict(candidates[name])
    fields["note"] = (f"chosen on the dev split of real RULER at {context} tokens ({dev[name]['n']} prompts): dev "
                      f"ruler_avg {dev[name]['score']:.1f} vs paper {base_score:.1f}; weighted attention speed within "
                      f"{max_slowdown:.0%} of the paper recipe")
    fields["name"] = "default"
    return {"default": fields, "chosen_from": name, "measured": table, "model": model, "context": context}


# ---- the report: measured speed per cell, and the headline ------------------------------------------------------
BASELINE_STRATEGIES = ("quest", "omnikv", "less_is_more", "streaming_llm")  # accuracy simulations: no kernels timed


def _bench_contexts(decode_json, prefill_json) -> tuple[int, list[int]]:
    """(num_layers, contexts with a Top-k 10% row in both benchmark files)."""
    docs = [json.loads(p.read_text())["rows"] for p in (Path(prefill_json), *bench_paths(decode_json))]
    rows = {"prefill": docs[0], "decode": docs[1]}  # the contexts: the first decode file's (its plain layers)
    layers = {int(r["num_layers"]) for d in docs for r in d if "num_layers" in r}
    if len(layers) != 1:
        raise ValueError(f"{decode_json} / {prefill_json}: benchmark rows of {sorted(layers) or 'no'} layer counts; "
                         "give one model shape's files")
    ctx = [set(int(r["context"]) for r in rows[ph] if float(r.get("topk_frac", 0)) == 0.1) for ph in rows]
    return layers.pop(), sorted(ctx[0] & ctx[1])


def add_speed(rows, bench: dict, *, decode_batch: int = 32) -> list[dict]:
    """Each summary row of a model in `bench` ({model: (decode json, prefill json)}, `experiments.bench` at its
    shape) at a benchmarked length gets `decode_speedup` / `prefill_speedup`: the weighted attention speedup over
    cuDNN of its cell's layer mix (`attention_cost` with the measured per-layer ratios; dense 1.0). Baselines
    (quest, omnikv, ...) are accuracy simulations without kernels and get None, as do unbenchmarked lengths."""
    from kascade_jax.registry import KASCADE_FAMILY, VARIANT_POOL  # noqa: PLC0415

    cache = {}
    for model, (dec, pre) in bench.items():
        layers, contexts = _bench_contexts(dec, pre)
        for c in contexts:
            cache[(model, c)] = (layers, bench_ratios(dec, pre, context=c, decode_batch=decode_batch))
    out = []
    for r in rows:
        r = dict(r, decode_speedup=None, prefill_speedup=None)
        hit = cache.get((r["model"], int(r["context"])))
        if hit is not None and r["strategy"] == "dense":
            r.update(decode_speedup=1.0, prefill_speedup=1.0)
        elif hit is not None and r["strategy"] in KASCADE_FAMILY:
            layers, ratios = hit
            f = config_fields(r["config"])
            oracle = r["strategy"] == "oracle_topk"
            # the anchors the cell ran with (an explicit --anchors list overrides the recipe's M), else M
            m = len([a for a in (r.get("anchors") or "").split(",") if a]) or f.get("num_anchors")
            f["pool"] = VARIANT_POOL.get(r["strategy"], f.get("pool"))
            if m or oracle:
                f.update(num_anchors=m or 1, decode_only=bool(f.get("decode_only")) or r["strategy"] == "decode_only")
                cost = recipe_cost(_cell_anchors(f, r), num_layers=layers, context=int(r["context"]), ratios=ratios,
                                   oracle=oracle, topk_frac=r.get("topk_frac") or 0.1)
                r.update(decode_speedup=cost["decode_speedup"], prefill_speedup=cost["prefill_speedup"])
        out.append(r)
    return out


def _paired(r) -> str:
    """A row's paired difference to dense with its interval, e.g. "-2.8 [-5.3, -0.3]"."""
    return f"{r['diff_vs_dense']:+.1f} [{r['diff_ci_low']:+.1f}, {r['diff_ci_high']:+.1f}]"


def _diff(r) -> str:
    if r is None:
        return "not run"
    if r.get("diff_vs_dense") is None:
        return f"{r['score']:.1f} (no dense pair)"
    return _paired(r)


def _speed(r) -> str:
    if r is None or r.get("decode_speedup") is None:
        return "-"
    return f"{r['decode_speedup']:.2f}x / {r['prefill_speedup']:.2f}x"


def headline_rows(rows, defaults: dict, *, split: str = "test", chosen: dict | None = None) -> list[dict]:
    """Per (model, context) with a dense `ruler_avg` cell on `split`: dense, the default (the cell whose config
    states `defaults[model]`, today's shipped recipe's describe(); else the latest recipe=default cell), the paper
    recipe and the best baseline (BASELINE_STRATEGIES), each with its paired difference to dense. `chosen`
    ({model: the candidate the shipped default was chosen from}): that candidate's cell, run under its own name
    with the same levers, is the default's too (a recipe=default cell first; an anchor experiment never)."""
    avg = [r for r in rows if r["task"] == "ruler_avg" and r["split"] == split]
    out = []
    for model, ctx in sorted({(r["model"], r["context"]) for r in avg if r["strategy"] == "dense"}):
        here = [r for r in avg if r["model"] == model and r["context"] == ctx]
        dense = next(r for r in here if r["strategy"] == "dense")
        want = defaults.get(model)
        cands = [r for r in here if r["strategy"] == "kascade" and r["recipe"] == "default"]
        fields = config_fields(want) if want else None  # the same levers, none more or fewer
        shipped = [r for r in cands if fields and config_fields(r["config"]) == fields]
        name = (chosen or {}).get(model)
        if not shipped and name and fields:
            own = _recipe_cells([r for r in here if r["strategy"] == "kascade" and r["recipe"]]).get(name)
            shipped = [own] if own is not None and config_fields(own["config"]) == fields else []
        default = (shipped or [None])[0]
        paper = next((r for r in here if r["strategy"] == "kascade" and r["recipe"] == "paper"), None)
        base = [r for r in here if r["strategy"] in BASELINE_STRATEGIES]
        best = max(base, key=lambda r: r["score"]) if base else None
        out.append(dict(model=model, context=ctx, split=split, n=dense["n"], dense=dense["score"], default=default,
                        default_is_shipped=default is not None, older_default=None if shipped else
                        (cands[-1] if cands else None), paper=paper, best_baseline=best))
    return out


def test_draws(examples) -> list[str]:
    """The test split's draws present in `examples`: "test" first, then "test-seed<N>" by N."""
    found = {r["split"] for r in examples if re.fullmatch(r"test(-seed\d+)?", r["split"])}
    return sorted(found, key=lambda s: -1 if s == "test" else int(s.rsplit("seed", 1)[1]))


def pooled_headline(examples, defaults: dict, *, ruler_tasks, chosen: dict | None = None, bench=None,
                    reps: int = REPS) -> tuple[str, list[dict]]:
    """The headline over every test draw at once: (the pooled split's name, e.g. "test+test-seed1", headline rows)
    from the cells run on every draw (`pool_draws`: each prompt paired within its own draw); ("", []) with fewer
    than two draws or no cell on all of them."""
    draws = test_draws(examples)
    if len(draws) < 2:
        return "", []
    into = "+".join(draws)
    try:
        pooled, _ = pool_draws(examples, draws, into=into)
    except ValueError:  # no cell on every draw
        return "", []
    rows = summarize([r for r in pooled if r["split"] == into], ruler_tasks=ruler_tasks, reps=reps)
    if bench:
        rows = add_speed(rows, bench)
    return into, headline_rows(rows, defaults, split=into, chosen=chosen)


def headline_markdown(hrows) -> str:
    lines = ["| model | ctx | prompts | dense | default vs dense [95% CI] | default decode / prefill speedup | "
             "paper vs dense | best baseline vs dense |", "|---|---|---|---|---|---|---|---|"]
    for h in hrows:
        d = h["default"]
        dtext = _diff(d) if d is not None else ("not run (an older default: " + _diff(h["older_default"]) + ")"
                                               if h["older_default"] is not None else "not run")
        b = h["best_baseline"]
        btext = "not run" if b is None else f"{b['strategy']} {_diff(b)}"
        lines.append(f"| {h['model']} | {h['context']} | {h['n']} | {h['dense']:.1f} | {dtext} | {_speed(d)} | "
                     f"{_diff(h['paper'])} | {btext} |")
    return "\n".join(lines)


def markdown_table(rows, *, task: str = "ruler_avg") -> str:
    lines = ["| model | ctx | split | strategy | recipe / config | score [95% CI] | n | vs dense [95% CI] | "
             "decode / prefill speedup |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["task"] != task:
            continue
        diff = "-" if r["diff_vs_dense"] is None else _paired(r)
        cfg = r["config"] if len(r["config"]) < 90 else r["config"][:87] + "..."
        lines.append(f"| {r['model']} | {r['context']} | {r['split']} | {r['strategy']} | {cfg} | "
                     f"{r['score']:.1f} [{r['ci_low']:.1f}, {r['ci_high']:.1f}] | {r['n']} | {diff} | {_speed(r)} |")
    return "\n".join(lines)


def finite(x) -> bool:
    return x is not None and not (isinstance(x, float) and math.isnan(x))


def plot_frontier(doc: dict, path, *, speed: str | None = None) -> str:
    """The accuracy-speed frontier of a `choose_recipe` result: dev ruler_avg minus dense (paired 95% interval)
    against the weighted decode and prefill attention speedups, one point per candidate, the chosen one ringed."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    speed = speed or doc.get("speed", "estimated")
    table = [r for r in doc["measured"] if r.get("dev_diff_vs_dense") is not None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, phase in zip(axes, ("decode", "prefill")):
        for i, r in enumerate(table):
            x, y = r[f"{phase}_speedup"], r["dev_diff_vs_dense"]
            if x is None:  # an unmeasured price (a shared selection without its benchmark): no point
                continue
            ci = r.get("dev_diff_ci")
            yerr = None if not ci else [[y - ci[0]], [ci[1] - y]]
            ax.errorbar(x, y, yerr=yerr, fmt="o", capsize=3, color=f"C{i % 10}", alpha=0.8)
            ax.annotate(r["recipe"], (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
            if r["recipe"] == doc.get("chosen_from"):
                ax.plot(x, y, "o", ms=14, mfc="none", mec="k")
        ax.axhline(0, color="k", lw=0.8)
        ax.axhline(-1, color="r", lw=0.8, ls="--")
        ax.set_xlabel(f"{phase}: weighted attention speedup over cuDNN", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("dev ruler_avg - dense (points)")
    fig.suptitle(f"{doc.get('model', '')} at {doc.get('context', '')} tokens: every candidate on the dev split "
                 f"(ringed: chosen; red: 1 point below dense); speed {speed}", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def plot_summary(rows, out_dir) -> list[str]:
    """Per (model, context, split): task scores per cell (bars) and the ruler_avg difference to dense with its paired
    95% interval (a forest plot). Returns the PNG paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["model"], r["context"], r["split"]), []).append(r)
    for (model, ctx, split), rs in sorted(groups.items(), key=lambda kv: tuple(str(x) for x in kv[0])):
        label = lambda r: r["strategy"] if not r["recipe"] else f"{r['strategy']} ({r['recipe']})"  # noqa: E731
        cells = list(dict.fromkeys(label(r) for r in rs))
        tasks = [t for t in dict.fromkeys(r["task"] for r in rs) if t != "ruler_avg"] + ["ruler_avg"]
        by = {(label(r), r["task"]): r for r in rs}
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(16, 5), gridspec_kw=dict(width_ratios=[3, 1]))
        w = 0.8 / max(1, len(cells))
        for j, c in enumerate(cells):
            xs = [i + j * w for i, t in enumerate(tasks) if (c, t) in by]
            ys = [by[(c, t)]["score"] for t in tasks if (c, t) in by]
            ax.bar(xs, ys, width=w, label=c)
        ax.set_xticks([i + 0.4 - w / 2 for i in range(len(tasks))], tasks, rotation=45, ha="right")
        ax.set_ylabel("score (%)")
        ax.set_title(f"{model}, {ctx} tokens, {split} split: real RULER per task")
        ax.legend(fontsize=8)
        diffs = [(c, by[(c, "ruler_avg")]) for c in cells if (c, "ruler_avg") in by
                 and by[(c, "ruler_avg")]["diff_vs_dense"] is not None]
        for i, (c, r) in enumerate(diffs):
            bx.errorbar(r["diff_vs_dense"], i, xerr=[[r["diff_vs_dense"] - r["diff_ci_low"]],
                                                     [r["diff_ci_high"] - r["diff_vs_dense"]]], fmt="o", capsize=4,
                        color=f"C{cells.index(c) % 10}")  # the bar colour of the same cell
        bx.set_yticks(range(len(diffs)), [c for c, _ in diffs], fontsize=8)
        bx.axvline(0, color="k", lw=0.8)
        bx.axvline(-1, color="r", lw=0.8, ls="--")
        bx.set_xlabel("ruler_avg - dense (points, paired 95% CI)")
        fig.tight_layout()
        path = out_dir / f"ruler_{Path(model).name}_{ctx}_{split}.png"
        tmp = path.with_suffix(".tmp.png")
        fig.savefig(tmp, dpi=110)
        plt.close(fig)
        os.replace(tmp, path)
        paths.append(str(path))
    return paths
