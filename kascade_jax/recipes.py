"""Recipes: how Kascade is set up for a model (calibration, anchor count, recipe levers), selectable by name.

A recipe fixes everything the user does not pass explicitly: the calibration that chooses anchors and head maps
(k, reduction over tiles, DP importance weighting, development prompts), the anchor count M, and the
`KascadeConfig` levers (`recipes.LEVERS`: forced keys, dense suffix, budgets, dense anchor outputs, dense prefill,
the rerank, the selection pool, the dense decode layers, each reuse layer's own keys from the prefill, the prefill's
key blocks).
Two names exist for every model:
- `paper`: the paper's method exactly (DP over k = 64 similarity, min over tiles, importance-weighted, M = 5, no
  levers);
- `default`: the recipe chosen for this model on the development split (never on test prompts) and shipped in
  `kascade_jax/data/recipes/<model>.json` with the measurement it rests on; for a model without a shipped file it
  is `UNTUNED` (`dps_all`: dense prefill, one Top-k set per anchor shared by all heads), the part every tuned
  model's choice shares, which lost 6-9 points less than the paper recipe on the tuned Qwens' test prompts; the
  entry points print `untuned_notice` when they use it.
A path to a JSON file with the same fields works too. Explicit flags override the recipe's fields.

Deliberately not here: running calibrations (`calibration.resolve`) or building strategies (`registry`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

RECIPE_DIR = Path(__file__).resolve().parent / "data" / "recipes"
LEVERS = ("sink_tokens", "recent_window", "dense_suffix", "local_window", "prefill_topk_frac", "decode_topk_frac",
          "tile_size", "prefill_dense_anchors", "decode_only", "decode_rerank", "decode_tail_stride", "decode_tail_cap",
          "pool", "decode_dense_layers", "decode_prefill_keys", "prefill_key_block", "prefill_score_fp8",
          "decode_score_fp8")
BOOL_LEVERS = ("prefill_dense_anchors", "decode_only", "decode_tail_cap", "prefill_score_fp8", "decode_score_fp8")


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str = "paper"
    num_anchors: int = 5
    calib_k: int = 64
    calib_reduce: str = "min"
    calib_importance: str = "paper"
    calib_num_prompts: int = 64
    calib_max_tokens: int = 4096
    calib_dtype: str | None = None  # the calibration forwards' dtype; None: the model's --dtype
    calib_dataset: str = "builtin"  # or "builtin_answers" (prompts followed by their gold answers), or a HF name
    sink_tokens: int = 0
    recent_window: int = 0
    dense_suffix: int = 0
    local_window: int = 0  # prefill: keys before each tile attended on top of the budget
    prefill_topk_frac: float | None = None  # prefill budget fraction (None: the run's topk_frac)
    decode_topk_frac: float | None = None  # decode budget fraction (None: the run's topk_frac)
    tile_size: int | None = None  # prefill query tile (None: KascadeConfig's 32)
    prefill_key_block: int | None = None  # prefill: anchors select aligned blocks of this many keys (None: 1)
    prefill_dense_anchors: bool = False  # prefill: anchor layers output dense attention (they still select)
    prefill_score_fp8: bool = False  # prefill: sparse-output anchors score keys from fp8 copies of q and centred k
    decode_score_fp8: bool = False  # decode: sparse-output anchors score keys from an fp8 copy of K in the cache
    decode_only: bool = False  # dense prefill, Kascade decode
    decode_rerank: int | None = None  # decode: anchors select C x the budget, each reuse layer keeps its own Top-k
    decode_rerank_worst: int | None = None  # only the N reuse layers least similar to their anchor rerank (None: all)
    decode_tail_stride: int | None = None  # decode: a sampled tail of the unselected keys, every S-th weighted by S
    decode_tail_cap: bool = False  # the tail: a sampled key as heavy as the lightest selected one counts once
    pool: str | None = None  # selection pool (KascadeConfig.pool): "all" = one Top-k set shared by every head, no
    # head map (the all_heads_pooled strategy as a recipe); None: the strategy's ("gqa", one set per KV head)
    decode_dense_layers: tuple[int, ...] | None = None  # decode: layers that output dense attention, negatives
    # counted from the end (-1: the last layer), so one list fits any depth; [] (e.g. an empty flag): none
    decode_prefill_keys: float | None = None  # decode: each reuse layer's own Top-s of the prefill's last tile, on
    # top of its anchor's (KascadeConfig.decode_prefill_keys; needs decode_only)
    anchors: tuple[int, ...] | None = None  # pinned anchor layers (0 first; num_anchors must equal their count):
    # `--anchors=auto` then runs these instead of the calibration's DP (whose head map still applies)
    note: str = ""  # why this recipe (what it measured on the dev split)

    def __post_init__(self):
        from kascade_jax.calibration.stats import IMPORTANCE, REDUCES  # noqa: PLC0415
        from kascade_jax.config import KEY_BLOCKS, POOLS  # noqa: PLC0415

        for f in ("num_anchors", "calib_k", "calib_num_prompts", "calib_max_tokens"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"recipe {self.name!r}: {f} must be an int >= 1, got {v!r}")
        for f in ("sink_tokens", "recent_window", "dense_suffix", "local_window"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"recipe {self.name!r}: {f} must be an int >= 0, got {v!r}")
        for f in ("prefill_topk_frac", "decode_topk_frac"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1):
                raise ValueError(f"recipe {self.name!r}: {f} must be null or in (0, 1], got {v!r}")
        for f in BOOL_LEVERS:
            if not isinstance(getattr(self, f), bool):
                raise ValueError(f"recipe {self.name!r}: {f} must be true or false, got {getattr(self, f)!r}")
        rr = self.decode_rerank
        if rr is not None and (isinstance(rr, bool) or not isinstance(rr, int) or rr < 1):
            raise ValueError(f"recipe {self.name!r}: decode_rerank must be null or an int >= 1, got {rr!r}")
        n = self.decode_rerank_worst
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"recipe {self.name!r}: decode_rerank_worst must be null or an int >= 1, got {n!r}")
        if n is not None and (rr or 1) == 1:
            raise ValueError(f"recipe {self.name!r}: decode_rerank_worst={n} needs decode_rerank > 1 (the candidates "
                             "those layers rerank)")
        t = self.decode_tail_stride
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0 or t == 1):
            raise ValueError(f"recipe {self.name!r}: decode_tail_stride must be null, 0 (off) or an int >= 2, "
                             f"got {t!r}")
        if self.decode_tail_cap is True and not t:
            raise ValueError(f"recipe {self.name!r}: decode_tail_cap needs decode_tail_stride >= 2")
        if t and (rr or 1) > 1:
            raise ValueError(f"recipe {self.name!r}: decode_tail_stride and decode_rerank={rr} are not combined: use "
                             "one or the other")
        if self.pool is not None and self.pool not in POOLS:
            raise ValueError(f"recipe {self.name!r}: pool must be null or one of {POOLS}, got {self.pool!r}")
        if self.pool == "all" and (rr or 1) > 1:
            raise ValueError(f"recipe {self.name!r}: pool 'all' shares one index set between all heads, and "
                             f"decode_rerank={rr} ranks candidates per KV head: use one or the other")
        dl = self.decode_dense_layers
        if dl is not None:
            if (isinstance(dl, (str, bytes)) or not hasattr(dl, "__iter__")
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in dl)):
                raise ValueError(f"recipe {self.name!r}: decode_dense_layers must be a list of layer numbers such as "
                                 f"[-3, -2, -1], got {dl!r}")
            if 0 in dl:
                raise ValueError(f"recipe {self.name!r}: decode_dense_layers must not hold layer 0 (layer0_dense "
                                 f"governs it), got {list(dl)}")
            object.__setattr__(self, "decode_dense_layers", tuple(dl))
        pk = self.decode_prefill_keys
        if pk is not None and (isinstance(pk, bool) or not isinstance(pk, (int, float)) or not 0 <= pk <= 1):
            raise ValueError(f"recipe {self.name!r}: decode_prefill_keys must be null, 0 (off) or in (0, 1], "
                             f"got {pk!r}")
        if pk and (t or (rr or 1) > 1):
            raise ValueError(f"recipe {self.name!r}: decode_prefill_keys is not combined with decode_tail_stride or "
                             "decode_rerank > 1: use one or the other")
        if self.anchors is not None:
            a = self.anchors
            if (isinstance(a, (str, bytes)) or not hasattr(a, "__iter__")
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in a)):
                raise ValueError(f"recipe {self.name!r}: anchors must be a list of layer indices, got {a!r}")
            a = tuple(a)
            if not a or a[0] != 0 or any(y <= x for x, y in zip(a, a[1:])):
                raise ValueError(f"recipe {self.name!r}: anchors must start at layer 0 and increase, got {list(a)}")
            if self.num_anchors != len(a):
                raise ValueError(f"recipe {self.name!r}: num_anchors={self.num_anchors} but anchors pins {len(a)} "
                                 f"layers {list(a)}")
            object.__setattr__(self, "anchors", a)
        ts = self.tile_size
        if ts is not None and (isinstance(ts, bool) or ts not in (16, 32, 64)):
            raise ValueError(f"recipe {self.name!r}: tile_size must be null, 16, 32 or 64, got {ts!r}")
        kb = self.prefill_key_block
        if kb is not None and (isinstance(kb, bool) or not isinstance(kb, int) or kb not in KEY_BLOCKS):
            raise ValueError(f"recipe {self.name!r}: prefill_key_block must be null or one of {KEY_BLOCKS}, got {kb!r}")
        if self.calib_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"recipe {self.name!r}: calib_dtype must be float32, bfloat16, float16 or null, "
                             f"got {self.calib_dtype!r}")
        if not isinstance(self.calib_dataset, str) or not self.calib_dataset.strip():
            raise ValueError(f"recipe {self.name!r}: calib_dataset must be a dataset name such as 'builtin', "
                             f"got {self.calib_dataset!r}")
        if self.calib_reduce not in REDUCES:
            raise ValueError(f"recipe {self.name!r}: calib_reduce must be one of {REDUCES}, got {self.calib_reduce!r}")
        if self.calib_importance not in IMPORTANCE:
            raise ValueError(f"recipe {self.name!r}: calib_importance must be one of {IMPORTANCE}, "
                             f"got {self.calib_importance!r}")

    def levers(self) -> dict[str, Any]:
        """The KascadeConfig fields this recipe sets (the optional ones, the two budget fractions and tile_size, only
        when the recipe names them; the switches only when on, so a recipe never turns off what a strategy variant
        such as `decode_only` sets)."""
        return {f: getattr(self, f) for f in LEVERS
                if getattr(self, f) is not None and not (f in BOOL_LEVERS and not getattr(self, f))}

    def calibration_kwargs(self, dtype: str = "float32") -> dict[str, Any]:
        """`calibration.load_or_calibrate` keywords of this recipe: its calibration fields, and its `calib_dtype`
        (else the run's `dtype`), so the key matches the shipped calibration whatever the run's --dtype."""
        return dict(num_prompts=self.calib_num_prompts, max_tokens=self.calib_max_tokens,
                    min_tokens=max(64, self.calib_max_tokens // 2), k=self.calib_k, reduce=self.calib_reduce,
                    dtype=self.calib_dtype or dtype, dataset=self.calib_dataset)

    def describe(self) -> str:
        def show(f, v):  # one token per lever (the eval's config strings are split on spaces)
            if isinstance(v, float):
                return f"{f}={v:g}"
            if isinstance(v, tuple):
                return f"{f}={','.join(map(str, v))}"
            return f if isinstance(v, bool) else f"{f}={v}"

        on = [show(f, getattr(self, f)) for f in LEVERS if getattr(self, f)]
        on += [f"decode_rerank_worst={self.decode_rerank_worst}"] if self.decode_rerank_worst else []
        calib = f"k{self.calib_k}/{self.calib_reduce}/w={self.calib_importance}"
        calib += f"/d={self.calib_dataset}" if self.calib_dataset != "builtin" else ""
        pinned = f" pinned={','.join(map(str, self.anchors))}" if self.anchors else ""
        return f"recipe={self.name} M={self.num_anchors}{pinned} calib={calib}" + (" " + " ".join(on) if on else "")

    def replace(self, **overrides) -> "Recipe":
        """A copy with the non-None overrides applied (explicit flags win over the recipe); a recipe whose fields
        an override changed is renamed `<name>*`, so results never attribute it to the original. Another
        `num_anchors` than a pinned set's size (and no new `anchors`) drops the pins: the DP picks that many."""
        over = {k: v for k, v in overrides.items() if v is not None and getattr(self, k) != v}
        if self.anchors and "num_anchors" in over and overrides.get("anchors") is None:
            over["anchors"] = None
        return dataclasses.replace(self, name=self.name.rstrip("*") + "*", **over) if over else self

    @classmethod
    def from_dict(cls, d: dict[str, Any], name: str) -> "Recipe":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"measured"})
        if unknown:
            raise ValueError(f"recipe {name!r}: unknown fields {unknown}; allowed: {sorted(known)}")
        return cls(**{k: v for k, v in d.items() if k in known and k != "name"}, name=d.get("name", name))


PAPER = Recipe()


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(text)).strip("_") or "x"


def recipe_file(model_name: str) -> Path:
    return RECIPE_DIR / f"{_slug(Path(str(model_name)).name)}.json"


UNTUNED = "dps_all"
_UNTUNED_NOTE = "no tuned recipe shipped for"


def untuned_notice(recipe: Recipe) -> str | None:
    """The line to print when `recipe` is the fallback of a model without a shipped recipe (its note), else None."""
    return recipe.note if recipe.note.startswith(_UNTUNED_NOTE) else None


def load_recipe(model_name: str, name: str = "default") -> Recipe:
    """`paper`, `default` (the shipped choice for `model_name`, else `UNTUNED`) or a .json path.

    `paper` and `candidate:<name>` take the `calib_dtype` of the model's shipped recipe (the dtype its shipped
    calibration ran in; not a method choice), so they find that calibration at any --dtype."""
    name = str(name).strip()
    if name == "paper" or name.startswith("candidate:"):
        r = PAPER if name == "paper" else candidate(name.split(":", 1)[1])
        shipped = recipe_file(model_name)
        if r.calib_dtype is None and shipped.is_file():
            dt = json.loads(shipped.read_text()).get("default", {}).get("calib_dtype")
            r = dataclasses.replace(r, calib_dtype=dt) if dt else r
        return r
    if name.endswith(".json"):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ValueError(f"--recipe: no recipe file at {path}")
        try:
            doc = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"--recipe: {path} is not valid JSON ({getattr(e, 'msg', e)})") from None
        doc = doc.get("default", doc) if isinstance(doc, dict) else doc
        if not isinstance(doc, dict):
            raise ValueError(f"--recipe: {path} must hold a JSON object of recipe fields (or {{\"default\": {{...}}}}), "
                             f"got a {type(doc).__name__}")
        return Recipe.from_dict(doc, path.stem)
    if name != "default":
        raise ValueError(f"--recipe must be 'paper', 'default', 'candidate:<name>' ({sorted(CANDIDATES)}) or a path "
                         f"to a .json recipe, got {name!r}")
    path = recipe_file(model_name)
    if not path.is_file():
        return dataclasses.replace(
            candidate(UNTUNED), name="default",
            note=f"{_UNTUNED_NOTE} {model_name!r}: {UNTUNED} (dense prefill, Kascade decode with one Top-k set per "
                 f"anchor shared by all heads; on real RULER's test prompts at 16K it lost 1.4 points on "
                 f"Qwen2.5-Coder-0.5B and 2.3 on the 1.5B, where the paper recipe lost 7.7 and 11.3). Tune one for "
                 f"this model on its dev split: docs/evaluation-and-recipes.md, 'Tuning a recipe for your own model'")
    doc = json.loads(path.read_text())
    if "default" not in doc:
        raise ValueError(f"{path}: a recipe file needs a 'default' entry, got keys {sorted(doc)}")
    return Recipe.from_dict(doc["default"], "default")


def chosen_from(model_name: str) -> str | None:
    """The candidate the model's shipped default was chosen from (its recipe file's `chosen_from`), else None."""
    path = recipe_file(model_name)
    return json.loads(path.read_text()).get("chosen_from") if path.is_file() else None


# The recipe levers of issue 17 as candidate recipes, measured on the development split (experiments.accuracy
# --mode=plan writes one dev run per candidate; --mode=choose picks the default from their results).
CANDIDATES: dict[str, dict[str, Any]] = {
    "paper": dict(num_anchors=5),
    "sw": dict(num_anchors=5, sink_tokens=4, recent_window=60),
    "ds128": dict(num_anchors=5, dense_suffix=128),
    "ds512": dict(num_anchors=5, dense_suffix=512),
    "sw_ds128": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128),
    "m6": dict(num_anchors=6),
    "m6_sw_ds128": dict(num_anchors=6, sink_tokens=4, recent_window=60, dense_suffix=128),
    "m8": dict(num_anchors=8),
    "imp_none": dict(num_anchors=5, calib_importance="none"),
    "imp_sqrt": dict(num_anchors=5, calib_importance="sqrt"),
    "calib_k352": dict(num_anchors=5, calib_k=352),
    "calib_mean": dict(num_anchors=5, calib_reduce="mean"),
    "calib_16k": dict(num_anchors=5, calib_k=1664, calib_num_prompts=16, calib_max_tokens=16384),
    # issue 21: levers against the sparse rolling prefill's loss (results/accuracy/NOTES.md has the predictions)
    "lw256": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, local_window=256),
    "lw1024": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, local_window=1024),
    "pf20": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, prefill_topk_frac=0.2),
    "ds512s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=512),
    "t16": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, tile_size=16),
    # issue 22 item 2, to measure (hypothesis): the paper recipe with each prefill tile selecting aligned blocks of 16
    # keys, which a Hopper kernel gathers by whole-block copies; the accuracy cost of the coarser selection
    "kb16": dict(num_anchors=5, prefill_key_block=16),
    # issue 22, to measure: the paper recipe with the anchors after layer 0 scoring keys from fp8 q and centred k
    # (the Mosaic GPU score passes 20-28% faster at the 8B shape; the CPU probe kept the selection's mass as bf16 does)
    "fp8s": dict(num_anchors=5, prefill_score_fp8=True),
    "m7s": dict(num_anchors=7, sink_tokens=4, recent_window=60, dense_suffix=128),
    "imp_none_s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, calib_importance="none"),
    "imp_sqrt_s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, calib_importance="sqrt"),
    "m7_lw1024_pf20": dict(num_anchors=7, sink_tokens=4, recent_window=60, dense_suffix=512, local_window=1024,
                           prefill_topk_frac=0.2),
    # issue 21 session 3: the decode budget (+2.0 on the 1.5B at 20%) with the 0.5B's dense suffix and the DP
    # without importance weights (+1.1 on the 1.5B)
    "dec15_ds512s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=512, decode_topk_frac=0.15),
    "dec20_ds512s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=512, decode_topk_frac=0.2),
    "dec20_imp_none_ds512s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=512,
                                  decode_topk_frac=0.2, calib_importance="none"),
    "imp_none_ds512s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=512,
                            calib_importance="none"),
    "ds1024s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=1024),
    "dec20_ds1024s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=1024, decode_topk_frac=0.2),
    # issue 21 session 4: on the 1.5B the whole loss is in the sparse prefill (dense prefill + Kascade decode -0.2,
    # every layer its own exact Top-k -4.2): dense prefill as a recipe, dense anchor outputs, a larger prefill budget
    "dps": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True),
    "pda_s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, prefill_dense_anchors=True),
    "pda_pf20_s": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, prefill_dense_anchors=True,
                       prefill_topk_frac=0.2),
    "pf30": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=128, prefill_topk_frac=0.3),
    # issue 21 session 5: the 0.5B's ds512s lost -2.8 on test; its decode keeps 0.53-0.69 of the oracle mass in
    # layers 20-23 (fidelity), so dense prefill with a 20% decode budget beside plain dps
    "dps_dec20": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, decode_topk_frac=0.2),
    # the DP on statistics at 16K with k = 10% (issue 21 item 3; never run): the shipped 4K/k=64 statistics rate
    # anchor 9's cover of layers 21-23 at 0.66-0.78, where the 16K fidelity run measured 0.49-0.66
    "c16k_ds512s": dict(num_anchors=5, calib_k=1664, calib_num_prompts=16, calib_max_tokens=16384, sink_tokens=4,
                        recent_window=60, dense_suffix=512),
    "dps_c16k": dict(num_anchors=5, calib_k=1664, calib_num_prompts=16, calib_max_tokens=16384, sink_tokens=4,
                     recent_window=60, decode_only=True),
    # issue 21 session 6: with a dense prefill the decode alone still lost on test (0.5B dps -1.8, 1.5B -1.7), and a
    # 20% decode budget did not help the 0.5B (-2.0). Which part of the decode loses: the kernels' numerics
    # (every key selected), the anchors (more of them, later in the stack), or the reuse (--strategies=oracle_topk
    # with dps: every layer its own Top-k)?
    "dps_dec100": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, decode_topk_frac=1.0),
    "dps_m8s": dict(num_anchors=8, calib_importance="sqrt", sink_tokens=4, recent_window=60, decode_only=True),
    "dps_m7n": dict(num_anchors=7, calib_importance="none", sink_tokens=4, recent_window=60, decode_only=True),
    # issue 21 session 7: every layer its own Top-k with a dense prefill is at dense (0.5B -0.4, 1.5B +0.3 on dev),
    # so the decode's loss is which anchor a layer reuses; but the DP's extra anchors (M=7/8, 16K statistics: all
    # with anchor 13 on the 0.5B) lost niah_multikey_2 (70 -> 20-40: digits miscopied). The DP's statistic is the
    # worst tile of the whole prompt; a decode step reads from the prompt's end: the DP on the last tiles only
    "dps_tail": dict(num_anchors=5, calib_reduce="tail", sink_tokens=4, recent_window=60, decode_only=True),
    "dps_m7t": dict(num_anchors=7, calib_reduce="tail", calib_importance="sqrt", sink_tokens=4, recent_window=60,
                    decode_only=True),
    # ... and with each calibration prompt followed by its gold answer, so the last tiles copy from the needles
    "dps_tail_ans": dict(num_anchors=5, calib_reduce="tail", calib_dataset="builtin_answers", sink_tokens=4,
                         recent_window=60, decode_only=True),
    "dps_m7t_ans": dict(num_anchors=7, calib_reduce="tail", calib_importance="sqrt", calib_dataset="builtin_answers",
                        sink_tokens=4, recent_window=60, decode_only=True),
    # issue 21 session 8 (CPU probe, 0.5B at 4K on niah_multikey_2/3 and vt): a reuse layer keeps 0.835 of its
    # decode mass with its anchor's Top-k, 0.934 with its own; neither a better source anchor (0.845) nor the
    # selected keys' neighbours (0.820 at the same budget) close the gap, but its own Top-k among the anchor's top
    # 2k / 4k keys keeps 0.872 / 0.905. Each reuse layer then reads C k K rows and k V rows.
    "dps_rr2": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, decode_rerank=2),
    "dps_rr4": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, decode_rerank=4),
    # ... and only in the reuse layers the calibration finds least like their anchor (the 0.5B's worst five by the
    # calibration are 13, 16, 21, 22, 23; by the probe 13, 20-23). On the probe's 4K numbers (mass / estimated
    # decode speedup at 32K): rr4 0.904 / 2.57x, rr2 0.872 / 3.28x, rr4w8 0.880 / 3.16x, rr4w5 0.868 / 3.38x, dps
    # 0.835 / 3.81x
    "dps_rr4w5": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, decode_rerank=4,
                      decode_rerank_worst=5),
    "dps_rr4w8": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, decode_rerank=4,
                      decode_rerank_worst=8),
    # issue 21 session 10 (H200 dev, 0.5B, paired against dps): rr4 +0.8, rr2 +0.6, and dps_tail_ans +0.9 (the same
    # anchors 0,1,3,5,9 with the answers calibration's head map): the two levers act on different things (which
    # anchor head a layer reads; its own order among the candidates), so together. Not run: on the CPU shift probe
    # that head map keeps no more decode mass (0.841 vs 0.839), so its +0.9 is most likely noise
    "dps_tans_rr4": dict(num_anchors=5, calib_reduce="tail", calib_dataset="builtin_answers", sink_tokens=4,
                         recent_window=60, decode_only=True, decode_rerank=4),
    # issue 21 session 14 (H200, 0.5B, 16K dev): one Top-k set per anchor pooled over all query heads and shared by
    # both KV heads (the all_heads_pooled strategy) was +3.0 [+0.7, +5.5] over dps, at dense: as recipes, with a
    # dense prefill and with the 0.5B's sparse-prefill default
    "dps_all": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all"),
    "ds512s_all": dict(num_anchors=5, sink_tokens=4, recent_window=60, dense_suffix=512, pool="all"),
    # session 15: dps_all shipped for both Qwens (test 0.5B -1.1 to -1.7, 1.5B 8K -3.4); more anchors with the
    # shared set (each extra anchor costs about 1/L of the decode)
    "dps_all_m6": dict(num_anchors=6, sink_tokens=4, recent_window=60, decode_only=True, pool="all"),
    "dps_all_m7": dict(num_anchors=7, sink_tokens=4, recent_window=60, decode_only=True, pool="all"),
    # session 16: more anchors did not help (1.5B 8K dev: M6 -4.6, M7 -5.2 vs M5 -4.8); each layer's own Top-k did
    # (1.5B 8K test -0.4). A larger decode budget is the rerank's kernel-free neighbour: on the CPU probe the anchor's
    # Top-2k keeps as much of a reuse layer's mass as its own Top-k among them (4K: 0.889 vs 0.882 with the 0.5B's
    # dps_all, 0.887 vs 0.879 with the 1.5B's dps)
    "dps_all_dec20": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                          decode_topk_frac=0.2),
    "dps_all_dec30": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                          decode_topk_frac=0.3),
    # session 27 (issue 21 item 4 / issue 22 item 3): the shipped defaults with the decode anchors scoring on an fp8
    # K copy (half the anchor pass's bytes; the CPU probe kept 0.9999 of the exact Top-k's mass on both Qwens)
    "dps_all_dec20_fp8d": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                               decode_topk_frac=0.2, decode_score_fp8=True),
    "dps_all_dec30_fp8d": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                               decode_topk_frac=0.3, decode_score_fp8=True),
    # session 35: dps_all (10% in decode) with the copy, to pair with the 1.5B's 32K dev cells of 30% and of a key floor
    "dps_all_fp8d": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                         decode_score_fp8=True),
    # session 16, SmolLM2-135M (30 layers) only: anchor sets found by accuracy on its 4K dev split, pinned (the DP
    # never places one between 15 and 23, and layer 18 carries the model: 0,2,8,18 -6.0, 0,2,8,20 -31.5;
    # 0,2,8,18,21 -3.4), with dps's levers and calibrated head map, so that --mode=choose can ship one
    "smol_p4": dict(num_anchors=4, anchors=(0, 2, 8, 18), sink_tokens=4, recent_window=60, decode_only=True),
    "smol_p5": dict(num_anchors=5, anchors=(0, 2, 8, 18, 21), sink_tokens=4, recent_window=60, decode_only=True),
    "smol_p5b": dict(num_anchors=5, anchors=(0, 2, 8, 18, 19), sink_tokens=4, recent_window=60, decode_only=True),
    "smol_p6": dict(num_anchors=6, anchors=(0, 2, 8, 18, 21, 24), sink_tokens=4, recent_window=60, decode_only=True),
    "smol_p6b": dict(num_anchors=6, anchors=(0, 2, 5, 8, 18, 21), sink_tokens=4, recent_window=60, decode_only=True),
    "smol_p6c": dict(num_anchors=6, anchors=(0, 2, 8, 13, 18, 21), sink_tokens=4, recent_window=60, decode_only=True),
    # session 18: smol_p6 shipped (test 4K -5.2, 8K -3.5, blind) while each layer's own Top-k is at dense (4K dev
    # -0.5, 8K -0.7) and the rerank recovers most of it (0,2,8,18 + rr4: -2.0 / -1.1): the loss is which keys the
    # reuse reads, so the rerank's kernel-free neighbour, a larger decode budget, as it did for the 1.5B
    "smol_p6_dec20": dict(num_anchors=6, anchors=(0, 2, 8, 18, 21, 24), sink_tokens=4, recent_window=60,
                          decode_only=True, decode_topk_frac=0.2),
    "smol_p6_dec30": dict(num_anchors=6, anchors=(0, 2, 8, 18, 21, 24), sink_tokens=4, recent_window=60,
                          decode_only=True, decode_topk_frac=0.3),
    # session 19: the tail probe at 16K (0.5B, teacher-forced answers) put fwe's loss in the unselected keys' mass:
    # each layer's own Top-10% -0.48 nats, + a sampled tail (every 20th unselected key weighted by 20) -0.003, the
    # same keys unweighted -0.46; the tail was the closest to dense on cwe, niah_multikey_2 and vt as well. The
    # defaults with that tail (decode_tail_stride, plain JAX around the reuse kernel for now)
    "dps_all_tail20": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                           decode_tail_stride=20),
    "dps_all_dec30_tail20": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                                 decode_topk_frac=0.3, decode_tail_stride=20),
    "smol_p6_tail20": dict(num_anchors=6, anchors=(0, 2, 8, 18, 21, 24), sink_tokens=4, recent_window=60,
                           decode_only=True, decode_tail_stride=20),
    "smol_p6_dec30_tail20": dict(num_anchors=6, anchors=(0, 2, 8, 18, 21, 24), sink_tokens=4, recent_window=60,
                                 decode_only=True, decode_topk_frac=0.3, decode_tail_stride=20),
    # session 19, measured: the tail lost over the reuse layers' anchor selections (0.5B dev 16K / 8K -4.0 / -7.5,
    # dps_all +0.1 / -2.0; fwe answers repeating a word) and helped over each layer's own (CPU, fwe 2K: oracle_topk
    # 0.50 -> 0.63). Capped: a sampled key that reaches the row's lightest selected logit counts once
    "dps_all_tailc20": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                            decode_tail_stride=20, decode_tail_cap=True),
    "smol_p6_dec30_tailc20": dict(num_anchors=6, anchors=(0, 2, 8, 18, 21, 24), sink_tokens=4, recent_window=60,
                                  decode_only=True, decode_topk_frac=0.3, decode_tail_stride=20, decode_tail_cap=True),
    # session 20, to measure in 21 (hypothesis): the last three layers dense in decode (the 0.5B's reuse layers that
    # keep the least of their own mass) close part of dps_all's decode loss
    "dps_all_dl3": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                        decode_dense_layers=(-3, -2, -1)),
    # hypothesis, as dps_all_dl3: the last layer alone (nearest the logits) at a third of its cost
    "dps_all_dl1": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                        decode_dense_layers=(-1,)),
    # hypothesis (NOTES, "A lever for a later session"): each reuse layer's own Top-5% from the prefill's last tile
    # (the question) closes part of the anchors' 2-point loss on the 0.5B, +1 to +2 over dps_all at 16K
    "dps_all_pk5": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                        decode_prefill_keys=0.05),
    # hypothesis, as dps_all_pk5 with 10%: more of the question's keys, at twice the extra reuse cost
    "dps_all_pk10": dict(num_anchors=5, sink_tokens=4, recent_window=60, decode_only=True, pool="all",
                         decode_prefill_keys=0.10),
    # session 21, measured (0.5B, 16K, three dev draws, 780 prompts, paired vs dps_all): dec20 +0.6 [-0.4, +1.7]
    # (-0.9 vs dense: chosen on the pooled dev split), dl3 -0.1, dl1 -0.3, pk5 -0.6 (fwe -8), oracle +1.0
}


def shipped_defaults() -> list[str]:
    """One line per shipped default recipe (for --help): its fields, what it measured on dev, its estimated speed."""
    lines = []
    for path in sorted(RECIPE_DIR.glob("*.json")):
        doc = json.loads(path.read_text())
        r = Recipe.from_dict(doc["default"], "default")
        on = r.describe().split(" ", 1)[1]  # without "recipe=default"
        m = next((x for x in doc.get("measured", []) if x.get("recipe") == doc.get("chosen_from")), None)
        here, borrowed = doc.get("measured_on_this_model"), "applied unchanged to" in r.note
        how = ""
        if here is not None:
            how = f"; dev {here['dev_diff_vs_dense']:+.1f} vs dense on {here['dev_n']} prompts of this model"
        elif m is not None and m.get("dev_diff_vs_dense") is not None and not borrowed:
            how = f"; dev {m['dev_diff_vs_dense']:+.1f} vs dense on {m['dev_n']} prompts"
        if m is not None and m.get("decode_speedup"):
            src = ("attention speedup from kernels measured at its shape" if doc.get("speed", "").startswith(
                "measured") else "est. attention speedup")
            how += (f", {src} at {doc.get('context', '?')} tokens: decode {m['decode_speedup']:.2f}x, prefill "
                    f"{m['prefill_speedup']:.2f}x")
        t = doc.get("test")
        if t is not None and t.get("recipe") == doc.get("chosen_from"):  # a later choice drops an older test
            at = f" at {t['context']} tokens" if t.get("context") not in (None, doc.get("context")) else ""
            how += (f"; test {t['diff_vs_dense']:+.1f} [{t['diff_ci'][0]:+.1f}, {t['diff_ci'][1]:+.1f}] vs dense on "
                    f"{t['n']} prompts{at}" + (", known before the choice" if t.get("blind") is False else ""))
        if borrowed:
            how += "; chosen on another model's dev split, not tuned on this one"
        lines.append(f"{path.stem}: {doc.get('chosen_from', 'default')} ({on}{how})")
    return lines


def candidate(name: str) -> Recipe:
    if name not in CANDIDATES:
        raise ValueError(f"unknown candidate recipe {name!r}; have {sorted(CANDIDATES)}")
    return Recipe(name=name, **CANDIDATES[name])
