"""Aggregate example results into rows with confidence intervals, and write CSV / JSON / Markdown / PNG.

One row per (model, task, context_length, strategy, config). `score` counts failed examples as 0 (and
`failures` says how many); `score_ok` is the mean over the examples that ran. Scores are percentages.
The 95% interval is Wilson's for 0/1 scores and a seeded percentile bootstrap otherwise.

Every file is written atomically (a temporary file in the same folder, then `os.replace`), with results.json
last: a run stopped at any point leaves complete files, and the rows of results.json are never ahead of
examples.jsonl. `check_output_dir` refuses to write over earlier results unless told to replace or resume them;
`read_results` loads a folder's results for a resume. This module does not decide which blocks a resume skips
(`suite.run` does) nor whether two runs are comparable (`suite.check_resume`).
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import glob
import gzip
import json
import math
import os
import platform
import tempfile
from typing import Any

import numpy as np

ROW_FIELDS = ("model", "task", "family", "context_length", "strategy", "config", "topk_frac", "anchors", "examples",
              "failures", "score", "score_ok", "ci_low", "ci_high", "prefill_tokens", "decode_tokens", "wall_s",
              "prompts_per_s")
CSV_FIELDS = ROW_FIELDS + ("status",)  # status: "partial" (a checkpoint of an unfinished run) or "complete"
RESULT_FILES = ("results.json", "results.csv", "examples.jsonl", "examples.jsonl.gz", "summary.md")  # + *.png
EXAMPLES = "examples.jsonl"  # what eval writes; committed folders keep it gzipped (EXAMPLES + ".gz")


@contextlib.contextmanager
def atomic_open(path: str, mode: str = "w", **kw):
    """Open a temporary file next to `path`; on a clean exit it replaces `path` in one step (os.replace), on an
    error it is removed and `path` keeps its old content."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would make results unreadable to others
        with os.fdopen(fd, mode, **kw) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _result_files(output_dir: str) -> list[str]:
    names = [os.path.join(output_dir, n) for n in RESULT_FILES] + glob.glob(os.path.join(output_dir, "*.png"))
    names += glob.glob(os.path.join(output_dir, ".*.tmp"))  # temporaries of a write that was killed
    return [p for p in names if os.path.isfile(p)]


def check_output_dir(output_dir: str, *, overwrite: bool = False, resume: bool = False) -> None:
    """Refuse an `output_dir` that holds anything unless `overwrite` (its result files are removed now, so no plot
    of an earlier run stays next to new numbers; other files are left alone) or `resume`; refuse an ordinary file
    always (no flag deletes a file that is not a result), and a folder that cannot be written, before any work."""
    if overwrite and resume:
        raise ValueError("--overwrite and --resume exclude each other: pass one of them")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir!r} is an existing file, not an output directory: choose another "
                         f"--output_dir (no flag deletes it)")
    check_writable(output_dir, "--output_dir")
    if not os.path.isdir(output_dir) or not os.listdir(output_dir):
        return
    if overwrite:
        for p in _result_files(output_dir):
            os.remove(p)
    elif not resume:
        held = sorted(os.listdir(output_dir))
        raise ValueError(f"--output_dir {output_dir!r} is not empty (it holds {', '.join(held[:5])}"
                         f"{', ...' if len(held) > 5 else ''}): pass --resume to continue that run (its finished "
                         f"blocks are kept and skipped) or --overwrite to replace its results, or choose another "
                         f"--output_dir")


def check_writable(path: str, flag: str) -> None:
    """Create `path` (a folder) if needed and check that a file can be written there, so a run fails now, not after
    its first block."""
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write_check_{os.getpid()}.tmp")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except FileExistsError:
        raise ValueError(f"{flag} {path!r} is a file, not a folder") from None
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be written: {e.strerror or e}") from None


def examples_path(output_dir) -> str | None:
    """A run folder's examples: examples.jsonl (what eval writes), else examples.jsonl.gz (how the repository keeps
    committed runs, to keep the tree small enough to travel with the device calls), else None."""
    for name in (EXAMPLES, EXAMPLES + ".gz"):
        path = os.path.join(output_dir, name)
        if os.path.isfile(path):
            return path
    return None


def iter_examples(path):
    """(line number, record) of an examples file, plain or gzipped; a damaged line names the file and the line."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield n, json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path} line {n} is not valid JSON ({e.msg}): the file is damaged") from None


def read_results(output_dir: str) -> tuple[dict | None, list[dict]]:
    """(results.json as a dict, or None where there is none; the examples.jsonl records) of an output folder."""
    path = os.path.join(output_dir, "results.json")
    if not os.path.isfile(path):
        return None, []
    data = read_results_file(path)
    ex = examples_path(output_dir)
    return data, [r for _, r in iter_examples(ex)] if ex else []


def read_results_file(path) -> dict:
    """A results.json as written here (a JSON object, its `rows` a list), or one line naming the file."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("rows", []), list):
        what = f"a JSON {type(data).__name__}" if not isinstance(data, dict) else "rows that are not a list"
        raise ValueError(f"{path} is not an experiments.eval results file (it holds {what}, not an object with a "
                         "list of rows)")
    return data


def read_json(path) -> Any:
    """json.load of a file, with an error that names the file (a damaged or half-written results file)."""
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text (JSON) file") from None


def wilson(successes: float, n: int, z: float = 1.96) -> tuple[float, float]:
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    den = 1 + z * z / n
    center = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, center - half), min(1.0, center + half))


def bootstrap(scores, *, reps: int = 2000, seed: int = 0) -> tuple[float, float]:
    scores = np.asarray(scores, np.float64)
    if scores.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = scores[rng.integers(0, scores.size, size=(reps, scores.size))].mean(axis=1)
    return (float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5)))


def confidence_interval(scores) -> tuple[float, float]:
    """95% interval of the mean of per-example scores in [0, 1]."""
    scores = np.asarray(scores, np.float64)
    if scores.size and np.all((scores == 0) | (scores == 1)):
        return wilson(float(scores.sum()), int(scores.size))
    return bootstrap(scores)


def make_row(results, *, model: str, task: str, family: str, context_length: int, strategy: str, config: str = "",
             topk_frac=None, anchors=None, wall_s: float | None = None) -> dict:
    scores = [r.score for r in results]
    ok = [r.score for r in results if not r.failed]
    lo, hi = confidence_interval(scores)
    return dict(model=model, task=task, family=family, context_length=int(context_length), strategy=strategy,
                config=config, topk_frac=topk_frac, anchors=anchors, examples=len(results),
                failures=sum(r.failed for r in results),
                score=100 * float(np.mean(scores)) if scores else float("nan"),
                score_ok=100 * float(np.mean(ok)) if ok else float("nan"), ci_low=100 * lo, ci_high=100 * hi,
                prefill_tokens=float(np.mean([r.prompt_tokens for r in results])) if results else 0.0,
                decode_tokens=float(np.mean([r.new_tokens for r in results])) if results else 0.0,
                wall_s=float(sum(r.wall_s for r in results)) if wall_s is None else float(wall_s))


def environment(argv=None) -> dict:
    import jax  # noqa: PLC0415

    try:
        device = str(jax.devices()[0].device_kind)
    except Exception:  # noqa: BLE001
        device = "unknown"
    return dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                device=device, backend=jax.default_backend(), jax=jax.__version__, python=platform.python_version(),
                command=" ".join(argv) if argv else "")


def _fmt(x, nd=1):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def averages(rows) -> list[dict]:
    """Mean score over tasks per (model, family, context_length, strategy, config)."""
    groups: dict = {}
    for r in rows:
        if r["family"] == "fidelity":
            continue
        groups.setdefault((r["model"], r["family"], r["context_length"], r["strategy"], r["config"]), []).append(r)
    out = []
    for (model, family, ctx, strategy, config), rs in groups.items():
        out.append(dict(model=model, family=family, context_length=ctx, strategy=strategy, config=config,
                        tasks=len(rs), examples=sum(r["examples"] for r in rs), failures=sum(r["failures"] for r in rs),
                        score=float(np.mean([r["score"] for r in rs])), topk_frac=rs[0]["topk_frac"]))
    return out


def markdown(rows, env: dict, extra_sections: list[str] = ()) -> str:
    lines = ["# Evaluation results", "",
             f"- date: {env.get('date')}, device: {env.get('device')} ({env.get('backend')}), JAX {env.get('jax')}",
             f"- command: `{env.get('command')}`", ""]
    if env.get("partial"):
        lines += ["**partial**: a checkpoint of a run still in progress or stopped early; only its finished "
                  "(task, context length, strategy) blocks are listed.", ""]
    lines += ["Scores in %, failures counted as 0 (`failures` column); 95% CI: Wilson (0/1 scores) or bootstrap.", "",
             "| task | ctx | strategy | config | score | 95% CI | n | fail | prefill tok | decode tok | time s | "
             "prompts/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["family"] == "fidelity":
            continue
        lines.append(f"| {r['task']} | {r['context_length']} | {r['strategy']} | {r['config']} | {_fmt(r['score'])} | "
                     f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}] | {r['examples']} | {r['failures']} | "
                     f"{_fmt(r['prefill_tokens'], 0)} | {_fmt(r['decode_tokens'], 1)} | {_fmt(r['wall_s'])} | "
                     f"{_fmt(r.get('prompts_per_s'), 2)} |")
    avg = averages(rows)
    if avg:
        lines += ["", "## Average over tasks", "", "| family | ctx | strategy | config | tasks | n | fail | score |",
                  "|---|---|---|---|---|---|---|---|"]
        for a in avg:
            lines.append(f"| {a['family']} | {a['context_length']} | {a['strategy']} | {a['config']} | {a['tasks']} | "
                         f"{a['examples']} | {a['failures']} | {_fmt(a['score'])} |")
    for section in extra_sections:
        lines += ["", section]
    return "\n".join(lines) + "\n"


def text_table(rows) -> str:
    """A compact console table."""
    head = ("task", "ctx", "strategy", "config", "score", "95% CI", "n", "fail", "time s")
    body = [(r["task"], str(r["context_length"]), r["strategy"], r["config"], _fmt(r["score"]),
             f"[{_fmt(r['ci_low'])}, {_fmt(r['ci_high'])}]", str(r["examples"]), str(r["failures"]), _fmt(r["wall_s"]))
            for r in rows if r["family"] != "fidelity"]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*b) for b in body])


def plot(rows, output_dir: str) -> list[str]:
    """score vs context length (per strategy) and score vs Top-k% (per strategy); returns the PNG paths."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    avg = averages(rows)
    paths = []
    if not avg:
        return paths
    fig, ax = plt.subplots(figsize=(6, 4))
    for (strategy, config) in sorted({(a["strategy"], a["config"]) for a in avg}):
        pts = sorted((a["context_length"], a["score"]) for a in avg
                     if (a["strategy"], a["config"]) == (strategy, config))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{strategy} {config}".strip())
    ax.set_xscale("log", base=2)
    paths.append(_save(fig, ax, "context length (tokens)", "score (%), mean over tasks",
                       os.path.join(output_dir, "score_vs_context.png")))

    fig, ax = plt.subplots(figsize=(6, 4))
    dense = [a for a in avg if a["topk_frac"] is None]
    for strategy in sorted({a["strategy"] for a in avg if a["topk_frac"] is not None}):
        pts = {}
        for a in avg:
            if a["strategy"] == strategy and a["topk_frac"] is not None:
                pts.setdefault(100 * float(a["topk_frac"]), []).append(a["score"])
        xs = sorted(pts)
        ax.plot(xs, [np.mean(pts[x]) for x in xs], marker="o", label=strategy)
    for strategy in sorted({a["strategy"] for a in dense}):
        ax.axhline(np.mean([a["score"] for a in dense if a["strategy"] == strategy]), ls="--", color="k", lw=1,
                   label=f"{strategy} (no Top-k)")
    paths.append(_save(fig, ax, "Top-k (% of context)", "score (%), mean over tasks and lengths",
                       os.path.join(output_dir, "score_vs_topk.png")))
    return paths


def _save(fig, ax, xlabel: str, ylabel: str, path: str) -> str:
    """Label, grid and legend one score plot, write it to `path` and close it."""
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=120)
    plt.close(fig)
    return path


def write(rows, output_dir: str, *, env: dict, examples: list[dict] = (), extra: dict | None = None,
          extra_sections: list[str] = (), plots: bool = True) -> dict:
    """Write results.csv, results.json (rows + environment + extra), examples.jsonl (one record per example:
    prediction, answers, score, error), summary.md and plots, each atomically and results.json last. With
    `env["partial"]` the JSON, the CSV's `status` column and summary.md all say `partial`."""
    os.makedirs(output_dir, exist_ok=True)
    paths = dict(csv=os.path.join(output_dir, "results.csv"), json=os.path.join(output_dir, "results.json"),
                 examples=os.path.join(output_dir, "examples.jsonl"), markdown=os.path.join(output_dir, "summary.md"))
    with atomic_open(paths["examples"], "w") as f:
        for e in examples:
            f.write(json.dumps(e, default=str, ensure_ascii=False) + "\n")
    status = "partial" if env.get("partial") else "complete"
    with atomic_open(paths["csv"], "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_FIELDS), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow(dict({k: ("" if r.get(k) is None else r.get(k)) for k in ROW_FIELDS}, status=status))
    with atomic_open(paths["markdown"], "w") as f:
        f.write(markdown(rows, env, extra_sections))
    if plots:
        paths["plots"] = plot(rows, output_dir) + plot_fidelity((extra or {}).get("fidelity") or {}, output_dir)
    with atomic_open(paths["json"], "w") as f:  # last: the rows it lists are complete in every other file
        json.dump(dict(environment=env, rows=list(rows), averages=averages(rows), **(extra or {})), f, indent=1,
                  default=str)
    return paths


def pivot_markdown(rows, *, baseline: str = "dense") -> str:
    """One line per (strategy, config): the task-average score at each context length (with the difference to
    `baseline` where it ran) and each task's score per context length; the layout of the paper's RULER tables."""
    fams = ("ruler", "synthetic")
    avg = [a for a in averages(rows) if a["family"] in fams]
    if not avg:
        return ""
    ctxs = sorted({a["context_length"] for a in avg})
    tasks = list(dict.fromkeys(r["task"] for r in rows if r["family"] in fams))
    # An average over fewer tasks than the most complete line at that length is not comparable: shown in brackets.
    full = {c: max(a["tasks"] for a in avg if a["context_length"] == c) for c in ctxs}
    base = {a["context_length"]: a["score"] for a in avg if a["strategy"] == baseline and a["tasks"] == full[a["context_length"]]}
    keys = sorted(dict.fromkeys((a["strategy"], a["config"]) for a in avg), key=lambda k: k[0] != baseline)
    by = {(a["strategy"], a["config"], a["context_length"]): a for a in avg}
    cell = {(r["strategy"], r["config"], r["task"], r["context_length"]): r for r in rows if r["family"] in fams}
    head = ["strategy", "config"] + [f"avg {c}" for c in ctxs] + [f"{t} {c}" for t in tasks for c in ctxs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s, cfg in keys:
        out = [s, cfg]
        for c in ctxs:
            a = by.get((s, cfg, c))
            if a is None:
                out.append("-")
                continue
            if a["tasks"] < full[c]:
                out.append(f"({a['tasks']}/{full[c]} tasks)")
                continue
            txt = f"**{a['score']:.1f}**"
            if c in base and s != baseline:
                txt += f" ({a['score'] - base[c]:+.1f})"
            out.append(txt)
        for t in tasks:
            for c in ctxs:
                r = cell.get((s, cfg, t, c))
                out.append("-" if r is None else f"{r['score']:.1f} [{_fmt(r['ci_low'], 0)}, {_fmt(r['ci_high'], 0)}]")
        lines.append("| " + " | ".join(out) + " |")
    return "\n".join(lines)


def plot_fidelity(fid: dict, output_dir: str) -> list[str]:
    """Per-layer attention mass recovered vs the oracle Top-k, prefill (solid) and decode (dashed), one colour per
    strategy, its anchor layers marked (the distance from the anchor reads off the x axis); and, per strategy, a
    (layer x KV head) heatmap of the prefill ratio: where a strategy loses mass. Returns the PNG paths."""
    import re  # noqa: PLC0415

    entries = [(k, f) for k, f in fid.items() if f.get("mass_ratio") or f.get("decode_mass_ratio")]
    if not entries:
        return []
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(1 + len(entries), 1, figsize=(9, 2.8 * (1 + len(entries))), squeeze=False)
    ax = axes[0, 0]
    for j, (key, f) in enumerate(entries):
        ratio, color = f.get("mass_ratio"), f"C{j % 10}"
        if f.get("task") == "answers":  # decode along dense's answers to RULER prompts: no prefill probe
            label = f"{f['strategy']} {f['config']} (RULER answers, {f['prompts'] - f.get('failures', 0)} prompts)"
        else:
            label = f"{f['strategy']} {f['config']} ({f['documents'] - f.get('failures', 0)} docs)"
        if ratio:
            ax.plot(range(len(ratio)), ratio, marker="o", ms=3, color=color, label=f"prefill: {label}")
        if f.get("decode_mass_ratio"):
            ax.plot(range(len(f["decode_mass_ratio"])), f["decode_mass_ratio"], marker="s", ms=3, ls="--",
                    color=color, label=f"decode: {label}")
        m = re.search(r"anchors=([0-9,]+)", f.get("config", ""))
        for a in (int(x) for x in m.group(1).split(",") if x) if m else ():
            ax.axvline(a, color=color, lw=0.8, alpha=0.35)
    ax.set_xlabel("layer (vertical lines: anchors)")
    ax.set_ylabel("mass / oracle Top-k mass")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=5)
    for i, (key, f) in enumerate(entries, start=1):
        phase = "prefill" if f.get("mass_ratio") else "decode"
        ratio = f[f"{'' if phase == 'prefill' else 'decode_'}mass_ratio"]
        heads = f.get(f"{'' if phase == 'prefill' else 'decode_'}mass_ratio_heads") or [ratio]
        heads = np.asarray(heads, np.float64).reshape(len(ratio), -1)
        ax = axes[i, 0]
        im = ax.imshow(heads.T, aspect="auto", cmap="viridis", vmin=min(0.7, float(heads.min())), vmax=1.0)
        ax.set_title(f"{f['strategy']} {f['config']} ({phase} mass / oracle)", fontsize=7)
        ax.set_xlabel("layer")
        ax.set_ylabel("KV head")
        ax.set_yticks(range(heads.shape[1]))
        fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    path = os.path.join(output_dir, "fidelity_mass_by_layer.png")
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return [path]
