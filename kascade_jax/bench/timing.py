"""What the benchmarks time: CUPTI kernel time (device time only, no Python dispatch), the attention shape and layer
mix of the kernel benchmarks (`BenchShape`), and the per-kernel tables of the end-to-end benchmark.

Non-obvious: attention vs rest is decided by kernel name (`classify`). cuDNN's fused attention and the project's
Pallas kernels (`kascade_*`) are attention; the small XLA fusions that pad and combine around the Pallas kernels are
rest, so Kascade's attention shares are lower bounds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import sys

# (q_heads, kv_heads, head_dim, num_layers) -> model, named in the tables' headers.
MODEL_NAMES = {(32, 8, 128, 32): "Llama-3.1-8B", (14, 2, 64, 24): "Qwen2.5-Coder-0.5B",
               (12, 2, 128, 28): "Qwen2.5-Coder-1.5B"}
TOP_N = 15


def xla_flags() -> str:
    """The XLA_FLAGS this process runs under ('' if none), for a run's record. In-model timings depend on them:
    `--xla_gpu_autotune_level=0` (the accuracy runner's setting, which saves compile time) leaves the weights' GEMMs
    on untuned configurations, about 3x slower at decode batch 6 on the H200 (session 29)."""
    return os.environ.get("XLA_FLAGS", "").strip()


def untuned_gemm_warning() -> str | None:
    """A one-line warning when XLA's autotuning is off (GEMM times then are not what users get), else None."""
    if re.search(r"--xla_gpu_autotune_level=0\b", xla_flags()):
        return ("warning: XLA_FLAGS turns GEMM autotuning off (--xla_gpu_autotune_level=0): the weights' GEMMs run "
                "untuned, so in-model times overstate everything but attention; unset it for timings to report")
    return None


def xla_flags_record() -> dict:
    """For a timed run's metadata: {"xla_flags": ...} when XLA_FLAGS is set (else {}), after printing
    `untuned_gemm_warning` to stderr when it applies."""
    if (warning := untuned_gemm_warning()) is not None:
        print(warning, file=sys.stderr, flush=True)
    return {"xla_flags": xla_flags()} if xla_flags() else {}


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
        model = MODEL_NAMES.get((self.q_heads, self.kv_heads, self.head_dim, self.num_layers))
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


def time_pieces(row: dict, pieces, iters: int, shape: BenchShape) -> dict:
    """Time each (name, fn, args) of `pieces` (dense, A0, A, R) into row[name] (median ms) and row[name_kernels];
    then the ratios to dense, the weighted Kascade time and its speedup. Returns the row."""
    for name, fn, args in pieces:
        row[name], row[name + "_kernels"] = cupti_time(fn, args, iters)
    for name in ("A0", "A", "R"):
        row[name + "/dense"] = row[name] / row["dense"]
    row["weighted"] = shape.weighted(row["A0"], row["A"], row["R"])
    row["speedup"] = row["dense"] / row["weighted"]
    return row


def kernel_table(timings, iterations: int) -> dict[str, float]:
    """CUPTI per-kernel timings (ms; one list of (name, ms) or `iterations` of them) -> {name: mean seconds per call},
    several launches of one name summed."""
    if timings is None:
        return {}
    its = [timings] if iterations == 1 else list(timings)
    table: dict[str, float] = {}
    for it in its:
        for name, ms in it:
            table[name] = table.get(name, 0.0) + ms / 1e3 / len(its)
    return table


def per_step(k1: dict, k2: dict, n1: int, n2: int) -> dict[str, float]:
    """Per-kernel seconds per step from two calls of n1 and n2 steps (what runs once per call cancels)."""
    return {name: (k2.get(name, 0.0) - k1.get(name, 0.0)) / (n2 - n1) for name in set(k1) | set(k2)}


# "_mosaic_gpu": JAX 0.11.2 names a Pallas Mosaic GPU kernel after its body function, <body>_mosaic_gpu_kernel
# (pallas_call's name is dropped). The project's are kascade_prefill_{lse,scores,reuse}_mgpu_...; runs before
# 2026-12-06 show entry_ / kernel_mosaic_gpu_kernel. XLA emits no Mosaic GPU kernels, so any is attention.
_ATTN_WORDS = ("sdpa", "fmha", "flash_fprop", "flash_fwd", "flash_attn", "lean_reduction", "_mosaic_gpu")


def classify(name: str) -> str:
    """'attention' (cuDNN fused attention and its split combine, the project's Pallas kernels, Triton and Mosaic
    GPU) or 'rest'."""
    n = name.lower()
    if n.startswith("kascade_") or any(w in n for w in _ATTN_WORDS):
        return "attention"
    return "rest"


def category(name: str) -> str:
    """Finer class for the profile: attention, gemm, cache_write, copy or fusion (any other kernel)."""
    if classify(name) == "attention":
        return "attention"
    n = name.lower()
    if any(w in n for w in ("gemm", "gemv", "cublas", "cutlass", "nvjet", "xmma", "matmul", "dot_", "triton_gemm")):
        return "gemm"
    if "scatter" in n or "dynamic_update_slice" in n or "dynamic-update-slice" in n:
        return "cache_write"
    if "copy" in n or "memcpy" in n or "memset" in n:
        return "copy"
    return "fusion"


def split(kernels: dict) -> dict:
    """attention_s, rest_s, kernel_s (their sum) and attention_share of a {name: seconds} table."""
    att = sum(t for n, t in kernels.items() if classify(n) == "attention")
    rest = sum(t for n, t in kernels.items() if classify(n) != "attention")
    total = att + rest
    return dict(attention_s=att, rest_s=rest, kernel_s=total, attention_share=att / total if total > 0 else None)


def categories(kernels: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for n, t in kernels.items():
        out[category(n)] = out.get(category(n), 0.0) + t
    return out


def top_kernels(kernels: dict, n: int = TOP_N) -> list:
    """[[name, seconds, category], ...] of the n largest entries."""
    items = sorted(kernels.items(), key=lambda kv: -kv[1])[:n]
    return [[name, t, category(name)] for name, t in items]
