"""The models of the end-to-end benchmark and what they need: their specs (shipped HF configs with random weights,
or a real checkpoint through its alias), parameter and KV-cache bytes, the largest batch that fits a device, the
byte floor of a decode step, and building them (random weights, the real model's shipped recipe) and their
strategies, on one device or on a (data, model) mesh.

Non-obvious decisions:
- Random weights are made on the device by one jitted RNG call per parameter, on a mesh directly in
  models/sharding.py's layout, so no device ever holds the whole model.
- Contexts beyond a random model's max_position_embeddings raise that limit for the benchmark (timing only) and
  say so in a note. Memory is per device: weights split over `model`, every sequence's KV split over `model`, a
  batch split over `data`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np

from kascade_jax.bench.store import STRATEGY_NAMES

CONFIG_DIR = Path(__file__).resolve().parents[1] / "data" / "model_configs"
GB = 1e9


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
    ModelSpec("qwen2.5-coder-0.5b", alias="qwen2.5-coder-0.5b"),
)}


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


def build_model(spec: ModelSpec, max_context: int, dtype, seed: int, log=print, mesh=None, recipe: str = "default"):
    """(model, notes, kascade kwargs, max context it may run, its config's own max positions) for a spec, placed on
    `mesh` when given; a real model that does not resolve (or a mesh that does not divide its heads) raises
    ValueError. `recipe` (a `kascade_jax.recipes` name) sets a real model's Kascade; random-weight models keep the
    paper's anchors and no levers."""
    if spec.random:
        orig, _ = load_shape_config(spec)
        cfg, note = load_shape_config(spec, max_context)
        t0 = time.perf_counter()
        model = random_model(cfg, dtype, seed, mesh=mesh)
        log(f"{spec.name}: random weights initialised on the device in {time.perf_counter() - t0:.1f} s")
        return (model, [note] if note else [], dict(anchors=spec.anchors, head_map=None), cfg.max_position_embeddings,
                orig.max_position_embeddings)
    from kascade_jax.calibration.resolve import recipe_kascade
    from models import load_model

    model, _ = load_model(spec.alias, "bfloat16", with_tokenizer=False)
    # The recipe's levers, calibrated anchors and head map (default: the shipped one); never calibrates: without a
    # calibration it raises.
    kw, note = recipe_kascade(spec.alias, model.config.num_layers, model.config.kv_heads, recipe=recipe,
                              dtype="bfloat16", calibrate=False)
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


def device_budget_bytes(mesh=None) -> float:
    """Memory of one device (the first of the mesh): every device of a mesh holds the same share."""
    import jax

    local = [] if mesh is None else [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    dev = local[0] if local else jax.devices()[0]
    stats = dev.memory_stats() or {}
    return float(stats.get("bytes_limit") or 139 * GB * 0.95)


def model_spec(name: str) -> ModelSpec:
    """The ModelSpec of an --e2e_models name."""
    if name not in SPECS:
        raise ValueError(f"--e2e_models: unknown model {name!r}; choose from {sorted(SPECS)}")
    return SPECS[name]
