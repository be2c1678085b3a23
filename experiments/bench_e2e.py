"""End-to-end speed of Kascade inside the model: time to first token and decode ms/step, dense vs Kascade, with the
attention / rest split of every row. `python -m experiments.bench --phase=e2e [--e2e_* flags]`.

Models (`--e2e_models`): `llama3.1-8b-random` and `qwen3-8b-random` are the real HF configs shipped in
kascade_jax/data/model_configs with random bf16 weights (normal, std 0.02; norms 1), initialised on the GPU by one
jitted RNG call per parameter; `qwen2.5-coder-1.5b` is the real model through its alias (skipped, with the reason,
when it does not resolve). Strategies (`--e2e_strategies`): `dense` (DenseStrategy: cuDNN), `kascade`
(KascadeStrategy, kernels="pallas", Top-k `--e2e_topk_frac`; the paper's anchors [0,2,8,13,14] for Llama and
[0,2,7,14,23] for Qwen3 with identity head maps; the shipped calibration and default recipe for the real model) and
optionally `dense_pallas` (DenseStrategy(decode_kernel="pallas"), the split-K Pallas dense decode, decode rows only:
an A/B against cuDNN in the same run).

What is timed (each measured function is the product's own jitted code, traced inside one outer jit):
- TTFT (batch 1): `models.generate._prefill_chunk` over the whole prompt (one chunk, as `prefill` does on a GPU)
  plus the first `sample` (greedy). The KV cache is created inside the measured program (zeros, a ~memset) so the
  donated cache never needs a fresh copy per call. CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`,
  aggregate=False) gives every kernel of one call; wall clock is the mean of the two blocked runs inside the
  measurement (its warm-up and its profiled run), compile excluded (AOT `lower().compile()`).
- Decode step: `models.generate._decode_loop` (greedy, no EOS) run for N1 and N2 steps (`--e2e_steps`, traced, so one
  compilation). The cache is filled with random normal K/V inside the measured program (so it is never donated
  twice, costs no second copy of the cache in memory, and the reused-index layers select from realistic scores);
  that fill and every other per-call cost cancel in per step = (t(N2) - t(N1)) / (N2 - N1), per kernel name for
  CUPTI and for wall clock (min over `--e2e_wall_repeats` blocked calls). The fill costs one RNG pass over the cache
  per call (~0.1 s at 100 GB); it is never in a reported number.
- Attention vs rest: kernel names are classified (`classify`): cuDNN's fused attention (sdpa / flash / fmha / its
  lean_reduction split combine) and the project's Pallas kernels (`kascade_*`: anchor scores, Top-k select, reuse
  decode, prefill kernels, the split-K dense decode) are attention; everything else (GEMMs, the KV-cache scatter,
  norms, RoPE, the small XLA fusions that pad/combine around the Pallas kernels, sampling) is rest. The glue fusions
  around the Pallas kernels therefore count as rest: attention shares are lower bounds for Kascade.
- Largest batch (`context:max` in `--e2e_decode`): (device memory limit - weights - `--e2e_headroom_gb`) // KV bytes
  per sequence; explicit batches that do not fit are recorded as skipped with the bytes they need.
- Byte floor of a decode step: (weights + KV read once) / `--e2e_hbm_tbps` (dense), the issue's definition.

Contexts beyond a random-weight model's max_position_embeddings (Llama-3.1 131072, Qwen3 40960) raise that limit for
the benchmark (timing only; the positions are outside the trained range) and every such row says so.

Budget and resume: results are saved (JSON, Markdown, plot) after every (row, strategy) measurement; a rerun with
the same `--e2e_out`/`--e2e_tag` always starts from the existing file and never drops its other rows. Every run stores
its `settings` (`run_settings`: GPU kind, JAX version, topk_frac, min_k, steps, seed, anchors, head map kind
('identity' or 'calibrated:<hash>'), the rest of the Kascade recipe, the strategy's kernels / decode_kernel, date);
resume skips a (row, strategy) only when its run has equal settings (the date aside), so a run of other settings or
on another GPU is measured again and replaces that strategy's run in the row. `--noe2e_resume` measures every planned
(row, strategy) again (replacing those runs) and keeps every other row. Speedups divide only runs whose settings
agree in everything but the strategy's fields and the date; otherwise they are None and the row's `settings_note`
(shown under "Row notes") says which fields differ. A run without settings (an older file) is kept and
shown until measured again, never resumed or divided by. A row's
notes merge (order kept); a strategy's failure ('kascade: out of memory: ...') is a note on a measured row or the
row's `skipped` reason, and stays (in the notes) when another strategy later succeeds in that row; it is removed
only when that strategy itself succeeds. A decode measurement whose noise exceeds the N2 - N1 difference (t(N2) <=
t(N1)) fails with the numbers (`decode_step_s`) instead of reporting a negative time. A results file that is not
valid JSON is a ValueError naming it (move it away). `--e2e_deadline_s` stops starting measurements predicted to end
past that many seconds since start (predictions are crude: see `estimate_s`), so one device call ends cleanly with
everything it measured saved.

`--e2e_profile` prints (and saves as e2e_profile_<model>_<context>_b<batch>.json) the top-15 kernels of one decode
step at `--e2e_profile_shape=model:context:batch`, for every strategy, with categories (attention, gemm,
cache_write, copy, fusion), to find the non-attention overhead.

Several GPUs (`--mesh=data:D,model:M`, experiments/devices.py; `--distributed` for several hosts): the random-weight
models are created directly in models/sharding.py's layout (`random_model(..., mesh)`: every parameter's jitted RNG
call has its NamedSharding as out_shardings, so no GPU ever holds the whole model; the real model goes through
`shard_model`), and the caches created inside the measured programs get the mesh's KV layout ([batch -> data,
kv_heads -> model]) through `with_sharding_constraint`, so each GPU fills only its block. The measured code is the
product's own: `_prefill_chunk` and `_decode_loop` see `model.mesh` and run attention per shard (shard_map).
Memory is per device: the largest batch is (budget - weights per device - headroom) // (KV per sequence / model),
times data (so a multiple of data; `device_weight_bytes` counts the heads-split weights 1/model, embeddings, lm_head
and norms whole); the byte floor is per device (its weights + its KV, every device reading in parallel). An explicit
decode batch that data does not divide is a ValueError before anything runs; TTFT (batch 1) rows on a mesh with
data > 1 are recorded as skipped (use data:1,model:M for TTFT). Rows record `mesh` ('data:D,model:M', None on one
device) and `devices`; the mesh is part of a row's key (resume never mixes meshes) and, unless `--e2e_tag` is given,
of the file stem: e2e.* on one device, e2e_mesh-data<D>-model<M>.* on a mesh, so one-GPU numbers are never
overwritten. Example, 2 GPUs, heads split in two:
  python -m experiments.bench --phase=e2e --mesh=model:2 --e2e_models=llama3.1-8b-random \
      --e2e_contexts=131072,262144 --e2e_decode=32768:8,32768:32,131072:max   # -> benchmarks/e2e_mesh-data1-model2.*
A mesh of size 1 (`--mesh=data:1,model:1`) runs the sharded code path on one GPU.

Does not: run without a GPU (it refuses), or time host-side tokenisation / detokenisation.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import gc
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from absl import flags

from experiments import cli, devices
from kascade_jax.bench.store import atomic_write

MODELS = flags.DEFINE_list("e2e_models", ["llama3.1-8b-random", "qwen3-8b-random", "qwen2.5-coder-1.5b"],
                           "Models: llama3.1-8b-random, qwen3-8b-random (real configs, random bf16 weights), "
                           "qwen2.5-coder-1.5b (the real model, if its alias resolves).")
METRICS = flags.DEFINE_list("e2e_metrics", ["ttft", "decode"], "Which rows: ttft, decode.")
CONTEXTS = flags.DEFINE_list("e2e_contexts", ["32768", "65536", "131072", "262144"], "TTFT prompt lengths (batch 1).")
DECODE = flags.DEFINE_list("e2e_decode", ["32768:1", "32768:8", "32768:32", "32768:max", "131072:1", "131072:max"],
                           "Decode rows as context:batch; batch 'max' = the largest batch that fits.")
STRATEGIES = flags.DEFINE_list("e2e_strategies", ["dense", "kascade"],
                               "dense (cuDNN), kascade (Pallas), dense_pallas (split-K Pallas dense decode; decode "
                               "rows only).")
STEPS = flags.DEFINE_list("e2e_steps", ["8", "40"], "Decode step counts N1,N2: per step = (t(N2) - t(N1)) / (N2 - N1).")
ITERS = flags.DEFINE_integer("e2e_iterations", 2, "CUPTI iterations per decode measurement (mean per kernel).")
WALL_REPS = flags.DEFINE_integer("e2e_wall_repeats", 2, "Blocked wall-clock calls per decode step count (min).")
TOPK_FRAC = flags.DEFINE_float("e2e_topk_frac", 0.1, "Kascade Top-k fraction.")
MIN_K = flags.DEFINE_integer("e2e_min_k", 128, "Kascade minimum Top-k budget.")
HEADROOM = flags.DEFINE_float("e2e_headroom_gb", 10.0, "Memory left free when choosing the largest batch (GB).")
HBM = flags.DEFINE_float("e2e_hbm_tbps", 4.3, "HBM bandwidth of the byte floor (TB/s).")
OUT = flags.DEFINE_string("e2e_out", "benchmarks", "Output folder for e2e[_<tag>].json/md/png.")
TAG = flags.DEFINE_string("e2e_tag", "", "Output stem suffix: e2e_<tag>.* ('' = e2e.*).")
RESUME = flags.DEFINE_boolean("e2e_resume", True, "Skip (row, strategy) measurements already in the JSON with "
                              "the same settings; --noe2e_resume measures the planned ones again, keeping all other "
                              "rows of the file.")
DEADLINE = flags.DEFINE_float("e2e_deadline_s", 0.0, "Start no measurement predicted to end past this many seconds "
                              "after start (0 = no limit).")
PROFILE = flags.DEFINE_boolean("e2e_profile", False, "Print the top kernels of one decode step at "
                               "--e2e_profile_shape instead of the benchmark.")
PROFILE_SHAPE = flags.DEFINE_string("e2e_profile_shape", "llama3.1-8b-random:131072:1", "model:context:batch.")
SEED = flags.DEFINE_integer("e2e_seed", 0, "Seed of the random weights, prompts and caches.")
COMPILE_THREADS = flags.DEFINE_integer("e2e_compile_threads", 1, "Compile a model's pending programs on this many "
                                       "threads before measuring (saves wall time; XLA's GEMM autotuning then shares "
                                       "the GPU, so choices may differ slightly from a serial compile).")

CONFIG_DIR = Path(__file__).resolve().parents[1] / "kascade_jax" / "data" / "model_configs"
GB = 1e9
TOP_N = 15
STRATEGY_NAMES = ("dense", "kascade", "dense_pallas")
METRIC_NAMES = ("ttft", "decode_step")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A benchmarked model: a shipped HF config with random weights (`config_file`) or a real checkpoint (`alias`)."""

    name: str
    config_file: str | None = None
    alias: str | None = None
    anchors: tuple[int, ...] = ()  # random-weight models: the paper's anchors (identity head map)
    config_dict: dict | None = None  # tests: an inline HF config instead of a file

    @property
    def random(self) -> bool:
        return self.alias is None


SPECS = {s.name: s for s in (
    ModelSpec("llama3.1-8b-random", config_file="llama-3.1-8b.json", anchors=(0, 2, 8, 13, 14)),
    ModelSpec("qwen3-8b-random", config_file="qwen3-8b.json", anchors=(0, 2, 7, 14, 23)),
    ModelSpec("qwen2.5-coder-1.5b", alias="qwen2.5-coder-1.5b"),
)}


# ---------------------------------------------------------------------------------------------------------------
# Pure functions (CPU-tested)
# ---------------------------------------------------------------------------------------------------------------


def load_shape_config(spec: ModelSpec, min_positions: int = 0):
    """(ModelConfig, note | None) from the spec's shipped HF config; max_position_embeddings raised to
    min_positions when smaller (the note says so)."""
    from models.config import ModelConfig

    if spec.config_dict is not None:
        hf = dict(spec.config_dict)
    else:
        path = CONFIG_DIR / str(spec.config_file)
        if not path.is_file():
            raise ValueError(f"model {spec.name!r}: no shipped config at {path}")
        hf = json.loads(path.read_text())
    cfg = ModelConfig.from_hf(hf, name=spec.name)
    note = None
    if min_positions > cfg.max_position_embeddings:
        note = (f"{spec.name}: max_position_embeddings raised from {cfg.max_position_embeddings} to {min_positions} "
                f"for the benchmark (random weights; positions past {cfg.max_position_embeddings} are outside the "
                f"trained range: timing only)")
        cfg = dataclasses.replace(cfg, max_position_embeddings=min_positions)
    return cfg, note


def param_count(cfg) -> int:
    """Parameters of `models.transformer.Transformer(cfg)` (checked against the module in the tests)."""
    h, d, hq, kvh = cfg.hidden, cfg.head_dim, cfg.q_heads, cfg.kv_heads
    attn = h * hq * d + 2 * h * kvh * d + hq * d * h + (hq * d + 2 * kvh * d if cfg.qkv_bias else 0)
    layer = attn + 3 * h * cfg.ffn + 2 * h + (2 * d if cfg.qk_norm else 0)
    return cfg.vocab * h * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * layer + h


def kv_bytes_per_token(cfg, itemsize: int = 2) -> int:
    """K and V bytes of one token over all layers."""
    return 2 * cfg.num_layers * cfg.kv_heads * cfg.head_dim * itemsize


def largest_batch(budget_bytes: float, weight_bytes: float, per_seq_bytes: float, headroom_bytes: float,
                  data: int = 1, model: int = 1) -> int:
    """The most sequences whose KV caches fit beside the weights and the headroom (0 if not even one).

    All sizes are per device except per_seq_bytes (one whole sequence's K/V): on a (data, model) mesh a device holds
    weight_bytes (its slice of the weights, see `device_weight_bytes`), per_seq_bytes / model of every sequence of its
    batch / data sequences. The result is a multiple of `data` (every data shard holds as many sequences)."""
    if per_seq_bytes <= 0:
        raise ValueError(f"per_seq_bytes must be positive, got {per_seq_bytes}")
    if data < 1 or model < 1:
        raise ValueError(f"mesh sizes must be >= 1, got data={data}, model={model}")
    per_shard = max(0, int((budget_bytes - weight_bytes - headroom_bytes) // (per_seq_bytes / model)))
    return per_shard * data


def mesh_name(mesh) -> str | None:
    """'data:D,model:M' of a mesh (what rows record and the md shows), None for one device."""
    if mesh is None:
        return None
    return f"data:{mesh.shape['data']},model:{mesh.shape['model']}"


def mesh_sizes(mesh) -> tuple[int, int]:
    return (1, 1) if mesh is None else (int(mesh.shape["data"]), int(mesh.shape["model"]))


def check_decode_batches(decode_specs, mesh) -> None:
    """Explicit decode batches the mesh's data axis does not divide are refused before anything runs."""
    d, _ = mesh_sizes(mesh)
    bad = [f"{c}:{b}" for c, b in decode_specs if b != "max" and int(b) % d]
    if bad:
        raise ValueError(f"--e2e_decode: mesh axis data:{d} does not divide the batch of {', '.join(bad)}; use batches "
                         f"that are multiples of {d} (or 'max', rounded down to a multiple)")


def device_weight_bytes(cfg, mesh, itemsize: int = 2) -> int:
    """Weight bytes one device holds with models/sharding.py's layout (`param_spec`): parameters split over `model`
    count 1/model; embeddings, lm_head, norms (and the MLP when model does not divide ffn) are whole on every device.
    Without a mesh: every parameter (= param_count * itemsize)."""
    if mesh is None:
        return param_count(cfg) * itemsize
    from models.sharding import MODEL, param_spec

    m = int(mesh.shape[MODEL])
    h, d, hq, kvh = cfg.hidden, cfg.head_dim, cfg.q_heads, cfg.kv_heads
    params = [(("q_proj", "kernel"), (h, hq * d)), (("k_proj", "kernel"), (h, kvh * d)),
              (("v_proj", "kernel"), (h, kvh * d)), (("o_proj", "kernel"), (hq * d, h)),
              (("gate_proj", "kernel"), (h, cfg.ffn)), (("up_proj", "kernel"), (h, cfg.ffn)),
              (("down_proj", "kernel"), (cfg.ffn, h)), (("input_layernorm", "weight"), (h,)),
              (("post_attention_layernorm", "weight"), (h,))]
    if cfg.qkv_bias:
        params += [(("q_proj", "bias"), (hq * d,)), (("k_proj", "bias"), (kvh * d,)), (("v_proj", "bias"), (kvh * d,))]
    if cfg.qk_norm:
        params += [(("q_norm", "weight"), (d,)), (("k_norm", "weight"), (d,))]
    layer = 0
    for path, shape in params:
        n = int(np.prod(shape))
        spec = param_spec(path, shape, cfg, mesh)
        layer += n // m if MODEL in tuple(spec) else n
    whole = cfg.vocab * h * (1 if cfg.tie_embeddings else 2) + h
    return (whole + cfg.num_layers * layer) * itemsize


def byte_floor_s(weight_bytes: float, kv_bytes: float, tbps: float) -> float:
    """Seconds to read the weights and the KV cache once at `tbps` TB/s."""
    return (weight_bytes + kv_bytes) / (tbps * 1e12)


def parse_decode_specs(items) -> list[tuple[int, int | str]]:
    """['32768:1', '131072:max'] -> [(32768, 1), (131072, 'max')]."""
    out = []
    for item in items:
        ctx, sep, b = str(item).strip().partition(":")
        try:
            ctx_i = int(ctx)
            b_v = "max" if b.strip() == "max" else int(b)
        except ValueError:
            raise ValueError(f"--e2e_decode entries are context:batch (batch an int or 'max'), got {item!r}") from None
        if not sep or ctx_i <= 0 or (b_v != "max" and b_v <= 0):
            raise ValueError(f"--e2e_decode entries are context:batch with positive values, got {item!r}")
        out.append((ctx_i, b_v))
    return out


def parse_contexts(items) -> list[int]:
    """['32768', '65536'] -> [32768, 65536]: positive integers, else a ValueError naming --e2e_contexts."""
    out = []
    for item in items:
        try:
            c = int(str(item).strip())
        except ValueError:
            raise ValueError(f"--e2e_contexts: prompt lengths are positive integers, got {item!r}") from None
        if c <= 0:
            raise ValueError(f"--e2e_contexts: prompt lengths are positive integers, got {item!r}")
        out.append(c)
    return out


def parse_steps(items) -> tuple[int, int]:
    items = list(items)
    if len(items) != 2:
        raise ValueError(f"--e2e_steps: must be two integers N1,N2, got {','.join(map(str, items))!r}")
    try:
        n1, n2 = (int(str(x).strip()) for x in items)
    except ValueError:
        bad = next(x for x in items if not str(x).strip().lstrip("-").isdigit())
        raise ValueError(f"--e2e_steps: must be two integers N1,N2, got {bad!r} in "
                         f"{','.join(map(str, items))!r}") from None
    if not 1 <= n1 < n2:
        raise ValueError(f"--e2e_steps: needs 1 <= N1 < N2, got {n1},{n2}")
    return n1, n2


_ATTN_WORDS = ("sdpa", "fmha", "flash_fprop", "flash_fwd", "flash_attn", "lean_reduction")


def classify(name: str) -> str:
    """'attention' (cuDNN fused attention and its split combine, the project's Pallas kernels) or 'rest'."""
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


def row_key(row: dict) -> tuple:
    """(model, metric, context, batch, mesh): rows of another mesh (None = one device, also rows written before
    meshes existed) are other rows, so a sharded run never overwrites a one-GPU number."""
    return (row["model"], row["metric"], int(row["context"]), int(row["batch"]), row.get("mesh"))


def order(row: dict) -> tuple:
    """Sort key of rows (row_key with None, one device, first)."""
    return row_key(row)[:4] + (row.get("mesh") or "",)


def _mesh_cell(row: dict) -> str:
    return f"{row.get('mesh') or 'none'} ({row.get('devices', 1)})"


# Settings of a run: what a measurement depends on besides its row (model, metric, context, batch, mesh). Every run
# stores them; resume re-measures a run whose settings differ (date aside) and speedups divide only runs whose
# settings agree in everything but the strategy's own fields and the date.
STRATEGY_FIELDS = ("strategy", "kernels", "decode_kernel")
_KERNELS = {"dense": ("cudnn", "cudnn"), "dense_pallas": ("cudnn", "pallas"), "kascade": ("pallas", "pallas")}


def head_map_kind(head_map) -> str:
    """'identity' (no head map: every layer reuses its anchor's heads as they are) or 'calibrated:<sha1[:12]>' of
    the map, so another calibration is other settings."""
    if head_map is None:
        return "identity"
    import hashlib

    text = json.dumps([[int(h) for h in r] for r in head_map])
    return "calibrated:" + hashlib.sha1(text.encode()).hexdigest()[:12]


def run_settings(strategy: str, *, gpu: str, jax_version: str, topk_frac: float, min_k: int, steps, seed: int,
                 kascade_kw: dict, date: str) -> dict:
    """The settings dict stored in every run: the GPU kind, JAX, the Kascade levers (topk_frac, min_k, anchors, head
    map kind, the rest of the recipe), steps, seed, the strategy and its kernels, and the date (never compared)."""
    if strategy not in _KERNELS:
        raise ValueError(f"--e2e_strategies: unknown strategy {strategy!r}; choose from {list(STRATEGY_NAMES)}")
    kernels, decode_kernel = _KERNELS[strategy]
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
        diff = settings_diff(runs[a].get("settings"), runs[b].get("settings"),
                             ignore=("date",) + STRATEGY_FIELDS)
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


def estimate_s(metric: str, layers: int, context: int, batch: int, strategy: str, *, weight_bytes: float,
               kv_per_token: float, calls: int = 10, steps: int = 24) -> float:
    """Crude wall-time prediction of one measurement (compile + runs), only to decide what still fits a deadline:
    ~45 s compile per 32 layers; TTFT from the issue's 8B probe (dense 1.28 s at 32K, ~x^1.59; Kascade 0.98 s,
    ~x^1.35), two runs; decode `calls` calls of `steps` steps at 3.5 TB/s (dense) plus the cache fill."""
    scale = layers / 32
    compile_s = 45 * scale
    x = context / 32768
    if metric == "ttft":
        run = (1.28 * x ** 1.59 if strategy != "kascade" else 0.98 * x ** 1.35) * scale
        return compile_s + 2 * run
    kv = batch * context * kv_per_token
    step = (weight_bytes + (kv if strategy != "kascade" else 0.25 * kv)) / 3.5e12
    fill = kv / 1e12
    return compile_s + calls * (steps * step + fill)


def _ms(x):
    return "–" if x is None else f"{1e3 * x:.2f}"


def _s(x):
    return "–" if x is None else f"{x:.3f}"


def _pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def _x(x):
    return "–" if x is None else f"**{x:.2f}x**"


def render_markdown(meta: dict, rows: list) -> str:
    lines = ["# End-to-end speed: dense (cuDNN) vs Kascade in the model", ""]
    for run in meta.get("runs", []):
        where = f"mesh {run['mesh']} over {run.get('devices')} devices" if run.get("mesh") else "one device"
        lines.append(f"- {run.get('date')}: {run.get('gpu')}, JAX {run.get('jax')}, {where}, `{run.get('command')}`")
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


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def save(out_dir: str, stem: str, meta: dict, rows: list, with_plot: bool = True, log=print) -> None:
    """<stem>.json (meta + rows), <stem>.md and <stem>.png, each written atomically."""
    os.makedirs(out_dir, exist_ok=True)
    base = os.path.join(out_dir, stem)
    atomic_write(base + ".json", json.dumps(dict(meta=meta, rows=rows), indent=1))
    atomic_write(base + ".md", render_markdown(meta, rows))
    if with_plot:
        try:
            plot(rows, base + ".png")
        except Exception as e:  # a plot must never cost the measurements
            log(f"plot failed: {type(e).__name__}: {e}")


def load(out_dir: str, stem: str) -> tuple[dict, list]:
    """(meta, rows) of <out_dir>/<stem>.json ({'runs': [], 'notes': []}, [] when there is none). A file that is not
    JSON or not an e2e file is a ValueError naming it (never silently an empty start that the next save would write
    over). Every row is summarised again (so a file of mixed settings shows no speedup it cannot support)."""
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


def output_stem(tag: str, mesh: str | None = None) -> str:
    """e2e_<tag> when a tag is given; else e2e for one device and e2e_mesh-data<D>-model<M> on a mesh, so a sharded
    run never writes into the one-GPU file (rows also carry their mesh in row_key)."""
    from kascade_jax.bench.store import TAG

    if tag and not TAG.fullmatch(tag):
        raise ValueError(f"--e2e_tag must be letters, digits, '_', '.' or '-', got {tag!r}")
    if tag:
        return f"e2e_{tag}"
    if mesh:
        return "e2e_mesh-" + mesh.replace(":", "").replace(",", "-")
    return "e2e"


# ---------------------------------------------------------------------------------------------------------------
# Models and strategies
# ---------------------------------------------------------------------------------------------------------------


def random_model(cfg, dtype, seed: int = 0, mesh=None):
    """Transformer(cfg) with normal(0.02) weights (norm scales 1, biases 0), created on the default device by one
    jitted RNG call per parameter: no host arrays, no per-module default initialisers.

    With a mesh every parameter is created directly in its models/sharding.py layout (the jitted RNG call has that
    out_sharding, so no device ever holds more than its slice) and the model is marked as sharded (`model.mesh`),
    exactly what `shard_model` would give; the values equal the unsharded ones (partitionable threefry)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding

    from models.sharding import check_heads, param_spec
    from models.transformer import Transformer

    if mesh is not None:
        check_heads(cfg, mesh)

    abstract = nnx.eval_shape(lambda: Transformer(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))

    fns = {}  # one jitted RNG per (shape, dtype): a handful of compilations for the whole model

    def make(shape, dt, sharding):
        if (shape, dt, sharding) not in fns:
            fns[(shape, dt, sharding)] = jax.jit(
                lambda key: (0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dt), out_shardings=sharding)
        return fns[(shape, dt, sharding)]

    key = jax.random.key(seed)
    for i, (path, var) in enumerate(sorted(flat.items(), key=lambda kv: str(kv[0]))):
        sd = var.get_value()
        shape, dt = tuple(sd.shape), sd.dtype
        leaf = str(path[-1])
        sharding = None if mesh is None else NamedSharding(mesh, param_spec(path, shape, cfg, mesh))
        if leaf in ("kernel", "embedding"):
            value = make(shape, dt, sharding)(jax.random.fold_in(key, i))
        elif leaf == "weight":  # RMSNorm scales
            value = jnp.ones(shape, dt)
        elif leaf == "bias":
            value = jnp.zeros(shape, dt)
        else:
            raise ValueError(f"random_model: no initialiser for parameter {'/'.join(map(str, path))}")
        if sharding is not None and leaf != "kernel" and leaf != "embedding":
            value = jax.device_put(value, sharding)  # small: norms and biases
        var.set_value(value)
    model = nnx.merge(graphdef, nnx.from_flat_state(flat))
    if mesh is not None:
        model.mesh = mesh  # attention per shard from now on (as models.sharding.shard_model marks it)
    return model


def weight_bytes(model) -> int:
    import jax
    from flax import nnx

    return int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def build_model(spec: ModelSpec, max_context: int, dtype, seed: int, log=print, mesh=None):
    """(model, notes, kascade kwargs, max context it may run, its config's own max positions) for a spec, placed on
    `mesh` when given; a real model that does not resolve (or a mesh that does not divide its heads) raises
    ValueError."""
    if spec.random:
        orig, _ = load_shape_config(spec)
        cfg, note = load_shape_config(spec, max_context)
        t0 = time.perf_counter()
        model = random_model(cfg, dtype, seed, mesh=mesh)
        log(f"{spec.name}: random weights initialised on the device in {time.perf_counter() - t0:.1f} s")
        return (model, [note] if note else [], dict(anchors=spec.anchors, head_map=None), cfg.max_position_embeddings,
                orig.max_position_embeddings)
    from kascade_jax.calibration import recipe_kascade
    from models import load_model

    model, _ = load_model(spec.alias, "bfloat16", with_tokenizer=False)
    # The shipped default recipe (levers, calibrated anchors and head map); never calibrates: without one it raises.
    kw, note = recipe_kascade(spec.alias, model.config.num_layers, model.config.kv_heads, dtype="bfloat16",
                              calibrate=False)
    if mesh is not None:
        from models.sharding import shard_model

        model = shard_model(model, mesh)
    notes = [f"{spec.alias}: real weights (GGUF dequantised to bf16), {note}"]
    return model, notes, kw, model.config.max_position_embeddings, model.config.max_position_embeddings


def make_strategies(names, cfg, kascade_kw: dict, topk_frac: float, min_k: int) -> dict:
    from kascade_jax.registry import make_strategy

    out = {}
    for name in names:
        if name == "dense":
            out[name] = make_strategy("dense", cfg.num_layers, cfg.kv_heads)
        elif name == "dense_pallas":
            out[name] = make_strategy("dense", cfg.num_layers, cfg.kv_heads, decode_kernel="pallas")
        elif name == "kascade":
            out[name] = make_strategy("kascade", cfg.num_layers, cfg.kv_heads, topk_frac=topk_frac, min_k=min_k,
                                      kernels="pallas", **kascade_kw)
        else:
            raise ValueError(f"--e2e_strategies: unknown strategy {name!r}; choose from {list(STRATEGY_NAMES)}")
    return out


# ---------------------------------------------------------------------------------------------------------------
# Measurements (GPU)
# ---------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Prepared:
    """A compiled measurement: the AOT-compiled program, its arguments and how long it took to compile."""

    metric: str
    compiled: object
    args: tuple
    compile_s: float
    steps: tuple[int, int] | None = None


def prepare_ttft(model, strategy, context: int, seed: int) -> Prepared:
    """Compile the TTFT program: `_prefill_chunk` over the whole prompt (cache created inside) + the first sample."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from models import generate as gen
    from models.cache import KVCache
    from models.sharding import cache_shardings, check_batch, model_mesh

    cfg = model.config
    if model_mesh(model) is not None:
        check_batch(1, model_mesh(model))
    graphdef, params = nnx.split(model)

    mesh = model_mesh(model)

    def run(params, tokens):
        cache = KVCache.init(cfg, 1, context, dtype=model.dtype)
        if mesh is not None:  # the mesh's KV layout ([batch -> data, kv_heads -> model]), as sharding.init_cache
            cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cfg, mesh))
        plens = jnp.full((1,), context, jnp.int32)
        logits, cache, _ = gen._prefill_chunk(graphdef, params, tokens, cache, plens, 0, strategy, True, False)
        return gen.sample(logits, jax.random.key(0), 0.0, 1.0, 0), cache

    tokens = jax.random.randint(jax.random.key(seed), (1, context), 0, cfg.vocab, jnp.int32)
    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(params, tokens).compile()
    return Prepared("ttft", compiled, (params, tokens), time.perf_counter() - t0)


def prepare_decode(model, strategy, context: int, batch: int, steps: tuple[int, int], seed: int) -> Prepared:
    """Compile the decode program: random K/V cache filled inside, then `_decode_loop` for a traced step count."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from models import generate as gen
    from models.cache import KVCache
    from models.sharding import CACHE_SPEC, DATA, model_mesh

    cfg = model.config
    mesh = model_mesh(model)
    if mesh is not None:
        from models.sharding import check_batch

        check_batch(batch, mesh)
    n1, n2 = steps
    if n2 >= context:
        raise ValueError(f"decode context {context} must exceed the step count {n2}")
    graphdef, params = nnx.split(model)
    out_w = -(-n2 // gen.OUT_MULTIPLE) * gen.OUT_MULTIPLE
    start = context - n2  # the last step of the longer call writes row context - 1

    def run(params, seed, n):
        key = jax.random.key(seed)
        shape = (batch, context, cfg.kv_heads, cfg.head_dim)
        kv = [jax.random.normal(jax.random.fold_in(key, i), shape, model.dtype) for i in range(2 * cfg.num_layers)]
        lengths = jnp.full((batch,), start, jnp.int32)
        if mesh is not None:  # each device fills only its block of the cache (partitionable RNG)
            kv = [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, CACHE_SPEC)) for x in kv]
            lengths = jax.lax.with_sharding_constraint(lengths, NamedSharding(mesh, P(DATA)))
        cache = KVCache(k=tuple(kv[0::2]), v=tuple(kv[1::2]), lengths=lengths)
        tok = jax.random.randint(jax.random.fold_in(key, 2 * cfg.num_layers), (batch,), 0, cfg.vocab, jnp.int32)
        carry = (cache, tok, jnp.zeros((batch,), bool), jnp.asarray(0, jnp.int32),
                 jnp.full((batch, out_w), -1, jnp.int32))
        carry = gen._decode_loop(graphdef, params, carry, seed, strategy, n, n, 0.0, 1.0, 0, ())
        return carry[4], carry[3]

    s = jnp.int32(seed)
    t0 = time.perf_counter()
    compiled = jax.jit(run).lower(params, s, jnp.int32(n1)).compile()
    return Prepared("decode_step", compiled, (params, s), time.perf_counter() - t0, steps=(n1, n2))


def measure_ttft(prep: Prepared) -> dict:
    """CUPTI over one call of a prepared TTFT program; wall clock = the mean of the measurement's two blocked calls
    (its warm-up and its profiled call)."""
    from jax.experimental.mosaic.gpu import profiler

    t0 = time.perf_counter()
    _, timings = profiler.measure(prep.compiled, aggregate=False, iterations=1)(*prep.args)
    wall = (time.perf_counter() - t0) / 2
    kernels = kernel_table(timings, 1)
    return dict(wall_s=wall, compile_s=prep.compile_s,
                wall_method="mean of the 2 blocked calls inside the CUPTI measurement",
                top=top_kernels(kernels), categories=categories(kernels), **split(kernels))


def measure_decode(prep: Prepared, iterations: int, wall_repeats: int) -> dict:
    """Per-step decode times from calls of N1 and N2 steps (see the module docstring)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.mosaic.gpu import profiler

    n1, n2 = prep.steps
    tables, walls = {}, {}
    for n in (n1, n2):
        out, timings = profiler.measure(prep.compiled, aggregate=False, iterations=iterations)(*prep.args,
                                                                                             jnp.int32(n))
        if int(out[1]) != n:
            raise RuntimeError(f"the decode loop ran {int(out[1])} steps, expected {n}")
        tables[n] = kernel_table(timings, iterations)
    for n in (n1, n2):
        ts = []
        for _ in range(wall_repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(prep.compiled(*prep.args, jnp.int32(n)))
            ts.append(time.perf_counter() - t0)
        walls[n] = min(ts)
    kernels = per_step(tables[n1], tables[n2], n1, n2)
    return dict(wall_s=decode_step_s(walls, kernels, n1, n2), compile_s=prep.compile_s, steps=[n1, n2],
                wall_method=f"(min of {wall_repeats} calls of N2 - of N1) / (N2 - N1)",
                top=top_kernels(kernels), categories=categories(kernels), **split(kernels))


def decode_step_s(walls: dict, kernels: dict, n1: int, n2: int) -> float:
    """Wall seconds per step (t(N2) - t(N1)) / (N2 - N1). When noise exceeds the difference (t(N2) <= t(N1), or no
    positive kernel time per step) this raises a RuntimeError with the numbers: the run is then recorded as failed
    ('<strategy>: RuntimeError: ...' in the row) instead of a negative or zero time; use more steps (--e2e_steps)."""
    step = (walls[n2] - walls[n1]) / (n2 - n1)
    kernel_s = sum(kernels.values())
    if step <= 0 or kernel_s <= 0:
        raise RuntimeError(f"decode per step is not positive: wall t({n2}) = {walls[n2]:.6f} s, t({n1}) = "
                           f"{walls[n1]:.6f} s, per step {step:.3e} s, kernels per step {kernel_s:.3e} s (noise exceeds "
                           f"the N2 - N1 difference: use more steps, --e2e_steps)")
    return step


def prepare_all(jobs: list, threads: int, log=print) -> dict:
    """{job key: Prepared | Exception} for jobs [(key, zero-argument prepare function)], `threads` at a time (XLA
    compiles outside the GIL; autotuning then shares the GPU, so threads > 1 may pick slightly different GEMMs)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        key, fn = job
        try:
            return key, fn()
        except Exception as e:  # reported per job by the caller
            return key, e

    if threads <= 1:
        return dict(one(j) for j in jobs)
    log(f"compiling {len(jobs)} programs on {threads} threads")
    with ThreadPoolExecutor(threads) as pool:
        return dict(pool.map(one, jobs))


def require_gpu():
    import jax

    if jax.default_backend() != "gpu":
        raise ValueError(f"bench --phase=e2e needs a GPU, found backend {jax.default_backend()!r}")


def device_budget_bytes(mesh=None) -> float:
    """Memory of one device (the first of the mesh): every device of a mesh holds the same share."""
    import jax

    local = [] if mesh is None else [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    dev = local[0] if local else jax.devices()[0]
    stats = dev.memory_stats() or {}
    return float(stats.get("bytes_limit") or 139 * GB * 0.95)


# ---------------------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------------------


def plan(metrics, contexts, decode_specs):
    """[(metric, context, batch | 'max')] in the order measured: metrics in the order given, rows in flag order."""
    out = []
    for m in metrics:
        if m == "ttft":
            out += [("ttft", int(c), 1) for c in contexts]
        elif m == "decode":
            out += [("decode_step", c, b) for c, b in decode_specs]
        else:
            raise ValueError(f"--e2e_metrics must be ttft and/or decode, got {m!r}")
    return out


def run(specs, *, metrics, contexts, decode_specs, strategies, steps=(8, 40), iterations=2, wall_repeats=2,
        topk_frac=0.1, min_k=128, headroom_gb=10.0, hbm_tbps=4.3, out_dir="benchmarks", tag="", resume=True,
        deadline_s=0.0, compile_threads=1, seed=0, mesh=None, log=print):
    """Measure every planned (model, row, strategy) not yet in <out_dir>/<output_stem(tag, mesh)>.json, on `mesh`
    (a models.sharding Mesh) or one device (None); returns the rows."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    t_start = time.monotonic()
    mname, (n_data, n_model) = mesh_name(mesh), mesh_sizes(mesh)
    stem = output_stem(tag, mname)
    # bad input first, before the GPU is needed
    check_decode_batches(decode_specs, mesh)
    for s in strategies:
        if s not in STRATEGY_NAMES:
            raise ValueError(f"--e2e_strategies: unknown strategy {s!r}; choose from {list(STRATEGY_NAMES)}")
    todo = plan(metrics, contexts, decode_specs)
    require_gpu()
    # always the existing file: without resume only the planned (row, strategy) runs are measured again
    meta, rows = load(out_dir, stem)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    gpu = jax.devices()[0].device_kind
    meta["runs"].append(dict(date=date, gpu=gpu, jax=jax.__version__, command=" ".join(sys.argv),
                             devices=n_data * n_model, mesh=mname, topk_frac=topk_frac, min_k=min_k,
                             steps=list(steps), seed=seed))
    dtype = jnp.bfloat16
    budget = device_budget_bytes(mesh)
    bar = tqdm(total=len(specs) * len(todo) * len(strategies), desc="e2e", mininterval=1.0, disable=None)
    for spec in specs:
        max_ctx = max([c for m, c, _ in todo] or [0])
        try:
            model, notes, kascade_kw, model_max, orig_max = build_model(spec, max_ctx, dtype, seed, log=log,
                                                                        mesh=mesh)
        except ValueError as e:
            msg = f"{spec.name}: not measured: {e}"
            log(msg)
            if msg not in meta["notes"]:
                meta["notes"].append(msg)
            bar.update(len(todo) * len(strategies))
            continue
        cfg = model.config
        wbytes, kvpt = weight_bytes(model), kv_bytes_per_token(cfg, jnp.dtype(dtype).itemsize)
        wdev = wbytes if mesh is None else device_weight_bytes(cfg, mesh, jnp.dtype(dtype).itemsize)
        shards = n_data * n_model
        log(f"{spec.name}: {wbytes / GB:.2f} GB of weights ({wdev / GB:.2f} GB per device), {kvpt} KV bytes/token, "
            f"device budget {budget / GB:.1f} GB, {mname or 'one device'}")
        strats = make_strategies(strategies, cfg, kascade_kw, topk_frac, min_k)
        settings = {s: run_settings(s, gpu=gpu, jax_version=jax.__version__, topk_frac=topk_frac, min_k=min_k,
                                    steps=steps, seed=seed, kascade_kw=kascade_kw, date=date) for s in strategies}
        jobs = []  # (key, strategy, base row, row notes, predicted seconds) still to measure
        for metric, ctx, b in todo:
            if b == "max":
                b = largest_batch(budget, wdev, ctx * kvpt, headroom_gb * GB, n_data, n_model)
            kv_dev = int(b) * ctx * kvpt / shards  # every device: batch / data sequences, kv_heads / model heads
            base = dict(model=spec.name, metric=metric, context=ctx, batch=int(b), mesh=mname, devices=shards,
                        weight_bytes=wbytes, kv_bytes=int(b) * ctx * kvpt)
            if mesh is not None:
                base["device_weight_bytes"] = wdev
            row_notes = notes if (not spec.random or ctx > orig_max) else []
            if metric == "decode_step":
                base["floor_s"] = byte_floor_s(wdev, kv_dev, hbm_tbps)  # per device: they all read in parallel
            need = wdev + kv_dev + headroom_gb * GB
            reason = None
            if ctx > model_max:
                reason = f"context {ctx} beyond the model's {model_max} max positions"
            elif int(b) % n_data:  # only TTFT's batch 1 (explicit decode batches were checked above)
                reason = f"batch {b} does not split over the mesh's data:{n_data} (use data:1 for TTFT)"
            elif b == 0 or need > budget:
                reason = (f"does not fit {'one device' if mesh is None else 'the devices of ' + mname}: weights "
                          f"{wdev / GB:.1f} GB + KV {kv_dev / GB:.1f} GB + headroom {headroom_gb:.0f} GB > "
                          f"{budget / GB:.1f} GB per device")
            for sname in strategies:
                bar.update(1)
                if metric == "ttft" and sname == "dense_pallas":
                    continue  # prefill never uses the decode kernel
                key = (spec.name, metric, ctx, int(b), mname)
                if reason:
                    _mark_skipped(rows, base, reason)
                elif not (resume and has_run(rows, key, sname, settings[sname])):
                    est = estimate_s(metric, cfg.num_layers, ctx, int(b) // shards or 1, sname, weight_bytes=wdev,
                                     kv_per_token=kvpt)
                    jobs.append((key, sname, base, row_notes, est))
        save(out_dir, stem, meta, rows, log=log)

        def prepare(job):
            (_, metric, ctx, b, _), sname = job[0], job[1]
            if metric == "ttft":
                return prepare_ttft(model, strats[sname], ctx, seed)
            return prepare_decode(model, strats[sname], ctx, b, steps, seed)

        prepared = {}
        threads = max(1, compile_threads)
        for i, job in enumerate(jobs):
            if threads > 1 and i % threads == 0:
                # compile the next `threads` jobs together (those the deadline leaves room for), then measure them
                # one by one: compiles (and their GEMM autotuning) never overlap a measurement
                used, batch = time.monotonic() - t_start, []
                for j in jobs[i:i + threads]:
                    used += j[4] / threads
                    if not deadline_s or used <= deadline_s:
                        batch.append(j)
                prepared = prepare_all([((j[0], j[1]), functools.partial(prepare, j)) for j in batch], threads,
                                       log=log)
            key, sname, base, row_notes, est = job
            metric = key[1]
            elapsed = time.monotonic() - t_start
            if (key, sname) in prepared:
                est = max(1.0, est - 45 * cfg.num_layers / 32)  # compiled already
            if deadline_s and elapsed + est > deadline_s:
                log(f"deferred {key} {sname}: predicted {est:.0f} s, {elapsed:.0f} s used of {deadline_s:.0f} s "
                    f"(rerun to resume)")
                prepared.pop((key, sname), None)
                continue
            t0 = time.monotonic()
            try:
                prep = prepared.pop((key, sname), None) or prepare(job)
                if isinstance(prep, Exception):
                    raise prep
                res = measure_ttft(prep) if metric == "ttft" else measure_decode(prep, iterations, wall_repeats)
                del prep
            except Exception as e:  # keep the sweep going; the failure is reported and saved
                msg = f"{type(e).__name__}: {str(e)[:500]}"
                if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                    msg = "out of memory: " + msg
                log(f"FAILED {key} {sname}: {msg}")
                gc.collect()
                _mark_skipped(rows, base, f"{sname}: {msg}")
                save(out_dir, stem, meta, rows, log=log)
                continue
            res["measure_s"] = time.monotonic() - t0
            res["settings"] = settings[sname]
            row = add_run(rows, dict(base, notes=row_notes), sname, res)
            unit, u = (1e3, "ms") if metric == "decode_step" else (1.0, "s")
            log(f"{spec.name} {metric} ctx={key[2]} b={key[3]} {sname}: wall {res['wall_s'] * unit:.3f} {u}, kernels "
                f"{res['kernel_s'] * unit:.3f} (attention {res['attention_s'] * unit:.3f}, rest "
                f"{res['rest_s'] * unit:.3f}), compile {res['compile_s']:.0f} s, took {res['measure_s']:.0f} s"
                + (f"; speedup {row['speedup']:.2f}x" if row.get("speedup") else ""))
            save(out_dir, stem, meta, rows, log=log)
        prepared.clear()
        model = strats = None  # frees the weights before the next model
        gc.collect()
        jax.clear_caches()
    bar.close()
    save(out_dir, stem, meta, rows, log=log)
    log(f"done in {time.monotonic() - t_start:.0f} s; wrote {os.path.join(out_dir, stem)}.json/.md/.png")
    return rows


def _mark_skipped(rows, base, reason):
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


def profile(spec: ModelSpec, context: int, batch, strategies, *, steps=(8, 40), iterations=2, topk_frac=0.1,
            min_k=128, headroom_gb=10.0, hbm_tbps=4.3, out_dir="benchmarks", seed=0, mesh=None, log=print) -> dict:
    """Top kernels of one decode step per strategy, printed and saved as e2e_profile_<model>_<ctx>_b<batch>.json."""
    import jax
    import jax.numpy as jnp

    require_gpu()
    mname, (n_data, n_model) = mesh_name(mesh), mesh_sizes(mesh)
    if batch != "max":
        check_decode_batches([(context, batch)], mesh)
    model, notes, kascade_kw, _, _ = build_model(spec, context, jnp.bfloat16, seed, log=log, mesh=mesh)
    cfg = model.config
    wbytes, kvpt = weight_bytes(model), kv_bytes_per_token(cfg)
    wdev = wbytes if mesh is None else device_weight_bytes(cfg, mesh)
    if batch == "max":
        batch = largest_batch(device_budget_bytes(mesh), wdev, context * kvpt, headroom_gb * GB, n_data, n_model)
    floor = byte_floor_s(wdev, batch * context * kvpt / (n_data * n_model), hbm_tbps)
    log(f"{spec.name} decode ctx={context} b={batch}: byte floor {1e3 * floor:.2f} ms (weights {wbytes / GB:.2f} GB, "
        f"KV {batch * context * kvpt / GB:.2f} GB at {hbm_tbps} TB/s)")
    result = dict(model=spec.name, context=context, batch=batch, mesh=mname, devices=n_data * n_model, floor_s=floor,
                  notes=notes, strategies={},
                  gpu=jax.devices()[0].device_kind, jax=jax.__version__)
    for sname, strategy in make_strategies(strategies, cfg, kascade_kw, topk_frac, min_k).items():
        res = measure_decode(prepare_decode(model, strategy, context, batch, steps, seed), iterations, 1)
        result["strategies"][sname] = res
        log(f"\n{sname}: wall {1e3 * res['wall_s']:.3f} ms/step, kernels {1e3 * res['kernel_s']:.3f} "
            f"(attention {1e3 * res['attention_s']:.3f}, rest {1e3 * res['rest_s']:.3f}); by category: "
            + ", ".join(f"{c} {1e3 * t:.3f}" for c, t in sorted(res["categories"].items(), key=lambda kv: -kv[1])))
        for name, t, cat in res["top"]:
            log(f"  {1e3 * t:8.4f} ms  {cat:11s} {name[:110]}")
    os.makedirs(out_dir, exist_ok=True)
    suffix = "" if mname is None else "_" + output_stem("", mname)[len("e2e_"):]
    path = os.path.join(out_dir, f"e2e_profile_{spec.name}_{context}_b{batch}{suffix}.json")
    atomic_write(path, json.dumps(result, indent=1))
    log(f"wrote {path}")
    return result


def _spec(name: str) -> ModelSpec:
    if name not in SPECS:
        raise ValueError(f"--e2e_models: unknown model {name!r}; choose from {sorted(SPECS)}")
    return SPECS[name]


def main(argv):
    del argv
    # One process, one GPU: let JAX take most of the memory (the largest-batch rows need it), unless told otherwise.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    # every flag value is checked before the devices are touched
    steps = parse_steps(STEPS.value)
    for s in STRATEGIES.value:
        if s not in STRATEGY_NAMES:
            raise ValueError(f"--e2e_strategies: unknown strategy {s!r}; choose from {list(STRATEGY_NAMES)}")
    if not PROFILE.value:
        specs = [_spec(m) for m in MODELS.value]
        contexts, decode_specs = parse_contexts(CONTEXTS.value), parse_decode_specs(DECODE.value)
        plan(METRICS.value, contexts, decode_specs)  # --e2e_metrics
    mesh = devices.setup()  # --mesh / --distributed (experiments/devices.py); None: one device
    kw = dict(steps=steps, iterations=ITERS.value, topk_frac=TOPK_FRAC.value, min_k=MIN_K.value,
              headroom_gb=HEADROOM.value, hbm_tbps=HBM.value, out_dir=OUT.value, seed=SEED.value, mesh=mesh)
    if PROFILE.value:
        parts = PROFILE_SHAPE.value.split(":")
        if len(parts) != 3:
            raise ValueError(f"--e2e_profile_shape must be model:context:batch, got {PROFILE_SHAPE.value!r}")
        (ctx, b), = parse_decode_specs([f"{parts[1]}:{parts[2]}"])
        profile(_spec(parts[0]), ctx, b, STRATEGIES.value, **kw)
        return
    run(specs, metrics=METRICS.value, contexts=contexts, decode_specs=decode_specs, strategies=STRATEGIES.value,
        wall_repeats=WALL_REPS.value, tag=TAG.value, resume=RESUME.value, deadline_s=DEADLINE.value,
        compile_threads=COMPILE_THREADS.value, **kw)


if __name__ == "__main__":
    cli.run(main)
