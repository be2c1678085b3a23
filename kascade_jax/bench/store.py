"""How benchmark runs are stored: output file stems, the JSON + Markdown (+ plot) of a run, and the end-to-end
file's rows, merged and resumed by key.

Non-obvious decisions:
- The untagged kernel-benchmark files (decode.*, prefill.*) hold the default shape only, so any other shape or
  layer mix needs a tag; `output_stem` refuses before anything is timed.
- An end-to-end run is done (resume skips it) only when its stored `settings` equal this run's, the date aside; a
  run without settings counts as not done: it is kept and shown until measured again, never divided by. Speedups
  divide only runs whose settings agree in everything but the strategy's own fields and the date.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import tempfile

from kascade_jax.bench.timing import BenchShape

TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def output_stem(name: str, tag: str, shape: BenchShape) -> str:
    """The file stem of kernel benchmark `name` ('decode', 'prefill', 'prefill_sweep'): name, or name_<tag>."""
    if tag:
        if not TAG.fullmatch(tag):
            raise ValueError(f"--bench_tag must be letters, digits, '_', '.' or '-' (not starting with '.', '_' or "
                             f"'-'), got {tag!r}")
        return f"{name}_{tag}"
    if shape != BenchShape():
        raise ValueError(f"--heads={shape.heads} --num_layers={shape.num_layers} --num_anchors={shape.num_anchors} "
                         f"is not the default shape (--heads=32,8,128 --num_layers=32 --num_anchors=5) that "
                         f"{name}.md/json/png hold: pass --bench_tag=NAME to write {name}_NAME.* instead")
    return name


def e2e_stem(tag: str, mesh: str | None = None) -> str:
    """e2e_<tag> when a tag is given; else e2e for one device and e2e_mesh-data<D>-model<M> on a mesh, so a sharded
    run never writes into the one-GPU file (rows also carry their mesh in row_key)."""
    if tag and not TAG.fullmatch(tag):
        raise ValueError(f"--e2e_tag must be letters, digits, '_', '.' or '-', got {tag!r}")
    if tag:
        return f"e2e_{tag}"
    if mesh:
        return "e2e_mesh-" + mesh.replace(":", "").replace(",", "-")
    return "e2e"


def recorded_shape(path: str) -> BenchShape | None:
    """The shape a benchmark JSON file was written at (files from before --heads: the default shape), or None if
    there is no such file or it cannot be read."""
    try:
        with open(path) as fh:
            meta = json.load(fh).get("meta", {})
    except (OSError, ValueError, AttributeError):
        return None
    fields = {f.name for f in dataclasses.fields(BenchShape)}
    try:
        return BenchShape(**{k: v for k, v in meta.get("shape", {}).items() if k in fields})
    except (TypeError, ValueError, AttributeError):
        return None


def note_overwrite(out_dir: str, stem: str, shape: BenchShape, log=print) -> None:
    """Say (before the run) that <out_dir>/<stem>.* will be overwritten, and at which shape the old one was taken."""
    path = os.path.join(out_dir, stem + ".json")
    if not os.path.exists(path):
        return
    old = recorded_shape(path)
    held = "an unreadable shape" if old is None else f"--heads={old.heads} --num_layers={old.num_layers} " \
                                                      f"--num_anchors={old.num_anchors}"
    same = " (the same shape)" if old == shape else ""
    log(f"note: overwriting {os.path.join(out_dir, stem)}.* at the end of this run; it holds {held}{same}")


def atomic_write(path: str, text: str) -> None:
    folder = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path), suffix=".partial", dir=folder)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_outputs(out_dir: str, stem: str, payload: dict, markdown: str, plot=None, log=print) -> None:
    """<out_dir>/<stem>.json (payload) and <stem>.md, each written atomically, then, if `plot` is given, <stem>.png
    by plot(path); a failing plot is logged (it must never cost the measurements)."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    atomic_write(base + ".json", json.dumps(payload, indent=1))
    atomic_write(base + ".md", markdown)
    if plot is not None:
        try:
            plot(base + ".png")
        except Exception as e:  # noqa: BLE001
            log(f"plot failed: {type(e).__name__}: {e}")


def paged_mask(r: dict) -> str:
    """A paged row's DecodeTuning.paged_mask; rows written before it have paged_mask_k (True or missing: "kv",
    False: "v")."""
    return r.get("paged_mask") or ("kv" if r.get("paged_mask_k", True) else "v")


def _paged_key(r: dict) -> tuple:
    return (r["batch"], r["context"], r["page_size"], r.get("stream_block"), paged_mask(r))


def merge_paged_kernels(old: dict | None, new: dict) -> dict:
    """The paged file's kernels section after run `new`: rows and not_measured entries keyed by (batch, context,
    page_size, stream_block, paged_mask); for a shape the new run measured or failed, only its latest result
    stays (a row or a not_measured entry); the other shapes of earlier runs stay; meta and checks are the new run's."""
    if not old:
        return new
    latest = {_paged_key(r) for r in new.get("rows", []) + new.get("not_measured", [])}
    rows = [r for r in old.get("rows", []) if _paged_key(r) not in latest] + list(new.get("rows", []))
    missing = [x for x in old.get("not_measured", []) if _paged_key(x) not in latest] + list(new.get("not_measured", []))
    order = lambda r: tuple(-1 if v is None else v for v in _paged_key(r))  # noqa: E731
    return dict(new, rows=sorted(rows, key=order), not_measured=sorted(missing, key=order))


# The replay section: one trace, its rows keyed by (strategy, max_prefill_tokens_per_step), so that strategies
# replayed one per command (as a GPU lease needs) accumulate; another trace is refused before it runs.
REPLAY_TRACE = ("model", "num_requests", "arrival_rate", "min_prompt", "max_prompt", "min_new", "max_new", "max_batch",
                "page_size", "num_pages", "seed")


def replay_conflict(old: dict | None, meta: dict) -> str | None:
    """What makes `meta`'s trace another than the stored replay section `old`'s ("field old -> new, ..."), else None."""
    m = (old or {}).get("meta") or {}
    diff = [k for k in REPLAY_TRACE if k in m and k in meta and m[k] != meta[k]]
    return ", ".join(f"{k} {m[k]!r} -> {meta[k]!r}" for k in diff) or None


def merge_replay(old: dict | None, new: dict) -> dict:
    """The replay section after run `new` of the same trace: its rows replace those of the same (strategy,
    max_prefill_tokens_per_step), the others stay, each row keeping the date and command of its own run; meta is the
    new run's. ValueError if the trace differs (the caller checks with `replay_conflict` before replaying)."""
    for r in new.get("rows", []):
        r.setdefault("date", new["meta"].get("date"))
        r.setdefault("command", new["meta"].get("command"))
    if not old or not old.get("rows"):
        return new
    conflict = replay_conflict(old, new["meta"])
    if conflict:
        raise ValueError(f"the stored replay is of another trace ({conflict}); write to another folder")
    key = lambda r: (r.get("strategy"), r.get("max_prefill_tokens_per_step"))  # noqa: E731
    latest = {key(r) for r in new.get("rows", [])}
    kept = [dict(r, date=r.get("date", old["meta"].get("date")), command=r.get("command", old["meta"].get("command")))
            for r in old["rows"] if key(r) not in latest]
    return dict(new, rows=kept + list(new.get("rows", [])))


# ---------------------------------------------------------------------------------------------------------------
# The end-to-end file: rows keyed by (model, metric, context, batch, mesh), one run per strategy
# ---------------------------------------------------------------------------------------------------------------

# strategy -> (kernels, decode_kernel)
STRATEGY_KERNELS = {"dense": ("cudnn", "cudnn"), "kascade": ("pallas", "pallas"), "dense_pallas": ("cudnn", "pallas")}
STRATEGY_NAMES = tuple(STRATEGY_KERNELS)
STRATEGY_FIELDS = ("strategy", "kernels", "decode_kernel")


def row_key(row: dict) -> tuple:
    """(model, metric, context, batch, mesh): rows of another mesh (None = one device) are other rows, so a sharded
    run never overwrites a one-GPU number."""
    return (row["model"], row["metric"], int(row["context"]), int(row["batch"]), row.get("mesh"))


def order(row: dict) -> tuple:
    """Sort key of rows (row_key with None, one device, first)."""
    return row_key(row)[:4] + (row.get("mesh") or "",)


def head_map_kind(head_map) -> str:
    """'identity' (no head map: every layer reuses its anchor's heads as they are) or 'calibrated:<sha1[:12]>' of
    the map, so another calibration is other settings."""
    if head_map is None:
        return "identity"
    text = json.dumps([[int(h) for h in r] for r in head_map])
    return "calibrated:" + hashlib.sha1(text.encode()).hexdigest()[:12]


def run_settings(strategy: str, *, gpu: str, jax_version: str, topk_frac: float, min_k: int, steps, seed: int,
                 kascade_kw: dict, date: str) -> dict:
    """The settings dict stored in every run: the GPU kind, JAX, the Kascade levers (topk_frac, min_k, anchors, head
    map kind, the rest of the recipe), steps, seed, the strategy and its kernels, and the date (never compared)."""
    if strategy not in STRATEGY_KERNELS:
        raise ValueError(f"--e2e_strategies: unknown strategy {strategy!r}; choose from {list(STRATEGY_NAMES)}")
    kernels, decode_kernel = STRATEGY_KERNELS[strategy]
    recipe = {k: v for k, v in sorted(kascade_kw.items()) if k not in ("anchors", "head_map")}
    return dict(gpu=gpu, jax=jax_version, topk_frac=float(topk_frac), min_k=int(min_k),
                steps=[int(n) for n in steps], seed=int(seed), anchors=[int(a) for a in kascade_kw.get("anchors", ())],
                head_map=head_map_kind(kascade_kw.get("head_map")), recipe=json.loads(json.dumps(recipe)),
                strategy=strategy, kernels=kernels, decode_kernel=decode_kernel, date=date)


def settings_diff(a, b, ignore=("date",)) -> list[str]:
    """Fields in which two settings differ (ignoring `ignore`); a missing side differs in everything (['settings'])."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return ["settings"]
    keys = [k for k in dict.fromkeys(list(a) + list(b)) if k not in ignore]
    return [k for k in keys if a.get(k) != b.get(k)]


def summarize(row: dict) -> dict:
    """Fill the summary fields of a row from its runs: dense_s / kascade_s (wall clock), speedup, attention shares,
    kernel-time counterparts, and dense_pallas_* when that run exists. Missing runs give None; so do the ratios of
    runs whose settings differ in more than the strategy and the date (`settings_note` says in what)."""
    runs = row.get("runs", {})

    def get(strategy, field):
        return runs.get(strategy, {}).get(field)

    for s in STRATEGY_NAMES:
        if s in runs or s in ("dense", "kascade"):
            row[f"{s}_s"] = get(s, "wall_s")
            row[f"{s}_kernel_s"] = get(s, "kernel_s")
            row[f"attention_share_{s}"] = get(s, "attention_share")
            row[f"{s}_attention_s"] = get(s, "attention_s")
            row[f"{s}_rest_s"] = get(s, "rest_s")

    notes = []

    def comparable(a, b):
        if a not in runs or b not in runs:
            return True  # nothing to divide: the ratio is None anyway
        diff = settings_diff(runs[a].get("settings"), runs[b].get("settings"), ignore=("date",) + STRATEGY_FIELDS)
        if diff:
            notes.append(f"{a} / {b} not computed: the runs were measured with different settings "
                         f"({', '.join(diff)}); rerun to measure both")
        return not diff

    def ratio(a, b):
        return a / b if a is not None and b else None

    ok = comparable("dense", "kascade")
    row["speedup"] = ratio(row.get("dense_s"), row.get("kascade_s")) if ok else None
    row["kernel_speedup"] = ratio(row.get("dense_kernel_s"), row.get("kascade_kernel_s")) if ok else None
    row["attention_speedup"] = ratio(row.get("dense_attention_s"), row.get("kascade_attention_s")) if ok else None
    if "dense_pallas" in runs:
        ok = comparable("dense_pallas", "kascade")
        row["speedup_vs_dense_pallas"] = ratio(row.get("dense_pallas_s"), row.get("kascade_s")) if ok else None
    if notes:
        row["settings_note"] = "; ".join(notes)
    else:
        row.pop("settings_note", None)
    return row


def _strategy_of(note: str) -> str | None:
    """The strategy a failure note is about ('kascade: out of memory: ...' -> 'kascade'), None for other notes."""
    return next((s for s in STRATEGY_NAMES if str(note).startswith(s + ": ")), None)


def _merge(old: list, new: list) -> list:
    """old then the entries of new not in it (order kept, no duplicates)."""
    out = []
    for n in list(old) + list(new):
        if n not in out:
            out.append(n)
    return out


def add_run(rows: list, base: dict, strategy: str, run: dict) -> dict:
    """Insert or update the row with base's key, setting runs[strategy] = run (replacing that strategy's earlier
    run); returns the row. Notes merge (order kept, no duplicates); this strategy's own earlier failure (a note or
    the row's `skipped` 'strategy: ...') is dropped, any other `skipped` reason moves into the notes."""
    key = row_key(base)
    for row in rows:
        if row_key(row) == key:
            break
    else:
        row = dict(base, runs={})
        rows.append(row)
    notes = list(row.get("notes", []))
    skipped = row.pop("skipped", None)
    if skipped:
        notes.append(skipped)
    row.update({k: v for k, v in base.items() if k not in ("runs", "notes", "skipped")})
    row["notes"] = [n for n in _merge(notes, base.get("notes", [])) if _strategy_of(n) != strategy]
    row.setdefault("runs", {})[strategy] = run
    return summarize(row)


def has_run(rows: list, key: tuple, strategy: str, settings=None) -> bool:
    """Whether the row `key` has a run of `strategy` (with equal settings, the date aside, when settings are given:
    a run of other settings, another GPU or without settings is measured again)."""
    for r in rows:
        if row_key(r) == key and strategy in r.get("runs", {}):
            return settings is None or not settings_diff(r["runs"][strategy].get("settings"), settings)
    return False


def mark_skipped(rows: list, base: dict, reason: str) -> None:
    """Record why (row, strategy) was not measured: a note on a row with runs (replacing that strategy's earlier
    failure note), else the row's `skipped` (another strategy's earlier failure there moves into the notes)."""
    strategy = _strategy_of(reason)
    for row in rows:
        if row_key(row) == row_key(base):
            if row.get("runs"):
                notes = [n for n in row.get("notes", []) if strategy is None or _strategy_of(n) != strategy]
                row["notes"] = _merge(notes, [reason])
            else:
                old = row.get("skipped")
                if old and old != reason and _strategy_of(old) not in (None, strategy):
                    row["notes"] = _merge(row.get("notes", []), [old])
                row["skipped"] = reason
            return
    rows.append(dict(base, skipped=reason))


def load_e2e(out_dir: str, stem: str) -> tuple[dict, list]:
    """(meta, rows) of <out_dir>/<stem>.json ({'runs': [], 'notes': []}, [] when there is none), every row
    summarised again. A file that is not JSON or not an e2e file is a ValueError naming it (never silently an empty
    start that the next save would write over)."""
    path = os.path.join(out_dir, stem + ".json")
    if not os.path.exists(path):
        return {"runs": [], "notes": []}, []
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); move it away (its rows would be lost) or pass "
                         f"--e2e_tag / --e2e_out to write elsewhere") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list) or not all(
            isinstance(r, dict) and {"model", "metric", "context", "batch"} <= set(r) for r in doc["rows"]):
        raise ValueError(f"{path} is not an e2e benchmark file (no 'rows' list of rows); move it away or pass "
                         f"--e2e_tag")
    meta = doc.get("meta") or {}
    meta.setdefault("runs", [])
    meta.setdefault("notes", [])
    for row in doc["rows"]:
        if row.get("runs"):
            summarize(row)
    return meta, doc["rows"]
