"""benchmarks/paged.json + paged.md (+ paged.png): one file set shared by the paged-cache kernel benchmark (bench_paged.py,
section "kernels") and the continuous-batching replay (serve_replay.py, section "replay").

Each run replaces only its own section of paged.json and rewrites paged.md from every section present, so the two
scripts can run in either order. The kernels section is merged, not replaced: rows and not_measured entries are keyed
by (batch, context, page_size, stream_block); a new run's row or entry replaces the old one of its key, a shape
measured now drops its old not_measured entry, and the other shapes of earlier runs stay (meta and checks are the
latest run's). An existing paged.json that cannot be read is an error (never silently overwritten). Does not time
anything.
"""

from __future__ import annotations

import json
import os

STEM = "paged"


def _kernels_md(sec: dict) -> list[str]:
    m = sec["meta"]
    lines = [f"## Decode attention: paged vs contiguous cache ({m['gpu']})", "",
             f"Date {m['date']}, JAX {m['jax']}, command `{m['command']}`.",
             f"CUPTI kernel time, median of {m['iterations']} iterations, ms. {m['heads']}, every sequence at full "
             f"length, page size {m['page_size']} with the pages of each sequence scattered at random over the pool. "
             "Contiguous dense = cuDNN; paged dense = the paged Pallas flash-decode (kernels_pallas/paged.py). "
             "A0 / A / R = Kascade anchor-0, anchor, reuse (kernels_pallas/decode.py vs paged.py). "
             f"Weighted = {m['formula']}.", "",
             "| batch | context | page | stream block | top-k | dense contig | dense paged | ratio | A0 contig | A0 paged | ratio | "
             "A contig | A paged | ratio | R contig | R paged | ratio | weighted contig | weighted paged | ratio |",
             "|" + "---|" * 20]
    for r in sec["rows"]:
        cells = [str(r["batch"]), str(r["context"]), str(r["page_size"]), str(r.get("stream_block", "-")),
                 f"{r['topk_frac']:.0%}"]
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
                                              + f": {x['reason']}" for x in sec["not_measured"]]
    return lines


def _replay_md(sec: dict) -> list[str]:
    m = sec["meta"]
    lines = [f"## Continuous-batching replay ({m['gpu']})", "",
             f"Date {m['date']}, JAX {m['jax']}, command `{m['command']}`.",
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
    by = {r["strategy"]: r for r in sec["rows"]}
    if "dense" in by and "kascade" in by:
        lines += ["", f"Kascade / dense generated tokens/s: **{by['kascade']['tokens_per_s'] / by['dense']['tokens_per_s']:.2f}x**; "
                      f"TPOT p50 {by['kascade']['tpot_p50_ms'] / by['dense']['tpot_p50_ms']:.2f}x of dense."]
    return lines


def _plot(data: dict, path: str) -> None:
    """paged.png: paged/contiguous time ratios per kernel and shape (left), generated tok/s per strategy (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [k for k in ("kernels", "replay") if data.get(k, {}).get("rows")]
    if not panels:
        return
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


def _shape_key(r: dict) -> tuple:
    return (r["batch"], r["context"], r["page_size"], r.get("stream_block"))


def merge_kernels(old: dict | None, new: dict) -> dict:
    """The kernels section after `new` (see the module docstring): rows and not_measured merged by shape key; for
    a shape the latest run measured or failed, only its latest result stays (a row or a not_measured entry)."""
    if not old:
        return new
    latest = {_shape_key(r) for r in new.get("rows", []) + new.get("not_measured", [])}
    rows = [r for r in old.get("rows", []) if _shape_key(r) not in latest] + list(new.get("rows", []))
    missing = [x for x in old.get("not_measured", []) if _shape_key(x) not in latest] + list(new.get("not_measured", []))
    order = lambda r: tuple(-1 if v is None else v for v in _shape_key(r))  # noqa: E731
    return dict(new, rows=sorted(rows, key=order), not_measured=sorted(missing, key=order))


def update(out_dir: str, section: str, payload: dict) -> str:
    """Replace `section` ("kernels" | "replay") of <out_dir>/paged.json and rewrite paged.md. Returns the md path."""
    if section not in ("kernels", "replay"):
        raise ValueError(f"section must be 'kernels' or 'replay', got {section!r}")
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, STEM)
    data = {}
    if os.path.exists(base + ".json"):
        try:
            with open(base + ".json") as fh:
                data = json.load(fh)
        except (OSError, ValueError) as e:
            raise ValueError(f"{base}.json exists but cannot be read ({type(e).__name__}: {e}); fix or move it "
                             f"(it holds the other section)") from None
        if not isinstance(data, dict):
            raise ValueError(f"{base}.json: expected a JSON object of sections, got {type(data).__name__}")
    data[section] = merge_kernels(data.get("kernels"), payload) if section == "kernels" else payload
    with open(base + ".json.tmp", "w") as fh:
        json.dump(data, fh, indent=1)
    os.replace(base + ".json.tmp", base + ".json")
    lines = ["# Paged KV cache and continuous batching", "",
             "Written by `experiments/bench_paged.py` (kernels) and `experiments/serve_replay.py` (replay); "
             "machine-readable: paged.json; plot: paged.png.", ""]
    if "kernels" in data:
        lines += _kernels_md(data["kernels"]) + [""]
    if "replay" in data:
        lines += _replay_md(data["replay"]) + [""]
    with open(base + ".md", "w") as fh:
        fh.write("\n".join(lines))
    _plot(data, base + ".png")
    return base + ".md"
