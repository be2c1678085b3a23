import os

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test; the seed is printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[seed] {request.node.nodeid}: {seed}")
    return np.random.default_rng(seed)


def tiny_config(model_type="llama", **over):
    from models.config import ModelConfig

    cfg = dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
               num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True,
               rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg.update(over)
    return ModelConfig.from_hf(cfg)


@pytest.fixture(scope="session")
def tiny_model():
    from models.params import random_model

    return random_model(tiny_config(), seed=7)


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct Q4_1 GGUF, dequantised to f32) and its tokenizer."""
    from models import load_model

    return load_model("smollm2-135m", "float32")
