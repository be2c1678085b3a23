"""HF-named checkpoint tensors -> `Transformer` parameters.

The model is first built abstractly (`nnx.eval_shape`, no random init of 100M+ parameters), then every parameter is
filled from the checkpoint by its HF name; linear weights are transposed from HF's (out, in) to (in, out). A tensor
that is missing, left over or of the wrong shape is an error, never a silently random weight.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.transformer import Transformer


def hf_name(path: tuple) -> tuple[str, bool]:
    """NNX state path -> (HF tensor name, transpose?)."""
    parts = [str(p) for p in path]
    leaf = parts[-1]
    mod = ".".join(parts[:-1])
    if mod == "embed_tokens":
        return "model.embed_tokens.weight", False
    if mod == "lm_head":
        return "lm_head.weight", True
    if leaf == "kernel":
        return f"model.{mod}.weight", True
    return f"model.{mod}.{leaf}", False


def _fetch(tensors, name):
    t = tensors[name]
    return np.asarray(t() if callable(t) else t)


def from_tensors(config: ModelConfig, tensors, *, dtype=jnp.float32) -> Transformer:
    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    names = set(tensors.keys())
    used = set()
    for path, var in flat.items():
        name, transpose = hf_name(path)
        if name not in names:
            raise ValueError(f"checkpoint is missing tensor {name!r} (needed for parameter {'/'.join(map(str, path))})")
        arr = _fetch(tensors, name)
        if transpose:
            arr = arr.T
        want = tuple(var.get_value().shape)
        if tuple(arr.shape) != want:
            raise ValueError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected {want if not transpose else want[::-1]}")
        var.set_value(jnp.asarray(arr, dtype=var.get_value().dtype))
        used.add(name)
    extra = sorted(n for n in names - used if not (config.tie_embeddings and n == "lm_head.weight")
                   and "rotary_emb" not in n)
    if extra:
        raise ValueError(f"checkpoint has {len(extra)} tensors the {config.model_type} model does not use, e.g. {extra[:3]}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def random_model(config: ModelConfig, *, seed: int = 0, dtype=jnp.float32) -> Transformer:
    """A randomly initialised model (tests, benchmarks)."""
    return Transformer(config, dtype=dtype, rngs=nnx.Rngs(seed))
