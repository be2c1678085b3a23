"""What the decode and prefill benchmarks share: CUPTI kernel timing (device time only, no Python dispatch), the
attention shape and layer mix they time (`--heads`, `--num_layers`, `--num_anchors`), and their output files
(`--bench_tag`).

Does not: time anything itself, or know which kernels a benchmark runs (bench_decode.py, bench_prefill.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics

from absl import flags

HEADS = flags.DEFINE_list("heads", ["32", "8", "128"], "Attention shape timed and checked: q_heads,kv_heads,head_dim "
                          "(Llama-3.1-8B 32,8,128; Qwen2.5-Coder-0.5B 14,2,64; Qwen2.5-Coder-1.5B 12,2,128).")
# allow_override: the same concept as the model entry points' --num_layers / --num_anchors, so a process (e.g. a
# test session) that imports both keeps working instead of raising DuplicateFlagError.
NUM_LAYERS = flags.DEFINE_integer("num_layers", 32, "Layers L of the weighted Kascade time "
                                  "(1*A0 + (M-1)*A + (L-M)*R)/L.", allow_override=True)
NUM_ANCHORS = flags.DEFINE_integer("num_anchors", 5, "Anchor layers M (layer 0 included) of the weighted Kascade "
                                   "time.", allow_override=True)
BENCH_TAG = flags.DEFINE_string("bench_tag", "", "Output file stem suffix: decode_<tag>.md/json/png, "
                                "prefill_<tag>.*, prefill_sweep_<tag>.* ('' = decode.* etc., which hold only the "
                                "default shape 32,8,128 with 32 layers and 5 anchors).")

# (q_heads, kv_heads, head_dim, num_layers) -> model, named in the tables' headers.
_MODELS = {(32, 8, 128, 32): "Llama-3.1-8B", (14, 2, 64, 24): "Qwen2.5-Coder-0.5B",
           (12, 2, 128, 28): "Qwen2.5-Coder-1.5B"}
_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class BenchShape:
    """The attention shape a benchmark times and the layer mix that weights its A0 / A / R times: layer 0 is an
    anchor that also computes the dense output (A0), num_anchors - 1 further anchors (A), the rest reuse (R)."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    num_layers: int = 32
    num_anchors: int = 5

    def __post_init__(self):
        for name in ("q_heads", "kv_heads", "head_dim", "num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"q_heads ({self.q_heads}) must be a multiple of kv_heads ({self.kv_heads})")
        m = self.num_anchors
        if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= self.num_layers:
            raise ValueError(f"num_anchors must be an int in [1, num_layers={self.num_layers}], got {m!r}")

    @classmethod
    def parse(cls, heads, num_layers: int = 32, num_anchors: int = 5) -> "BenchShape":
        """heads: 'Q,KV,D' or its list of three items (as --heads gives it)."""
        items = heads.split(",") if isinstance(heads, str) else list(heads)
        try:
            q, kv, d = (int(str(x).strip()) for x in items)
        except ValueError:
            raise ValueError(f"--heads must be q_heads,kv_heads,head_dim (three integers, e.g. 14,2,64), "
                             f"got {','.join(map(str, items))!r}") from None
        return cls(q, kv, d, num_layers, num_anchors)

    @classmethod
    def from_flags(cls) -> "BenchShape":
        return cls.parse(HEADS.value, NUM_LAYERS.value, NUM_ANCHORS.value)

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads

    @property
    def heads(self) -> str:
        """The --heads value of this shape."""
        return f"{self.q_heads},{self.kv_heads},{self.head_dim}"

    def weighted(self, a0: float, a: float, r: float) -> float:
        """Kascade attention time averaged over the layers: (1*A0 + (M-1)*A + (L-M)*R) / L."""
        m, n = self.num_anchors, self.num_layers
        return (a0 + (m - 1) * a + (n - m) * r) / n

    def formula(self) -> str:
        m, n = self.num_anchors, self.num_layers
        return f"(1*A0 + {m - 1}*A + {n - m}*R)/{n}"

    def heads_text(self) -> str:
        return f"{self.q_heads} q heads, {self.kv_heads} kv heads, d {self.head_dim}"

    def mix_text(self) -> str:
        model = _MODELS.get((self.q_heads, self.kv_heads, self.head_dim, self.num_layers))
        mix = f"{self.num_layers} layers, {self.num_anchors} anchors"
        return f"{model}: {mix}" if model else mix

    def record(self) -> dict:
        """The fields written into every JSON row and the meta block."""
        return dataclasses.asdict(self)


def cupti_time(fn, args, iters: int):
    """(median total kernel ms per call, {kernel name: mean ms per call}); several launches of one name add up."""
    from jax.experimental.mosaic.gpu import profiler

    _, timings = profiler.measure(fn, aggregate=False, iterations=iters)(*args)
    totals = [sum(t for _, t in it) for it in timings]
    per: dict[str, list[float]] = {}
    for it in timings:
        for name, t in it:
            per.setdefault(name, []).append(t)
    return statistics.median(totals), {name: sum(ts) / len(timings) for name, ts in per.items()}


def output_stem(name: str, tag: str, shape: BenchShape) -> str:
    """The file stem of benchmark `name` ('decode', 'prefill', 'prefill_sweep'): name, or name_<tag>.

    The untagged files hold the default shape only, so a run at any other shape or layer mix needs a tag; this is
    checked before anything is timed."""
    if tag:
        if not _TAG.fullmatch(tag):
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


def write_outputs(out_dir: str, stem: str, payload: dict, markdown: str, plot=None) -> None:
    """<out_dir>/<stem>.json (payload), <stem>.md and, if `plot` is given, <stem>.png written by plot(path)."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    with open(base + ".json", "w") as fh:
        json.dump(payload, fh, indent=1)
    with open(base + ".md", "w") as fh:
        fh.write(markdown)
    if plot is not None:
        plot(base + ".png")
