"""Load Llama/Qwen-family checkpoints as (HF config dict, lazily loaded numpy tensors), with no torch.

Sources (see `load_checkpoint`):
- an HF directory: config.json + model.safetensors, or sharded model-0000x-of-0000y.safetensors with
  model.safetensors.index.json (read with safetensors' numpy backend; bf16 works because ml_dtypes registers it);
- a .gguf file (models.gguf: dequantized to float32, Q/K un-permuted for arch `llama`);
- a registry alias or hub id (models.registry), resolved to one of the above.

Tensors keep HF names and HF shapes (`(out, in)` for linear weights) and the file's float dtype (GGUF: float32).
They are read only when indexed, one at a time, and not cached, so peak memory is one tensor plus what the
caller keeps. `lm_head.weight` is absent when the embeddings are tied (`config["tie_word_embeddings"]`).

Deliberately not here: conversion to JAX/Flax parameters, dtype casting policy, orbax caching (the model's job),
and torch `.bin` checkpoints (we never unpickle).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import ml_dtypes  # noqa: F401  -- registers bfloat16 with numpy, so safetensors' numpy backend can return it
import numpy as np

from models import gguf as gguf_io
from models import registry

Loader = Callable[[], np.ndarray]


class LazyTensors(Mapping):
    """Read-only mapping HF name -> np.ndarray that loads each tensor when it is indexed (no caching).

    `shape(name)` and `loader(name)` give the shape / a zero-argument loader without reading any data.
    """

    def __init__(self, entries: dict[str, tuple[tuple[int, ...], Loader]], source: str):
        self._entries = dict(sorted(entries.items()))
        self._source = source

    def __getitem__(self, name: str) -> np.ndarray:
        return self.loader(name)()

    def loader(self, name: str) -> Loader:
        if name not in self._entries:
            raise KeyError(f"{self._source!r} has no tensor {name!r} ({len(self._entries)} tensors)")
        return self._entries[name][1]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._entries:
            raise KeyError(f"{self._source!r} has no tensor {name!r} ({len(self._entries)} tensors)")
        return self._entries[name][0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"LazyTensors({self._source!r}, {len(self)} tensors)"


@dataclass(frozen=True)
class Checkpoint:
    """An HF-style config dict plus lazily loaded HF-named tensors.

    format: "safetensors" or "gguf". metadata: the GGUF key/values (tokenizer vocabulary, chat template) for
    GGUF checkpoints, empty otherwise. source: the resolved local path (for error messages and for finding the
    tokenizer files next to it).
    """

    config: dict
    tensors: LazyTensors
    source: str
    format: str
    metadata: Mapping[str, Any] = field(default_factory=dict, repr=False)


def _read_json(path: Path) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} must hold a JSON object, got {type(data).__name__}")
    return data


def _safetensors_entries(files: list[Path], wanted: Mapping[str, str] | None) -> dict:
    """{name: (shape, loader)} for the tensors of the given safetensors files (validated by opening each)."""
    from safetensors import safe_open

    entries = {}
    for file in files:
        try:
            with safe_open(str(file), framework="numpy") as f:
                names = list(f.keys())
                shapes = {n: tuple(f.get_slice(n).get_shape()) for n in names}
        except Exception as e:  # SafetensorError (corrupt / truncated header or data), OSError
            raise ValueError(f"{str(file)!r} is not a readable safetensors file: {type(e).__name__}: {e}") from e
        for n in names:
            if wanted is not None and wanted.get(n) != file.name:
                continue

            def load(file=file, n=n):
                with safe_open(str(file), framework="numpy") as f:
                    return f.get_tensor(n)

            entries[n] = (shapes[n], load)
    if wanted is not None:
        missing = sorted(set(wanted) - set(entries))
        if missing:
            raise ValueError(
                f"safetensors index lists {len(missing)} tensors not found in their shard files, e.g. {missing[:3]}"
            )
    return entries


def _load_directory(path: Path) -> Checkpoint:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"checkpoint directory {str(path)!r} has no config.json")
    config = _read_json(config_file)
    # Multimodal / newer configs nest the text model's fields (e.g. "text_config"); we only load text LMs.
    if "text_config" in config and "hidden_size" not in config:
        config = {**config["text_config"], "architectures": config.get("architectures")}

    index_file = path / "model.safetensors.index.json"
    if index_file.is_file():
        index = _read_json(index_file)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{str(index_file)!r} has no 'weight_map' (name -> shard file)")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{str(index_file)!r} names shard {f.name!r}, which is missing from {str(path)!r}")
        entries = _safetensors_entries(files, weight_map)
    elif (path / "model.safetensors").is_file():
        entries = _safetensors_entries([path / "model.safetensors"], None)
    else:
        others = sorted(p.name for p in path.glob("*.safetensors"))
        if others:
            entries = _safetensors_entries([path / n for n in others], None)
        else:
            found = sorted(p.name for p in path.iterdir())[:12]
            raise ValueError(
                f"checkpoint directory {str(path)!r} has no model.safetensors, model.safetensors.index.json or "
                f"other *.safetensors file (torch .bin checkpoints are not supported); it contains {found}"
            )
    if not entries:
        raise ValueError(f"checkpoint directory {str(path)!r}: the safetensors files hold no tensors")
    if config.get("tie_word_embeddings") is None:
        # transformers' default for Llama/Qwen configs that omit the key is False ... unless lm_head is missing.
        config["tie_word_embeddings"] = "lm_head.weight" not in entries
    return Checkpoint(config=config, tensors=LazyTensors(entries, str(path)), source=str(path), format="safetensors")


def _load_gguf_file(path: Path) -> Checkpoint:
    config, entries, meta = gguf_io.load_gguf(str(path))
    return Checkpoint(
        config=config, tensors=LazyTensors(entries, str(path)), source=str(path), format="gguf", metadata=meta
    )


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def load_checkpoint(name_or_path: str | os.PathLike) -> Checkpoint:
    """Checkpoint for a directory, a .gguf file, a registry alias (e.g. "smollm2-135m") or a hub id."""
    path = registry.resolve(name_or_path)
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return _load_gguf_file(ggufs[0])
        return _load_directory(path)
    if path.suffix == ".gguf" or _has_gguf_magic(path):
        return _load_gguf_file(path)
    if path.suffix == ".safetensors":
        return _load_directory(path.parent)
    raise ValueError(
        f"cannot load {str(path)!r}: expected a directory (config.json + *.safetensors) or a .gguf file"
    )


def rope_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """One spelling of the RoPE settings across transformers v4 (`rope_theta` + `rope_scaling`) and v5
    (`rope_parameters`) configs: {"rope_theta": float, "rope_type": str, ...scaling fields}."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        out = dict(params)
    else:
        out = {"rope_theta": float(config.get("rope_theta", 10000.0))}
        out.update(config.get("rope_scaling") or {})
    if "type" in out:  # transformers v4 legacy key
        out.setdefault("rope_type", out["type"])
        del out["type"]
    out.setdefault("rope_type", "default")
    out["rope_theta"] = float(out["rope_theta"])
    return out
