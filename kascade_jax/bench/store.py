"""How benchmark runs are stored: output file stems, the JSON + Markdown (+ plot) of a run, and the paged file's
kernels section, merged by shape.

Non-obvious: the untagged kernel-benchmark files (decode.*, prefill.*) hold the default shape only, so any other
shape or layer mix needs a tag; `output_stem` refuses before anything is timed.
"""

from __future__ import annotations

import dataclasses
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


def _paged_key(r: dict) -> tuple:
    return (r["batch"], r["context"], r["page_size"], r.get("stream_block"))


def merge_paged_kernels(old: dict | None, new: dict) -> dict:
    """The paged file's kernels section after run `new`: rows and not_measured entries keyed by (batch, context,
    page_size, stream_block); for a shape the new run measured or failed, only its latest result stays (a row or a
    not_measured entry); the other shapes of earlier runs stay; meta and checks are the new run's."""
    if not old:
        return new
    latest = {_paged_key(r) for r in new.get("rows", []) + new.get("not_measured", [])}
    rows = [r for r in old.get("rows", []) if _paged_key(r) not in latest] + list(new.get("rows", []))
    missing = [x for x in old.get("not_measured", []) if _paged_key(x) not in latest] + list(new.get("not_measured", []))
    order = lambda r: tuple(-1 if v is None else v for v in _paged_key(r))  # noqa: E731
    return dict(new, rows=sorted(rows, key=order), not_measured=sorted(missing, key=order))
