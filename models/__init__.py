"""Flax NNX Llama/Qwen models, checkpoint and tokenizer loading, KV cache and generation."""


def load_model(name_or_path: str, dtype="float32", **kwargs):
    from models.loading import load_model as _load

    return _load(name_or_path, dtype, **kwargs)


def load_model_header(name_or_path: str):
    """(config, tokenizer) as `load_model(name_or_path)` builds them (from the checkpoint's header: GGUF metadata, or
    a directory's config and tokenizer files), without the weights: a caller checks its inputs with them, then calls
    `load_model(..., with_tokenizer=False)`. (`models.tokenizer.load_tokenizer(name)` alone may pick another file or
    config of a directory than the checkpoint does.)"""
    from models.checkpoint import load_checkpoint
    from models.config import ModelConfig
    from models.tokenizer import load_tokenizer

    ckpt = load_checkpoint(name_or_path)
    return ModelConfig.from_hf(ckpt.config, name=str(name_or_path)), load_tokenizer(name_or_path, ckpt)

