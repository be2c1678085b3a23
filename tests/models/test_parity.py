"""Parity with HF transformers (PyTorch, CPU, fp32) on committed golden files.

The goldens come from tests/golden/make_goldens.py, run in a separate Python 3.11 venv with torch + transformers
(see tests/golden/README.md); they are committed so CI needs no torch.
"""

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from models import generate as gen
from models.attention import DenseStrategy
from models.cache import KVCache
from models.checkpoint import load_checkpoint
from models.config import ModelConfig
from models.params import from_tensors

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_llama_sharded", "tiny_qwen2", "tiny_qwen3"])
def test_logits_match_transformers(name):
    ckpt = load_checkpoint(GOLDEN / name)
    cfg = ModelConfig.from_hf(ckpt.config)
    model = from_tensors(cfg, ckpt.tensors)
    gold = np.load(GOLDEN / name.replace("_sharded", "") / "golden.npz")
    ids = gold["input_ids"]
    cache = KVCache.init(cfg, ids.shape[0], 64, jnp.float32)
    logits, _, _ = gen.forward(model, ids, cache, DenseStrategy())
    diff = float(np.abs(np.asarray(logits) - gold["logits"]).max())
    print(f"{name}: max |logits - HF| = {diff:.2e} (logit scale {np.abs(gold['logits']).max():.1f})")
    assert diff <= 1e-4


def test_smollm2_greedy_matches_transformers_gguf_loader(smollm2):
    model, tok = smollm2
    gold = json.loads((GOLDEN / "smollm2_generate.json").read_text())
    prompts = [g["input_ids"] for g in gold["generations"]]
    res = gen.generate(model, tok, prompts, DenseStrategy(), max_new_tokens=gold["max_new_tokens"])
    for g, r in zip(gold["generations"], res):
        expect = [t for t in g["output_ids"] if t not in tok.eos_token_ids]
        assert r.token_ids == expect, g["prompt"]
        print(g["prompt"], "->", r.text)
    fox = gold["fox"]
    cache = KVCache.init(model.config, 1, 64, jnp.float32)
    logits, _, _ = gen.forward(model, np.array([fox["input_ids"]]), cache, DenseStrategy())
    head = fox["last_logits_head"]
    np.testing.assert_allclose(np.asarray(logits)[0, -1, :len(head)], head, atol=2e-3)
    assert np.asarray(logits)[0].argmax(-1).tolist() == fox["argmax"]
