"""Build any strategy by name: `make_strategy(name, num_layers, kv_heads, **kwargs)`.

The one place that maps a strategy name (as given on a command line) to a constructed, validated strategy.
kwargs are the config/dataclass field names (the flag names); a value of None means "use the default", so a CLI
can forward every flag it has. Unknown or inapplicable kwargs raise, naming the allowed ones.

Kascade names and what they set on `KascadeConfig`:
  kascade              the method (head_map as given, None = identity)
  no_remap             head_map forced to identity (None)
  all_heads_pooled     pool="all" (one index set per layer shared by all heads; like a recipe's pool="all", it
                       drops the head map)
  pre_softmax_pooling  pool="pre_softmax"
  oracle_topk          every layer is an anchor (anchors default to (0,))
  decode_only          dense prefill, Kascade decode
Baselines: dense, streaming_llm, quest, omnikv, less_is_more (see baselines.py). For quest, omnikv and
less_is_more, `topk_frac` / `min_k` are accepted as aliases of their `budget_frac` / `min_budget`.

Default anchors, when none are given: the paper's Llama-3.1-8B set (0, 2, 8, 13, 14) scaled to the model depth
(round(a * num_layers / 32), deduplicated), e.g. (0, 2, 8, 12, 13) for SmolLM2's 30 layers. `head_map` may be
given as nested lists, a path to a `.npy` ([num_layers, kv_heads] int) or a `.json` file (nested lists).
OmniKV filter layers / LessIsMore selection layers >= num_layers are dropped (clipped to the model depth).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from kascade_jax.baselines import DenseStrategy, LessIsMoreStrategy, OmniKVStrategy, QuestStrategy, StreamingLLMStrategy
from kascade_jax.config import KascadeConfig
from kascade_jax.strategies import KascadeStrategy

PAPER_ANCHORS_32 = (0, 2, 8, 13, 14)

_KASCADE_VARIANTS = {
    "kascade": {},
    "no_remap": {"head_map": None},
    "all_heads_pooled": {"pool": "all", "head_map": None},
    "pre_softmax_pooling": {"pool": "pre_softmax"},
    "oracle_topk": {"oracle_topk": True},
    "decode_only": {"decode_only": True},
}
VARIANT_POOL = {n: v["pool"] for n, v in _KASCADE_VARIANTS.items() if "pool" in v}  # the variants that set a pool
_BASELINES = {
    "dense": DenseStrategy,
    "streaming_llm": StreamingLLMStrategy,
    "quest": QuestStrategy,
    "omnikv": OmniKVStrategy,
    "less_is_more": LessIsMoreStrategy,
}
STRATEGY_NAMES = tuple(_KASCADE_VARIANTS) + tuple(_BASELINES)
KASCADE_FAMILY = tuple(_KASCADE_VARIANTS)  # the names that take anchors, a head map and a recipe
BUDGETED_BASELINES = ("quest", "omnikv", "less_is_more")  # the baselines that take topk_frac / min_k


def default_anchors(num_layers: int) -> tuple[int, ...]:
    return tuple(sorted({min(num_layers - 1, round(a * num_layers / 32)) for a in PAPER_ANCHORS_32}))


def load_head_map(head_map):
    """nested lists | path to .npy / .json | None -> tuple of tuples (or None)."""
    if head_map is None:
        return None
    if isinstance(head_map, str):
        if head_map.endswith(".npy"):
            import numpy as np

            head_map = np.load(head_map).tolist()
        elif head_map.endswith(".json"):
            with open(head_map) as f:
                head_map = json.load(f)
        else:
            raise ValueError(f"head_map path must end in .npy or .json, got {head_map!r}")
    return tuple(tuple(int(h) for h in row) for row in head_map)


def parse_layers(value) -> tuple[int, ...] | None:
    """'0,4,12' | [0, 4, 12] | None -> (0, 4, 12) | None."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            return tuple(int(x) for x in value.replace(" ", "").split(",") if x)
        except ValueError:
            raise ValueError(f"expected comma-separated layer indices, got {value!r}") from None
    return tuple(int(x) for x in value)


def _check_kwargs(name, kwargs, allowed):
    bad = sorted(set(kwargs) - set(allowed))
    if bad:
        raise ValueError(f"strategy {name!r} does not take {bad}; allowed: {sorted(allowed)}")


def make_strategy(name: str, num_layers: int, kv_heads: int, **kwargs: Any):
    """Construct strategy `name` for a model with `num_layers` layers and `kv_heads` KV heads."""
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if name in _KASCADE_VARIANTS:
        fields = {f.name for f in dataclasses.fields(KascadeConfig)} - {"num_layers", "kv_heads"}
        _check_kwargs(name, kwargs, fields | {"kernels"})
        kernels = kwargs.pop("kernels", "reference")
        if "anchors" in kwargs:
            kwargs["anchors"] = parse_layers(kwargs["anchors"])
        elif name == "oracle_topk":
            kwargs["anchors"] = (0,)
        else:
            kwargs["anchors"] = default_anchors(num_layers)
        kwargs["head_map"] = load_head_map(kwargs.get("head_map"))
        kwargs.update(_KASCADE_VARIANTS[name])
        if kwargs.get("pool") == "all":  # one set shared by every head (all_heads_pooled, or a recipe's pool)
            kwargs["head_map"] = None
        config = KascadeConfig(num_layers=num_layers, kv_heads=kv_heads, **kwargs)
        return KascadeStrategy(config, name=name, kernels=kernels)
    if name in _BASELINES:
        cls = _BASELINES[name]
        fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
        if "budget_frac" in fields:  # the Top-k knobs are shared with Kascade ("Top-k 10%" for every method)
            for alias, field in (("topk_frac", "budget_frac"), ("min_k", "min_budget")):
                if alias in kwargs:
                    kwargs[field] = kwargs.pop(alias)
        _check_kwargs(name, kwargs, fields)
        for key in ("filter_layers", "selection_layers"):
            if key in kwargs:
                kwargs[key] = parse_layers(kwargs[key])
        if cls is OmniKVStrategy:
            layers = kwargs.get("filter_layers", OmniKVStrategy.filter_layers)
            kwargs["filter_layers"] = tuple(x for x in layers if x < num_layers) or (min(2, num_layers - 1),)
        if cls is LessIsMoreStrategy:
            layers = kwargs.get("selection_layers", LessIsMoreStrategy.selection_layers)
            kwargs["selection_layers"] = tuple(x for x in layers if x < num_layers) or (min(2, num_layers - 1),)
        return cls(**kwargs)
    raise ValueError(f"unknown strategy {name!r}; choose one of {list(STRATEGY_NAMES)}")
