"""The benchmarks' reports: Markdown tables and plots of the decode and prefill kernel benchmarks, the end-to-end
benchmark and the paged file (kernels and serving replay). Pure functions of the stored rows: rerunning one on a
saved JSON rewrites the same report, and none of them measures anything.
"""

from __future__ import annotations

import re

from kascade_jax.bench.store import order, paged_mask
from kascade_jax.bench.timing import BenchShape

_DEFAULT = BenchShape()


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _flags_text(run: dict) -> str:
    """', XLA_FLAGS `...`' for a run record that has them (`timing.xla_flags_record`), else ''."""
    return f", XLA_FLAGS `{run['xla_flags']}`" if run.get("xla_flags") else ""


def _head(title: str, meta: dict, level: int = 1) -> list[str]:
    """A heading '<title> (<gpu>)' and the line of the run's date, JAX version, XLA_FLAGS (if set) and command."""
    return [f"{'#' * level} {title} ({meta['gpu']})", "",
            f"Date {meta['date']}, JAX {meta['jax']}{_flags_text(meta)}, command `{meta['command']}`."]


def _kernel_lines(title: str, items, digits: int, min_ms: float | None = None) -> list[str]:
    """A Markdown list of per-kernel times under `title`: one line per (label, {kernel: ms}) of items."""
    return ["", title, ""] + [f"- {label}: " + ", ".join(f"`{n[:48]}` {t:.{digits}f}" for n, t in kernels.items()
                                                          if min_ms is None or t > min_ms) for label, kernels in items]


def _speedup_plot(rows, path, series, label, ylabel, title, lines=()):
    """Speedup against context, one line per key series(row) (labelled label(key)), log2 x axis."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({series(r) for r in rows}):
        pts = sorted((r["context"], r["speedup"]) for r in rows if series(r) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label(key))
    ax.set_xscale("log", base=2)
    for y, ls, text in lines:
        ax.axhline(y, color="gray", ls=ls, lw=0.8, label=text)
    ax.set_xlabel("context")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Kernel benchmarks
# ---------------------------------------------------------------------------------------------------------------


def decode_markdown(rows, meta, shape=_DEFAULT):
    lines = _head("Kascade decode attention vs cuDNN dense", meta) + [
        f"CUPTI kernel time, median of iterations, ms. {shape.heads_text()}, every sequence at full length.",
        f"Weighted = {shape.formula()} ({shape.mix_text()}).", "",
        "| dtype | batch | context | top-k | k | dense | A0 | A | R | A0/dense | A/dense | R/dense | weighted | speedup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['topk_frac']:.0%} | {r['k']} | {r['dense']:.4f} | "
                     f"{r['A0']:.4f} | {r['A']:.4f} | {r['R']:.4f} | {r['A0/dense']:.3f} | {r['A/dense']:.3f} | "
                     f"{r['R/dense']:.3f} | {r['weighted']:.4f} | **{r['speedup']:.2f}x** |")
    lines += _kernel_lines("Per-kernel breakdown of A (ms):", [(_decode_label(r), r["A_kernels"]) for r in rows], 4)
    reranks = sorted({int(m.group(1)) for r in rows for key in r if (m := re.fullmatch(r"speedup_rr(\d+)", key))})
    worst = sorted({m.group(1) for r in rows for key in r if (m := re.fullmatch(r"speedup_(rr\d+w\d+)", key))})
    pools = sorted({m.group(1) for r in rows for key in r if (m := re.fullmatch(r"speedup_pool(\w+)", key))})
    if pools:
        lines += _lever_table(
            rows, [(p, f"pool{p}") for p in pools], ["A0", "A", "R"], "pool", True,
            "**The selection pool** through the strategy's path (gqa: one Top-k per KV head, Kascade; all: one set "
            "pooled over every query head and shared, all_heads_pooled), same run and dense:")
    if any("speedup_fp8" in r for r in rows):
        lines += _lever_table(
            rows, [("fp8 K", "fp8"), ("fp8 K, float16 dot", "fp8f16")], ["A"], "scores", False,
            "**The anchors' scores from an fp8 copy of K** (`score_keys`, the recipe lever `decode_score_fp8`: K centred "
            "on the prompt's mean key, one power-of-two scale per sequence; the copy is kept by the cache, so it is made "
            "outside the timing), A re-timed, A0 and R the row's, same run and dense:")
        lines += _lever_kernels("Per-kernel breakdown of A on the fp8 K copy (ms):", rows, "A",
                                [("fp8", "fp8"), ("float16", "fp8f16")])
        lines += [f"- {_decode_label(r)}: float16 dot failed: {r['fp8f16_failed']}" for r in rows
                  if "fp8f16_failed" in r]
    sweep = {tag: text for r in rows for tag, text in r.get("reuse_sweep", {}).items()}
    if sweep:
        lines += _lever_table(
            rows, [(text, tag) for tag, text in sweep.items()], ["A", "R"], "reuse tuning", True,
            "**The reuse kernel's tunings** (`DecodeTuning` reuse fields; A re-timed too: the anchors' sparse output "
            "is the same kernel; A0 the row's), same run and dense:")
        lines += _lever_kernels("Per-kernel breakdown of R with each reuse tuning (ms):", rows, "R",
                                [(text, tag) for tag, text in sweep.items()])
    shorts = list(dict.fromkeys(m.group(1) for r in rows for key in r if (m := re.fullmatch(r"speedup_(ss\w+)", key))))
    if shorts:
        with_r = all(f"R_{t}" in r for r in rows for t in shorts if f"speedup_{t}" in r)  # (runs before session 24: no)
        lines += _lever_table(
            rows, [(t[2:].replace("_", ", "), t) for t in shorts], ["A0", "A", "R"] if with_r else ["A0", "A"],
            "short select, pool", False,
            "**The short-row select** (`DecodeTuning.short_select_max` N[wW][dD][rR][c]: rows of <= N keys, at most R "
            "of them, select from registers in one launch; 0: the four-launch pipeline; c: the split-K combine as one "
            "launch, `DecodeTuning.fused_combine`), A0 and A re-timed, R re-timed where c changes it (else the "
            "row's), same run and dense:")
        lines += _lever_kernels("Per-kernel breakdown of A with each short select setting (ms):", rows, "A",
                                [(t[2:], t) for t in shorts])
    if reranks:
        lines += _lever_table(
            rows, [(str(c), f"rr{c}") for c in reranks], ["A0", "A", "R"], "C", True,
            "**The decode_rerank lever** (C x the budget as the anchors' candidates; every reuse layer scores them "
            "with its own query and attends its own Top-k), through the strategy's path, same run and dense:")
        if worst:
            lines += _lever_table(
                rows, [(t, t) for t in worst], ["A0", "A", "R", "F"], "lever", False,
                "**Only the worst reuse layers rerank** (`decode_rerank_worst`: rrCwN = C candidates per key, N "
                "reranking layers): A includes the anchor's ordering of its candidates, F is a reuse layer that "
                "attends the anchor's own Top-k among them; weighted (A0 + (M-1) A + N R + (L-M-N) F) / L:")
        lines += _lever_kernels("Per-kernel breakdown of R with the rerank (ms):", rows, "R",
                                [(f"C={c}", f"rr{c}") for c in reranks])
    return "\n".join(lines) + "\n"


def _decode_label(r) -> str:
    return f"{r['dtype']} b{r['batch']} {r['context']} {r['topk_frac']:.0%}"


def _lever_kernels(title: str, rows, piece: str, levers) -> list[str]:
    """`_kernel_lines` of `piece` under each lever of each row; levers: [(shown name, key suffix)]."""
    return _kernel_lines(title, [(f"{_decode_label(r)} {name}", r[f"{piece}_{t}_kernels"]) for r in rows
                                 for name, t in levers if f"{piece}_{t}_kernels" in r], 4)


def _lever_table(rows, levers, pieces, label: str, r_ratio: bool, title: str) -> list[str]:
    """A table of a decode lever's pieces (keys f"{piece}_{suffix}", weighted_/speedup_{suffix}) per row, its
    speedup against the row's plain Kascade; levers: [(shown name, key suffix)]."""
    cols = pieces + (["R/dense"] if r_ratio else []) + ["weighted", "speedup", "vs plain"]
    out = ["", title, "", f"| dtype | batch | context | top-k | {label} | " + " | ".join(cols) + " |",
           "|" + "---|" * (5 + len(cols))]
    for r in rows:
        for name, t in levers:
            if f"speedup_{t}" not in r:
                continue
            vals = [f"{r[f'{p}_{t}']:.4f}" for p in pieces] + ([f"{r[f'R_{t}'] / r['dense']:.3f}"] if r_ratio else [])
            vals += [f"{r[f'weighted_{t}']:.4f}", f"**{r[f'speedup_{t}']:.2f}x**", f"{r[f'speedup_{t}'] / r['speedup']:.2f}"]
            out.append(f"| {r['dtype']} | {r['batch']} | {r['context']} | {r['topk_frac']:.0%} | {name} | "
                       + " | ".join(vals) + " |")
    return out


def decode_plot(rows, path, shape=_DEFAULT):
    _speedup_plot(rows, path, lambda r: (r["dtype"], r["batch"], r["topk_frac"]),
                  lambda k: f"{k[0]} b{k[1]} top-k {k[2]:.0%}", "weighted Kascade speedup over cuDNN",
                  f"decode, {shape.heads_text()}; weighted {shape.formula()}", lines=[(4.5, "--", None)])


def prefill_markdown(rows, meta, shape=_DEFAULT):
    lines = _head("Kascade prefill attention vs cuDNN causal flash attention", meta) + [
        f"Kernel tuning: `{meta['tuning']}`.",
        f"CUPTI kernel time, median of iterations, ms. Batch 1, {shape.heads_text()}, rolling budgets, "
        f"tile {meta.get('tile', 32)}, min_k {meta.get('min_k', 128)}.",
        f"Weighted = {shape.formula()} ({shape.mix_text()}). "
        "A extra = XLA temp memory of the compiled anchor pipeline; A outputs = its out + idx buffers.", "",
        "| dtype | context | top-k | dense | A0 | A | R | A0/dense | A/dense | R/dense | weighted | speedup | A extra GB | A outputs GB (out+idx) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['context']} | {r['topk_frac']:.0%} | {r['dense']:.2f} | {r['A0']:.2f} | "
                     f"{r['A']:.2f} | {r['R']:.2f} | {r['A0/dense']:.3f} | {r['A/dense']:.3f} | {r['R/dense']:.3f} | "
                     f"{r['weighted']:.2f} | **{r['speedup']:.2f}x** | {r['A_extra_bytes'] / 1e9:.2f} | "
                     f"{r['A_out_bytes'] / 1e9:.2f} |")
    lines += _kernel_lines("Per-kernel times (ms):", [(f"{r['dtype']} {r['context']} {r['topk_frac']:.0%} {name}",
                                                       r[name + "_kernels"]) for r in rows for name in ("A0", "A", "R")], 3)
    return "\n".join(lines) + "\n"


def prefill_sweep_markdown(rows, meta, shape=_DEFAULT):
    lines = _head("Prefill tuning sweep", meta) + [
        "CUPTI kernel ms (median). Each variant is applied on top of the base row; "
        "pieces a variant does not touch take the base's time in the estimates; '-' = not re-timed.",
        f"Batch 1, {shape.heads_text()}; weighted = {shape.formula()} ({shape.mix_text()}).", "",
        "| context | variant | dense | A0 | A | R | A0/dense | A/dense | R/dense | weighted (est.) |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    f = lambda r, n: f"{r[n]:.2f}" if n in r else "-"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['context']} | `{r['spec']}` | {f(r, 'dense')} | {f(r, 'A0')} | {f(r, 'A')} | {f(r, 'R')} | "
                     f"{r['A0/dense_est']:.3f} | {r['A/dense_est']:.3f} | {r['R/dense_est']:.3f} | "
                     f"**{r['speedup_est']:.2f}x** |")
    lines += _kernel_lines("Per-kernel times (ms):", [(f"{r['context']} `{r['spec']}` {n}", r[n + "_kernels"])
                                                      for r in rows for n in ("A0", "A", "R") if n in r], 3, 0.01)
    return "\n".join(lines) + "\n"


def prefill_plot(rows, path, shape=_DEFAULT):
    _speedup_plot(rows, path, lambda r: (r["dtype"], r["topk_frac"]), lambda k: f"{k[0]} top-k {k[1]:.0%}",
                  "weighted Kascade prefill speedup over cuDNN",
                  f"prefill, batch 1, {shape.heads_text()}; weighted {shape.formula()}",
                  lines=[(2.19, ":", "paper (vs FA3, H100)"), (2.8, "--", "target")])


# ---------------------------------------------------------------------------------------------------------------
# End-to-end
# ---------------------------------------------------------------------------------------------------------------


def _ms(x):
    return "–" if x is None else f"{1e3 * x:.2f}"


def _s(x):
    return "–" if x is None else f"{x:.3f}"


def _pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def _x(x):
    return "–" if x is None else f"**{x:.2f}x**"


def _mesh_cell(row: dict) -> str:
    return f"{row.get('mesh') or 'none'} ({row.get('devices', 1)})"


def e2e_markdown(meta: dict, rows: list) -> str:
    lines = ["# End-to-end speed: dense (cuDNN) vs Kascade in the model", ""]
    for run in meta.get("runs", []):
        where = f"mesh {run['mesh']} over {run.get('devices')} devices" if run.get("mesh") else "one device"
        lines.append(f"- {run.get('date')}: {run.get('gpu')}, JAX {run.get('jax')}, {where}{_flags_text(run)}, "
                     f"`{run.get('command')}`")
    lines += ["", "Wall clock after compilation (TTFT: prefill of the whole prompt + first greedy sample, batch 1; "
              "decode: ms per step of the jitted decode loop, (t(N2) - t(N1)) / (N2 - N1)). Attention / rest: CUPTI "
              "kernel time split by kernel name (cuDNN attention and the Pallas kernels vs everything else; the "
              "small XLA fusions around the Pallas kernels count as rest). Speedup = dense wall / Kascade wall.", ""]
    for note in meta.get("notes", []):
        lines.append(f"- note: {note}")
    ttft = sorted((r for r in rows if r["metric"] == "ttft" and "runs" in r), key=order)
    dec = sorted((r for r in rows if r["metric"] == "decode_step" and "runs" in r), key=order)
    if ttft:
        lines += ["", "## Time to first token (s)", "",
                  "| model | mesh (devices) | context | dense | Kascade | speedup | dense attn / rest | Kascade attn / rest | "
                  "attn share dense | attn share Kascade | attention speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in ttft:
            lines.append(
                f"| {r['model']} | {_mesh_cell(r)} | {r['context']} | {_s(r.get('dense_s'))} | {_s(r.get('kascade_s'))} | "
                f"{_x(r.get('speedup'))} | {_s(r.get('dense_attention_s'))} / {_s(r.get('dense_rest_s'))} | "
                f"{_s(r.get('kascade_attention_s'))} / {_s(r.get('kascade_rest_s'))} | "
                f"{_pct(r.get('attention_share_dense'))} | {_pct(r.get('attention_share_kascade'))} | "
                f"{_x(r.get('attention_speedup'))} |")
    if dec:
        pallas = any("dense_pallas" in r["runs"] for r in dec)
        head = ("| model | mesh (devices) | context | batch | dense | Kascade | speedup | dense attn / rest | Kascade attn / rest | "
                "attn share dense | attn share Kascade | dense byte floor | dense wall - kernels |")
        sep = "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        if pallas:
            head += " dense split-K Pallas (attn) |"
            sep += "---|"
        lines += ["", "## Decode step (ms)", "", head, sep]
        for r in dec:
            gap = None
            if r.get("dense_s") is not None and r.get("dense_kernel_s") is not None:
                gap = r["dense_s"] - r["dense_kernel_s"]
            line = (f"| {r['model']} | {_mesh_cell(r)} | {r['context']} | {r['batch']} | {_ms(r.get('dense_s'))} | "
                    f"{_ms(r.get('kascade_s'))} | {_x(r.get('speedup'))} | "
                    f"{_ms(r.get('dense_attention_s'))} / {_ms(r.get('dense_rest_s'))} | "
                    f"{_ms(r.get('kascade_attention_s'))} / {_ms(r.get('kascade_rest_s'))} | "
                    f"{_pct(r.get('attention_share_dense'))} | {_pct(r.get('attention_share_kascade'))} | "
                    f"{_ms(r.get('floor_s'))} | {_ms(gap)} |")
            if pallas:
                line += f" {_ms(r.get('dense_pallas_s'))} ({_ms(r.get('dense_pallas_attention_s'))}) |"
            lines.append(line)
    skipped = [r for r in rows if r.get("skipped")]
    if skipped:
        lines += ["", "## Not measured", ""]
        for r in sorted(skipped, key=order):
            lines.append(f"- {r['model']} {r['metric']} context {r['context']} batch {r['batch']} mesh "
                         f"{r.get('mesh') or 'none'}: {r['skipped']}")
    notes = sorted({n for r in rows for n in r.get("notes", [])})
    notes += [f"{r['model']} {r['metric']} context {r['context']} batch {r['batch']} mesh {r.get('mesh') or 'none'}: "
              f"{r['settings_note']}" for r in sorted(rows, key=order) if r.get("settings_note")]
    if notes:
        lines += ["", "## Row notes", ""] + [f"- {n}" for n in notes]
    tops = [r for r in dec if any(run.get("top") for run in r["runs"].values())]
    if tops:
        lines += ["", "## Top kernels per decode step (ms)", ""]
        for r in tops:
            for s, run in sorted(r["runs"].items()):
                top = ", ".join(f"`{n[:40]}` {1e3 * t:.3f} ({c})" for n, t, c in run.get("top", [])[:8])
                lines.append(f"- {r['model']} {r['context']} b{r['batch']} mesh {r.get('mesh') or 'none'} {s}: {top}")
    return "\n".join(lines) + "\n"


def e2e_plot(rows: list, path: str) -> None:
    plt = _pyplot()
    ttft = [r for r in rows if r["metric"] == "ttft" and r.get("speedup")]
    dec = sorted((r for r in rows if r["metric"] == "decode_step" and r.get("dense_kernel_s")
                  and r.get("kascade_kernel_s")), key=order)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw=dict(width_ratios=[1, 2]))
    ax = axes[0]
    for model, mesh in sorted({(r["model"], r.get("mesh") or "") for r in ttft}):
        pts = sorted((r["context"], r["speedup"]) for r in ttft if r["model"] == model and (r.get("mesh") or "") == mesh)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=model + (f" {mesh}" if mesh else ""))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT speedup (dense / Kascade)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title("time to first token, batch 1", fontsize=9)
    if ttft:
        ax.legend(fontsize=7)
    ax = axes[1]
    for i, r in enumerate(dec):
        for j, s in enumerate(("dense", "kascade")):
            a, rest = 1e3 * (r.get(f"{s}_attention_s") or 0), 1e3 * (r.get(f"{s}_rest_s") or 0)
            x = 3 * i + j
            ax.bar(x, rest, color="#999999", label="rest" if i == j == 0 else None)
            ax.bar(x, a, bottom=rest, color="#1f77b4" if s == "dense" else "#d62728",
                   label=f"attention ({s})" if i == 0 else None)
    ax.set_xticks([3 * i + 0.5 for i in range(len(dec))])
    ax.set_xticklabels([f"{r['model'].split('-random')[0]}\n{r['context'] // 1024}K b{r['batch']}"
                        + (f"\n{r['mesh']}" if r.get("mesh") else "") for r in dec],
                       fontsize=6)
    ax.set_ylabel("CUPTI kernel ms per decode step")
    ax.set_title("decode step: dense (left) vs Kascade (right) bars, attention on top of the rest", fontsize=9)
    if dec:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# The paged file: kernels (paged vs contiguous) and the continuous-batching replay
# ---------------------------------------------------------------------------------------------------------------


def _paged_kernels_md(sec: dict) -> list[str]:
    m = sec["meta"]
    lines = _head("Decode attention: paged vs contiguous cache", m, 2) + [
        f"CUPTI kernel time, median of {m['iterations']} iterations, ms. {m['heads']}, every sequence at full "
        f"length, page size {m['page_size']} with the pages of each sequence scattered at random over the pool. "
        "Contiguous dense = cuDNN; paged dense = the paged Pallas flash-decode (kernels_pallas/paged.py). "
        "A0 / A / R = Kascade anchor-0, anchor, reuse (kernels_pallas/decode.py vs paged.py). "
        f"Weighted = {m['formula']}.", "",
        "mask = the paged rows loaded through a zero mask (`--paged_mask`): none (the cache keeps them finite), v, or "
        "k and v.", "",
        "| batch | context | page | stream block | mask | top-k | dense contig | dense paged | ratio | A0 contig | "
        "A0 paged | ratio | A contig | A paged | ratio | R contig | R paged | ratio | weighted contig | weighted paged "
        "| ratio |",
        "|" + "---|" * 21]
    for r in sec["rows"]:
        cells = [str(r["batch"]), str(r["context"]), str(r["page_size"]), str(r.get("stream_block", "-")),
                 paged_mask(r), f"{r['topk_frac']:.0%}"]
        for n in ("dense", "A0", "A", "R", "weighted"):
            cells += [f"{r[n + '_contig']:.4f}", f"{r[n + '_paged']:.4f}", f"**{r[n + '_ratio']:.3f}**"]
        lines.append("| " + " | ".join(cells) + " |")
    if sec.get("checks"):
        lines += ["", "Same-run checks (paged vs contiguous kernels on the same K/V): " +
                  "; ".join(f"{c['name']}: rel {c['rel']:.1e}" + (f", same index sets {c['same_sets']:.4f}"
                                                                   if "same_sets" in c else "")
                            for c in sec["checks"])]
    if sec.get("not_measured"):
        lines += ["", "Not measured:", ""] + [f"- batch {x['batch']}, context {x['context']}, page {x['page_size']}"
                                              + (f", stream block {x['stream_block']}" if "stream_block" in x else "")
                                              + f", mask {paged_mask(x)}"
                                              + f": {x['reason']}" for x in sec["not_measured"]]
    return lines


def _replay_md(sec: dict) -> list[str]:
    m = sec["meta"]
    lines = _head("Continuous-batching replay", m, 2) + [
        f"Model: {m['model']}. Trace: {m['num_requests']} requests, Poisson arrivals at {m['arrival_rate']} "
        f"req/s, prompts {m['min_prompt']}-{m['max_prompt']} tokens, {m['min_new']}-{m['max_new']} new tokens "
        f"(EOS ignored), seed {m['seed']}. Engine: max_batch {m['max_batch']}, page size {m['page_size']}, "
        f"{m['num_pages']} pages. Compilation is warmed up before the timed replay. TTFT counts queueing from "
        "the scheduled arrival; TPOT = a request's mean time per output token after its first.", "",
        "| strategy | generated tok/s | makespan s | TTFT p50 s | TTFT p99 s | TPOT p50 ms | TPOT p99 ms | "
        "decode steps | mean active slots |",
        "|---|---|---|---|---|---|---|---|---|"]
    for r in sec["rows"]:
        lines.append(f"| {r['strategy']} | **{r['tokens_per_s']:.1f}** | {r['makespan_s']:.2f} | {r['ttft_p50_s']:.3f} | "
                     f"{r['ttft_p99_s']:.3f} | {r['tpot_p50_ms']:.2f} | {r['tpot_p99_ms']:.2f} | {r['decode_steps']} | "
                     f"{r['mean_active']:.2f} |")
    failed = [f"{r['strategy']}: {r['failed_requests']} of {r['requests']} ({r.get('first_error', '')})"
              for r in sec["rows"] if r.get("failed_requests")]
    if failed:
        lines += ["", "Failed requests (no token; left out of the metrics above): " + "; ".join(failed)]
    stopped = [f"{r['strategy']}: {r['stopped']}" for r in sec["rows"] if r.get("stopped")]
    if stopped or m.get("stopped"):  # serve_replay --replay_time_limit: a partial replay, not a measurement
        lines += ["", "**Stopped by the time limit** (metrics over what was generated until then; not comparable): "
                  + "; ".join(stopped or [m["stopped"]])]
    by = {r["strategy"]: r for r in sec["rows"]}
    if "dense" in by and not stopped:
        d = by["dense"]
        for name, r in by.items():
            if name != "dense":  # kascade, kascade_fp8d (decode_score_fp8), ...
                lines += ["", f"{name} / dense generated tokens/s: **{r['tokens_per_s'] / d['tokens_per_s']:.2f}x**; "
                              f"TPOT p50 {r['tpot_p50_ms'] / d['tpot_p50_ms']:.2f}x of dense."]
    return lines


def paged_markdown(data: dict) -> str:
    """paged.md from every section of paged.json present ("kernels", "replay")."""
    lines = ["# Paged KV cache and continuous batching", "",
             "Written by `experiments/bench_paged.py` (kernels) and `experiments/serve_replay.py` (replay); "
             "machine-readable: paged.json; plot: paged.png.", ""]
    if "kernels" in data:
        lines += _paged_kernels_md(data["kernels"]) + [""]
    if "replay" in data:
        lines += _replay_md(data["replay"]) + [""]
    return "\n".join(lines)


def paged_plot(data: dict, path: str) -> None:
    """paged.png: paged/contiguous time ratios per kernel and shape (left), generated tok/s per strategy (right)."""
    panels = [k for k in ("kernels", "replay") if data.get(k, {}).get("rows")]
    if not panels:
        return
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = data[key]["rows"]
        if key == "kernels":
            names = ("dense", "A0", "A", "R", "weighted")
            width = 0.8 / len(rows)
            for i, r in enumerate(rows):
                ax.bar([j + i * width for j in range(len(names))], [r[n + "_ratio"] for n in names], width,
                       label=f"b{r['batch']} {r['context'] // 1024}K page {r['page_size']}")
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.axhline(1.05, color="gray", ls="--", lw=0.8)
            ax.set_ylabel("paged / contiguous kernel time")
            ax.legend(fontsize=7)
        else:
            ax.bar([r["strategy"] for r in rows], [r["tokens_per_s"] for r in rows])
            ax.set_ylabel("generated tokens/s (replay)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
