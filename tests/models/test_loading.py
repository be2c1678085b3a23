from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from models import load_model
from models.checkpoint import load_checkpoint
from models.config import ModelConfig
from models.loading import parse_dtype
from models.params import from_tensors

TINY = Path(__file__).resolve().parents[1] / "golden" / "tiny_llama"


def test_orbax_param_cache_round_trip(tmp_path):
    a, _ = load_model(str(TINY), "float32", cache_dir=str(tmp_path), with_tokenizer=False)
    assert any(tmp_path.iterdir()), "converted parameters were not cached"
    b, _ = load_model(str(TINY), "float32", cache_dir=str(tmp_path), with_tokenizer=False)
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_bf16_load_and_errors():
    m, _ = load_model(str(TINY), "bfloat16", with_tokenizer=False)
    assert m.layers[0].self_attn.q_proj.kernel[...].dtype == np.dtype("bfloat16")
    with pytest.raises(ValueError, match="unsupported dtype"):
        parse_dtype("int8")
    ckpt = load_checkpoint(TINY)
    cfg = ModelConfig.from_hf(ckpt.config)
    tensors = {k: ckpt.tensors[k] for k in ckpt.tensors if "layers.1.mlp.up_proj" not in k}
    with pytest.raises(ValueError, match="missing tensor"):
        from_tensors(cfg, tensors)
    tensors = dict(ckpt.tensors.items())
    tensors["model.layers.0.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match="has shape"):
        from_tensors(cfg, tensors)
    tensors = dict(ckpt.tensors.items())
    tensors["model.layers.7.extra.weight"] = np.ones((3,), np.float32)
    with pytest.raises(ValueError, match="does not use"):
        from_tensors(cfg, tensors)
