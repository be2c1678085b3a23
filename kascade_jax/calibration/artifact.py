"""The calibration artifact: everything one calibration run found, and enough to reproduce it.

One artifact per (model, statistics config, dataset). On disk it is a pair: `<stem>.json` (human-readable:
model, dataset name and size, k, tile_size, reduce, num_layers, kv_heads, the anchor set and objective for
every budget M, date, package versions, timing) and `<stem>.npz` (arrays: sim [L, L, kv_heads, kv_heads],
w [L], S [L, L], head_maps [L, L, kv_heads] where head_maps[M-1] goes with the M-anchor set). The JSON names
its npz, so either file path can be passed to `load`.

The cache key (`CalibrationKey`): every parameter that changes the stored statistics -- the model file's identity
(`model_fingerprint`), dataset with its config and split, prompt count, min/max prompt tokens, seed, k, tile size,
reduce, softmax block_tiles and dtype. The JSON records it under "key"; `load(path, key=...)` refuses an artifact
whose recorded key differs and names the fields. The DP's importance weighting and the anchor count M are not in
the key: they are applied on use to the stored, unweighted statistics, so one artifact serves every recipe that
calibrates the same way (a recipe's calibration fields -- calib_k, calib_reduce, calib_num_prompts,
calib_max_tokens, calib_dtype -- are key fields).

Deliberately not here: running the model (`runner.py`) or parsing CLI flags (`resolve.py`).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from kascade_jax.calibration.dp import select_anchors
from kascade_jax.calibration.head_map import head_map_for
from kascade_jax.calibration.stats import importance_weights, layer_scores

FORMAT_VERSION = 1

_SAMPLE = 1 << 20  # bytes hashed at each end of a model file without a registry sha256


def model_fingerprint(model_name: str) -> str | None:
    """The identity of the weights `model_name` resolves to, without loading them: the registry's sha256 for the
    parted aliases; for a local file (a .gguf, an installed package alias) its size and the sha256 of its first and
    last MiB; for a checkpoint directory the same over its *.safetensors and config.json. A hub id that is not
    downloaded, or a name that resolves to nothing (an in-memory model), has no fingerprint: None (the name keys it)."""
    from models import registry  # noqa: PLC0415

    name = str(model_name)
    alias = registry.ALIASES.get(name)
    if alias is not None and alias.parted is not None:
        return f"sha256={alias.parted.sha256} size={alias.parted.size}"
    path = Path(name).expanduser()
    if not path.exists():
        if alias is None or alias.hub_id is not None:
            return None
        try:
            path = registry.resolve(name)
        except ValueError:
            return None
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix == ".safetensors"
                                                 or p.name == "config.json")
    h, size = hashlib.sha256(), 0
    for f in files:
        n = f.stat().st_size
        size += n
        h.update(f"{f.name}:{n}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE))
            if n > 2 * _SAMPLE:
                fh.seek(n - _SAMPLE)
                h.update(fh.read(_SAMPLE))
    return f"sample-sha256={h.hexdigest()} size={size}"


@dataclasses.dataclass(frozen=True)
class CalibrationKey:
    """Every parameter that changes a calibration's result (see the module docstring)."""

    model_name: str
    model_file: str | None  # model_fingerprint(model_name)
    dataset: str = "builtin"
    dataset_config: str | None = None
    dataset_split: str | None = None  # None for the built-in set (it has no splits)
    num_prompts: int = 64
    min_tokens: int = 2048
    max_tokens: int = 4096
    seed: int = 0
    k: int = 64
    tile_size: int = 32
    reduce: str = "min"
    block_tiles: int | None = None
    dtype: str = "float32"

    def __post_init__(self):
        for f in ("num_prompts", "min_tokens", "max_tokens", "k", "tile_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"calibration {f} must be an int >= 1, got {v!r}")
        if self.k <= self.tile_size:
            raise ValueError(f"calibration k must exceed tile_size ({self.tile_size}): k - tile_size keys are "
                             f"selected on top of the diagonal tile, got k={self.k}")
        if self.dataset in ("builtin", "builtin_answers") and (self.dataset_config, self.dataset_split) != (None, None):
            object.__setattr__(self, "dataset_config", None)
            object.__setattr__(self, "dataset_split", None)

    @classmethod
    def make(cls, model_name: str, **fields) -> "CalibrationKey":
        """The key of `model_name` with its fingerprint computed (unless given as model_file=...)."""
        if "model_file" not in fields:
            fields["model_file"] = model_fingerprint(model_name)
        return cls(model_name=str(model_name), **fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:10]

    def name(self) -> str:
        """The artifact's file name: the readable `artifact_name` stem plus the digest of the whole key."""
        stem = artifact_name(self.model_name, self.dataset, self.num_prompts, self.k, self.tile_size, self.reduce)
        return stem[: -len(".json")] + f"-{self.digest()}.json"

    def diff(self, recorded: dict | None) -> list[str]:
        """`field: recorded X, asked Y` for every field where `recorded` (an artifact's key dict) differs."""
        recorded = recorded or {}
        return [f"{f}: recorded {recorded.get(f, '(not recorded)')!r}, asked {v!r}"
                for f, v in self.to_dict().items() if recorded.get(f, _MISSING) != v]


_MISSING = object()


@dataclasses.dataclass(frozen=True, eq=False)
class CalibrationArtifact:
    model_name: str
    dataset: str
    num_prompts: int
    k: int
    tile_size: int
    reduce: str
    sim: np.ndarray  # [L (a), L (b), kv_heads (h of b), kv_heads (g of a)], prompt-averaged, unweighted
    w: np.ndarray  # [L] layer importance
    S: np.ndarray  # [L, L] w_b * mean_h max_g sim (upper triangle)
    anchors: dict[int, tuple[int, ...]]  # M -> best anchor set of M layers
    scores: dict[int, float]  # M -> its objective sum_l S[anchor(l)][l]
    head_maps: np.ndarray  # [L (M-1), L, kv_heads] int32
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # seed, token lengths, timing, versions, date
    key: dict[str, Any] | None = None  # CalibrationKey.to_dict() of the run (None: an artifact that predates keys)

    @property
    def num_layers(self) -> int:
        return int(self.sim.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.sim.shape[2])

    @classmethod
    def from_statistics(cls, sim, w, *, model_name: str, dataset: str, num_prompts: int, k: int, tile_size: int,
                        reduce: str, meta: dict | None = None,
                        key: CalibrationKey | None = None) -> "CalibrationArtifact":
        """Layer scores, DP over every budget and the head maps, from prompt-averaged statistics."""
        sim = np.asarray(sim, np.float32)
        w = np.asarray(w, np.float32)
        if sim.ndim != 4 or sim.shape[0] != sim.shape[1] or sim.shape[2] != sim.shape[3] or w.shape != sim.shape[:1]:
            raise ValueError(f"sim must be [L, L, kv_heads, kv_heads] and w [L], got {sim.shape} and {w.shape}")
        S = np.asarray(layer_scores(sim, w))
        best = select_anchors(S)
        head_maps = np.stack([head_map_for(sim, best[m][0]) for m in sorted(best)])
        meta = dict(meta or {})
        meta.setdefault("date", datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
        meta.setdefault("versions", _versions())
        return cls(model_name=model_name, dataset=dataset, num_prompts=int(num_prompts), k=int(k),
                   tile_size=int(tile_size), reduce=reduce, sim=sim, w=w, S=S,
                   anchors={m: a for m, (a, _) in best.items()}, scores={m: s for m, (_, s) in best.items()},
                   head_maps=head_maps, meta=meta, key=None if key is None else key.to_dict())

    def check_key(self, key: CalibrationKey, where: str = "") -> None:
        """ValueError naming every field where this artifact's recorded key differs from `key`."""
        bad = key.diff(self.key)
        if bad:
            raise ValueError(f"calibration artifact {where or self.model_name!r} does not match the calibration "
                             f"asked for: " + "; ".join(bad))

    # ---- use ----------------------------------------------------------------------------------------------------
    def check_model(self, num_layers: int, kv_heads: int, model_name: str | None = None) -> None:
        if (num_layers, kv_heads) != (self.num_layers, self.kv_heads):
            raise ValueError(f"calibration artifact for {self.model_name!r} has num_layers={self.num_layers}, "
                             f"kv_heads={self.kv_heads}, but the model has num_layers={num_layers}, kv_heads={kv_heads}")
        if model_name is not None and model_name != self.model_name:
            raise ValueError(f"calibration artifact is for model {self.model_name!r}, not {model_name!r}")

    def anchors_for(self, num_anchors: int, importance: str = "paper") -> tuple[int, ...]:
        """The DP's best set of `num_anchors` anchors; `importance` re-weights the layer scores
        (`stats.importance_weights`: "paper" = the stored DP, "sqrt" / "none" re-run it on the stored sim and w)."""
        if num_anchors not in self.anchors:
            raise ValueError(f"num_anchors must lie in [1, {self.num_layers}], got {num_anchors}")
        if importance == "paper":
            return self.anchors[num_anchors]
        S = np.asarray(layer_scores(self.sim, importance_weights(self.w, importance)))
        return select_anchors(S)[num_anchors][0]

    def head_map(self, anchors) -> np.ndarray:
        """[L, kv_heads] int32 head map for any anchor set (precomputed for the DP's sets)."""
        anchors = tuple(int(a) for a in anchors)
        if self.anchors.get(len(anchors)) == anchors:
            return self.head_maps[len(anchors) - 1]
        return head_map_for(self.sim, anchors)

    # ---- files --------------------------------------------------------------------------------------------------
    def save(self, path) -> Path:
        """Write `<stem>.json` + `<stem>.npz`; returns the JSON path."""
        json_path = _json_path(path)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        npz_path = json_path.with_suffix(".npz")
        np.savez(npz_path, sim=self.sim, w=self.w, S=self.S, head_maps=self.head_maps)
        doc = dict(
            format_version=FORMAT_VERSION, model_name=self.model_name, dataset=self.dataset,
            num_prompts=self.num_prompts, k=self.k, tile_size=self.tile_size, reduce=self.reduce,
            num_layers=self.num_layers, kv_heads=self.kv_heads, arrays=npz_path.name,
            anchors={str(m): list(a) for m, a in sorted(self.anchors.items())},
            scores={str(m): s for m, s in sorted(self.scores.items())},
            w=[float(x) for x in self.w], meta=self.meta, key=self.key,
        )
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, json_path)  # the JSON last and atomically: a present JSON means a complete artifact
        return json_path

    @classmethod
    def load(cls, path, *, num_layers: int | None = None, kv_heads: int | None = None,
             key: CalibrationKey | None = None) -> "CalibrationArtifact":
        """The artifact at `path`; with `key`, a ValueError naming each field where its recorded key differs."""
        json_path = _json_path(path)
        if not json_path.is_file():
            raise ValueError(f"no calibration artifact at {json_path}")
        doc = json.loads(json_path.read_text())
        if doc.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{json_path}: format_version {doc.get('format_version')!r}, expected {FORMAT_VERSION}")
        with np.load(json_path.parent / doc["arrays"], allow_pickle=False) as z:
            arrays = {k: z[k] for k in ("sim", "w", "S", "head_maps")}
        art = cls(model_name=doc["model_name"], dataset=doc["dataset"], num_prompts=doc["num_prompts"], k=doc["k"],
                  tile_size=doc["tile_size"], reduce=doc["reduce"], sim=arrays["sim"], w=arrays["w"], S=arrays["S"],
                  anchors={int(m): tuple(a) for m, a in doc["anchors"].items()},
                  scores={int(m): float(s) for m, s in doc["scores"].items()},
                  head_maps=arrays["head_maps"], meta=doc.get("meta", {}), key=doc.get("key"))
        if (art.num_layers, art.kv_heads) != (doc["num_layers"], doc["kv_heads"]):
            raise ValueError(f"{json_path}: arrays ({art.num_layers} layers, {art.kv_heads} kv_heads) disagree with "
                             f"the JSON ({doc['num_layers']}, {doc['kv_heads']})")
        if num_layers is not None or kv_heads is not None:
            art.check_model(art.num_layers if num_layers is None else num_layers,
                            art.kv_heads if kv_heads is None else kv_heads)
        if key is not None:
            art.check_key(key, str(json_path))
        return art


def read_key(path) -> dict | None:
    """The recorded key of the artifact JSON at `path` (no arrays read); None if it has none or does not parse."""
    try:
        return json.loads(Path(path).read_text()).get("key")
    except (OSError, ValueError, AttributeError):
        return None


def _json_path(path) -> Path:
    p = Path(path).expanduser()
    return p.with_suffix(".json") if p.suffix in (".json", ".npz", "") else p.with_name(p.name + ".json")


def default_cache_dir() -> Path:
    """$KASCADE_JAX_CALIBRATION_DIR, else ~/.cache/kascade_jax/calibration."""
    env = os.environ.get("KASCADE_JAX_CALIBRATION_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kascade_jax" / "calibration"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_") or "x"


def artifact_name(model_name: str, dataset: str, num_prompts: int, k: int, tile_size: int, reduce: str = "min") -> str:
    """`<model>-<dataset>-<n>-k<k>-ts<tile>[-mean].json`: the cache key of one calibration."""
    tail = "" if reduce == "min" else f"-{reduce}"
    return f"{_slug(model_name)}-{_slug(dataset)}-{num_prompts}-k{k}-ts{tile_size}{tail}.json"


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for dist in ("jax", "jaxlib", "flax", "numpy", "kascade-jax"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return out
