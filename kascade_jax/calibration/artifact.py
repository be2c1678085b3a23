"""The calibration artifact: everything one calibration run found, and enough to reproduce it.

One artifact per (model, statistics config, dataset). On disk it is a pair: `<stem>.json` (human-readable:
model, dataset name and size, k, tile_size, reduce, num_layers, kv_heads, the anchor set and objective for
every budget M, date, package versions, timing) and `<stem>.npz` (arrays: sim [L, L, kv_heads, kv_heads],
w [L], S [L, L], head_maps [L, L, kv_heads] where head_maps[M-1] goes with the M-anchor set). The JSON names
its npz, so either file path can be passed to `load`.

Deliberately not here: running the model (`runner.py`) or parsing CLI flags (`resolve.py`).
"""

from __future__ import annotations

import dataclasses
import datetime
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

    @property
    def num_layers(self) -> int:
        return int(self.sim.shape[0])

    @property
    def kv_heads(self) -> int:
        return int(self.sim.shape[2])

    @classmethod
    def from_statistics(cls, sim, w, *, model_name: str, dataset: str, num_prompts: int, k: int, tile_size: int,
                        reduce: str, meta: dict | None = None) -> "CalibrationArtifact":
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
                   head_maps=head_maps, meta=meta)

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
            w=[float(x) for x in self.w], meta=self.meta,
        )
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, json_path)  # the JSON last and atomically: a present JSON means a complete artifact
        return json_path

    @classmethod
    def load(cls, path, *, num_layers: int | None = None, kv_heads: int | None = None) -> "CalibrationArtifact":
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
                  head_maps=arrays["head_maps"], meta=doc.get("meta", {}))
        if (art.num_layers, art.kv_heads) != (doc["num_layers"], doc["kv_heads"]):
            raise ValueError(f"{json_path}: arrays ({art.num_layers} layers, {art.kv_heads} kv_heads) disagree with "
                             f"the JSON ({doc['num_layers']}, {doc['kv_heads']})")
        if num_layers is not None or kv_heads is not None:
            art.check_model(art.num_layers if num_layers is None else num_layers,
                            art.kv_heads if kv_heads is None else kv_heads)
        return art


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
