"""Several devices through `jax.sharding`: tensor parallelism over heads and data parallelism over the batch.

One `jax.sharding.Mesh` with the named axes `data` (the batch) and `model` (the heads), built by
`parse_mesh("data:2,model:4")`. `shard_model(model, mesh)` places the parameters and marks the model, and
`init_cache(model, batch, max_len)` creates a KV cache already laid out on the mesh; `generate`, `prefill` and
`decode_step` then run unchanged (everything else is GSPMD inside the same jitted functions).

Layout (`param_spec`, `CACHE_SPEC`):
- q_proj / k_proj / v_proj kernels (and biases) are column-sharded over `model` by heads: shard j holds KV heads
  [j*kv_heads/m, (j+1)*kv_heads/m) and exactly the q heads of their GQA groups (q head i reads KV head i // group,
  so contiguous column blocks line up); o_proj is row-sharded, so its output is one all-reduce over `model`;
- MLP gate_proj / up_proj are column-sharded over `model` and down_proj row-sharded (one more all-reduce); when
  `model` does not divide the ffn width the MLP is replicated instead (slower, never wrong);
- embeddings, lm_head and norms are replicated;
- the KV cache is [batch -> data, kv_heads -> model]: every device holds its sequences' rows of its own heads.

Attention runs per shard: with a mesh, `Attention.__call__` hands the cache write and `strategy.attend` to
`attend_per_shard`, one `jax.shard_map` over (q, k, v, caches, positions, state). Inside it the strategy sees only
its local heads and sequences (so the Pallas kernels do too) and `AttentionInputs.shards` (a `ShardLayout`) says
which mesh axes the batch and the heads are split over; the KV cache is never gathered. The state a strategy
threads from layer to layer leaves each shard_map with the spec the strategy declares through
`strategy.state_spec(layer, phase, shards)`; a strategy without that method cannot run on a mesh (clear error).
Kascade's index state is [batch -> data, idx_heads -> model] and, when a reuse layer's head map reads an index
head of another shard, the anchor all-gathers its indices over `model` once (int32 [batch, kv_heads, k_max] per
anchor layer and step in decode, [batch, kv_heads, tiles, k_max] in prefill: e.g. 8 KV heads, k_max 13107 (10% of
128K) = 419 KB per sequence, against 17 GB of K/V per sequence for the 8B shape); see kascade_jax/strategies.py.

Validation: a mesh whose `model` size does not divide kv_heads (and so q_heads), or whose `data` size does not
divide the batch, is a ValueError naming the numbers. Without a mesh nothing here runs: the model's unsharded path
is the code it always was. Multi-host: call `jax.distributed.initialize()` before anything touches a device (the
entry points do it with `--distributed`, see experiments/devices.py); the mesh then spans every process' devices,
every process runs the same program on the same prompts, and results come back through `to_host` (gathered over
processes). Tested with 2 CPU processes (gloo collectives); not yet on several GPU hosts.

This module deliberately holds no strategy logic and imports no kascade_jax; pipeline parallelism over layers
and sequence parallelism over the cache length are not implemented.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.attention import AttentionInputs, ShardLayout
from models.cache import KVCache, write_chunk, write_token
from models.config import ModelConfig

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


# ---------------------------------------------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------------------------------------------


def parse_mesh(text: str | None, devices=None):
    """'data:2,model:4' (either axis may be left out: size 1) -> a Mesh over the first data*model devices, or None
    for None / '' / 'none'. Sizes must be positive ints whose product does not exceed the device count."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    sizes = {}
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\w+)\s*:\s*(-?\d+)\s*", part)
        if m is None:
            raise ValueError(f"mesh must look like 'data:2,model:4', got {text!r}")
        name, size = m.group(1), int(m.group(2))
        if name not in AXES:
            raise ValueError(f"mesh axis must be one of {AXES}, got {name!r} in {text!r}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} given twice in {text!r}")
        if size < 1:
            raise ValueError(f"mesh axis {name} must have size >= 1, got {size} in {text!r}")
        sizes[name] = size
    return make_mesh(sizes.get(DATA, 1), sizes.get(MODEL, 1), devices=devices)


def make_mesh(data: int, model: int, devices=None):
    """A (data, model) Mesh (GSPMD 'auto' axes) over the first data*model of `devices` (default: all devices)."""
    devices = list(jax.devices() if devices is None else devices)
    if data < 1 or model < 1:
        raise ValueError(f"mesh sizes must be >= 1, got data={data}, model={model}")
    if data * model > len(devices):
        raise ValueError(f"mesh data:{data},model:{model} needs {data * model} devices, but only {len(devices)} "
                         f"are visible ({devices[0].platform})")
    auto = (jax.sharding.AxisType.Auto,) * 2
    return jax.make_mesh((data, model), AXES, axis_types=auto, devices=devices[:data * model])


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None) -> None:
    """jax.distributed.initialize (multi-host; arguments left None come from the environment: SLURM, Open MPI,
    JAX_COORDINATOR_ADDRESS, ...). Must run before anything touches a device. CPU-only processes (JAX_PLATFORMS=cpu)
    get the gloo cross-process collectives, so a multi-process mesh also runs on CPUs (tests)."""
    import os

    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def mesh_sizes(mesh) -> tuple[int, int]:
    return mesh.shape[DATA], mesh.shape[MODEL]


def check_heads(config: ModelConfig, mesh) -> None:
    m = mesh.shape[MODEL]
    if config.kv_heads % m:
        raise ValueError(f"mesh axis model:{m} does not divide the model's kv_heads={config.kv_heads} "
                         f"(q_heads={config.q_heads}); choose a model size that divides {config.kv_heads}")


def check_batch(batch: int, mesh) -> None:
    d = mesh.shape[DATA]
    if batch % d:
        raise ValueError(f"mesh axis data:{d} does not divide the batch of {batch} sequences; use a batch that is "
                         f"a multiple of {d}")


def layout(mesh) -> ShardLayout:
    """The ShardLayout attention sees on this mesh (an axis of size 1 splits nothing and is left out)."""
    d, m = mesh_sizes(mesh)
    return ShardLayout(batch_axis=DATA if d > 1 else None, head_axis=MODEL if m > 1 else None, head_shards=m)


# ---------------------------------------------------------------------------------------------------------------
# Parameters and caches
# ---------------------------------------------------------------------------------------------------------------


def param_spec(path: tuple, shape: tuple, config: ModelConfig, mesh) -> P:
    """PartitionSpec of one parameter, by its NNX path (e.g. ('layers', 3, 'self_attn', 'q_proj', 'kernel'))."""
    names = [str(p) for p in path]
    mod, leaf = (names[-2] if len(names) > 1 else ""), names[-1]
    m = mesh.shape[MODEL]
    if mod in ("q_proj", "k_proj", "v_proj"):
        return P(None, MODEL) if leaf == "kernel" else P(MODEL)
    if mod == "o_proj" and leaf == "kernel":
        return P(MODEL, None)
    if config.ffn % m == 0:
        if mod in ("gate_proj", "up_proj"):
            return P(None, MODEL) if leaf == "kernel" else P(MODEL)
        if mod == "down_proj" and leaf == "kernel":
            return P(MODEL, None)
    return P(*([None] * len(shape)))


def _put(x, sharding):
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # multi-host: every process holds the same full value (it loaded the same checkpoint)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_model(model, mesh):
    """Place `model`'s parameters on `mesh` (layout above) and mark the model so that attention runs per shard.
    Returns the model (changed in place). mesh None: the model is returned as it is."""
    if mesh is None:
        return model
    check_heads(model.config, mesh)
    state = nnx.state(model)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        value = var.get_value()
        var.set_value(_put(value, NamedSharding(mesh, param_spec(path, value.shape, model.config, mesh))))
    nnx.update(model, nnx.from_flat_state(flat))
    model.mesh = mesh
    return model


def model_mesh(model):
    return getattr(model, "mesh", None)


CACHE_SPEC = P(DATA, None, MODEL, None)  # [batch, max_len, kv_heads, head_dim]


def cache_shardings(config: ModelConfig, mesh) -> KVCache:
    kv = NamedSharding(mesh, CACHE_SPEC)
    return KVCache(k=(kv,) * config.num_layers, v=(kv,) * config.num_layers, lengths=NamedSharding(mesh, P(DATA)))


def init_cache(model, batch: int, max_len: int, dtype=None, mesh=None) -> KVCache:
    """An empty KVCache for `model` (a Transformer or a ModelConfig), laid out on `mesh` (default: the model's own,
    see shard_model). Without a mesh this is exactly `KVCache.init`."""
    config = model if isinstance(model, ModelConfig) else model.config
    dtype = (jnp.bfloat16 if isinstance(model, ModelConfig) else model.dtype) if dtype is None else dtype
    mesh = mesh if mesh is not None or isinstance(model, ModelConfig) else model_mesh(model)
    if mesh is None:
        return KVCache.init(config, batch, max_len, dtype=dtype)
    check_heads(config, mesh)
    check_batch(batch, mesh)
    return _cache_maker(config, batch, max_len, jnp.dtype(dtype), mesh)()


@functools.lru_cache(maxsize=32)
def _cache_maker(config, batch, max_len, dtype, mesh):
    """A jitted zeros-maker per cache shape, so that every device only ever allocates its own block."""
    return jax.jit(lambda: KVCache.init(config, batch, max_len, dtype=dtype),
                   out_shardings=cache_shardings(config, mesh))


def to_host(x) -> np.ndarray:
    """np.asarray of an array that may span several processes (gathered over processes first)."""
    if getattr(x, "is_fully_addressable", True) or getattr(x, "is_fully_replicated", False):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# ---------------------------------------------------------------------------------------------------------------
# Attention per shard
# ---------------------------------------------------------------------------------------------------------------


def state_spec(strategy, layer: int, phase: str, shards: ShardLayout):
    """The spec of the state `strategy.attend(layer, ...)` returns; layer -1: the state before layer 0 (None)."""
    if layer < 0:
        return P()
    fn = getattr(strategy, "state_spec", None)
    if fn is None:
        raise ValueError(f"strategy {getattr(strategy, 'name', type(strategy).__name__)!r} does not say how its state "
                         f"is sharded (no state_spec method), so it cannot run on a mesh; run it without --mesh")
    return fn(layer, phase, shards)


def attend_per_shard(mesh, strategy, layer: int, q, k, v, k_cache, v_cache, meta, state):
    """Write this call's k, v into the caches and run `strategy.attend` on every shard's heads and sequences.

    q [batch, T, q_heads, d], k/v [batch, T, kv_heads, d], caches [batch, max_len, kv_heads, d] (global views).
    Returns (out [batch, T, q_heads, d], k_cache, v_cache, state), like the unsharded path of Attention.__call__.
    """
    b = q.shape[0]  # the heads were checked when the model was placed (shard_model -> check_heads)
    check_batch(b, mesh)
    shards = layout(mesh)
    phase = meta["phase"]
    heads, rows = P(DATA, None, MODEL, None), P(DATA)
    spec_in = state_spec(strategy, layer - 1, phase, shards)
    spec_out = state_spec(strategy, layer, phase, shards)
    decode = phase == "decode"
    offset = jnp.zeros((), jnp.int32) if decode else jnp.asarray(meta["offset"], jnp.int32)

    def local(q, k, v, k_cache, v_cache, q_start, kv_len, seq_len, offset, state):
        if decode:
            k_cache, v_cache = write_token(k_cache, k, q_start), write_token(v_cache, v, q_start)
        else:
            k_cache, v_cache = write_chunk(k_cache, k, offset), write_chunk(v_cache, v, offset)
        inputs = AttentionInputs(q=q, k_cache=k_cache, v_cache=v_cache, q_start=q_start, kv_len=kv_len,
                                 seq_len=seq_len, phase=phase, chunk_at_zero=meta["chunk_at_zero"], shards=shards)
        out, state = strategy.attend(layer, inputs, state)
        return out, k_cache, v_cache, state

    seq_len = jnp.broadcast_to(jnp.asarray(meta["seq_len"], jnp.int32), (b,))
    fn = jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, heads, heads, rows, rows, rows, P(), spec_in),
                       out_specs=(heads, heads, heads, spec_out), check_vma=False)
    return fn(q, k, v, k_cache, v_cache, meta["q_start"], meta["kv_len"], seq_len, offset, state)


def describe(mesh) -> str:
    if mesh is None:
        return "single device"
    d, m = mesh_sizes(mesh)
    return f"mesh data:{d},model:{m} over {d * m} {mesh.devices.flat[0].platform} devices"


__all__ = ["DATA", "MODEL", "initialize_distributed", "parse_mesh", "make_mesh", "shard_model", "init_cache",
           "cache_shardings", "param_spec", "attend_per_shard", "layout", "to_host", "check_batch", "check_heads", "describe"]
