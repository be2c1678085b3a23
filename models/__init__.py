"""Flax NNX Llama/Qwen models, checkpoint and tokenizer loading, KV cache and generation."""


def load_model(name_or_path: str, dtype="float32", **kwargs):
    from models.loading import load_model as _load

    return _load(name_or_path, dtype, **kwargs)


def load_model_tokenizer(name_or_path: str):
    """The tokenizer `load_model(name_or_path)` returns, built the same way (from the checkpoint's header: GGUF
    metadata, or a directory's config and tokenizer files) but without the weights: a caller checks its inputs with
    it, then calls `load_model(..., with_tokenizer=False)`. (`models.tokenizer.load_tokenizer(name)` alone may pick
    another file or config of a directory than the checkpoint does.)"""
    from models.checkpoint import load_checkpoint
    from models.tokenizer import load_tokenizer

    return load_tokenizer(name_or_path, load_checkpoint(name_or_path))
