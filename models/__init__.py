"""Flax NNX Llama/Qwen models, checkpoint and tokenizer loading, KV cache and generation."""


def load_model(name_or_path: str, dtype="float32", **kwargs):
    from models.loading import load_model as _load

    return _load(name_or_path, dtype, **kwargs)
