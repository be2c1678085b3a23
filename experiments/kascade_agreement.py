"""Per-token agreement of Kascade greedy decoding with dense greedy decoding on one long document.

`python -m experiments.kascade_agreement --doc=my_long_doc.txt --doc_tokens=4000` (default document: prose built from
Python standard-library docstrings, kascade_jax.tasks.prose)

The document (truncated to --doc_tokens tokens) is wrapped in a chat prompt asking for a summary. Dense greedy decoding
gives the reference continuation of --new_tokens tokens. For each --topk_fracs value, each of --strategies (Kascade
family; oracle_topk selects in every layer) is measured two ways:
- teacher-forced: Kascade prefills the prompt, then decodes the *dense* continuation token by token; agreement =
  share of steps whose Kascade argmax equals the dense token (the prefill's last logits count as step 0);
- free-running: Kascade greedy-generates on its own; we report the length of the common prefix with the dense
  output and the positional match rate.
Writes JSON and a Markdown table to --out (default runs/kascade_agreement.{json,md}; an existing one needs
--overwrite).

`--anchors=auto` (the default) is the model's Kascade exactly as `kascade_jax.strategy_for` and the other entry
points build it: the --recipe (default 'default') with the recipe flags on top, its anchors, calibrated head map and
levers. Explicit anchors (`--anchors=0,4,12,20`, 'even', '') run without recipe levers, with --head_map (default
identity); a flag the chosen path would ignore is refused. Every flag, the document included, is checked before the
model loads (a dense pass takes minutes on a CPU).
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from absl import flags

from experiments import cli, recipe_flags

DOC = flags.DEFINE_string("doc", None, "Text file with the long document (default: built-in stdlib prose).")
DOC_TOKENS = flags.DEFINE_integer("doc_tokens", 4000, "Truncate the document to this many tokens.", lower_bound=1)
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens decoded after the prompt.", lower_bound=1)
MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model alias or path.")
ANCHORS = recipe_flags.ANCHORS
HEAD_MAP = flags.DEFINE_string("head_map", None, "Head map of explicit --anchors: identity (default), auto (the "
                               "calibrated map for those anchors) or a .npy/.json path; --anchors=auto takes the "
                               "recipe's.")
FRACS = flags.DEFINE_list("topk_fracs", ["0.1", "0.2"], "Top-k fractions to measure.")
STRATEGIES = flags.DEFINE_list("strategies", ["kascade"], "Strategy names (kascade_jax.registry) to measure.")
FREE = flags.DEFINE_boolean("free_running", True, "Also measure free-running greedy generation.")
MIN_K = flags.DEFINE_integer("min_k", 128, "Minimum Top-k budget.")
TILE = flags.DEFINE_integer("tile_size", None, "Prefill query tile (default: the recipe's with --anchors=auto, "
                            "else 32).")
CHUNK = flags.DEFINE_integer("chunk_size", 1024, "Prefill chunk size (multiple of 64).")
KERNELS = flags.DEFINE_enum("kernels", "reference", ["reference", "pallas"], "Kascade-family kernels, as "
                            "experiments.eval: the pure-JAX reference semantics, or the Pallas GPU kernels "
                            "(bf16/fp16 on a GPU; their references elsewhere)")
OUT = flags.DEFINE_string("out", "runs/kascade_agreement", "Output path prefix (.json and .md are written).")


def _teacher_forced(model, prompt, continuation, strategy, chunk_size):
    """Argmax tokens of `strategy` at each step of decoding `continuation` after `prompt` (len(continuation) + 1)."""
    import jax.numpy as jnp
    import numpy as np

    from models import generate as gen
    from models.cache import KVCache

    max_len = -(-(len(prompt) + len(continuation) + 1) // 64) * 64
    cache = KVCache.init(model.config, 1, max_len, jnp.float32)
    logits, cache = gen.prefill(model, np.array([prompt]), [len(prompt)], cache, strategy, chunk_size=chunk_size)
    preds = [int(jnp.argmax(logits[0]))]
    for tok in continuation:
        logits, cache = gen.decode_step(model, np.array([tok]), cache, strategy)
        preds.append(int(jnp.argmax(logits[0])))
    return preds


def _auto() -> bool:
    return ANCHORS.value.strip() == "auto"


def recipe():
    """The --recipe for --model with the recipe flags on top (as every entry point), and an explicit --tile_size."""
    return recipe_flags.resolve_recipe(MODEL.value).replace(tile_size=TILE.value)


def check_kascade_flags() -> None:
    """Before the model loads: --anchors' syntax, the recipe (its file, the recipe flags), and no flag that the
    chosen path would silently ignore."""
    from kascade_jax.calibration.resolve import parse_anchors
    from kascade_jax.recipes import LEVERS

    parse_anchors(ANCHORS.value, 1 << 20)  # the syntax (the layer range once the model has loaded)
    recipe()
    if _auto():
        unused = [f"--head_map={HEAD_MAP.value}"] if HEAD_MAP.value not in (None, "auto") else []
        unused += ["--recalibrate"] if recipe_flags.RECALIBRATE.value else []
        why = ("--anchors=auto is kascade_jax.strategy_for's Kascade: the recipe's anchors, with the head map of its "
               "shipped or cached calibration")
    else:
        unused = [f"--{n}" for n in (*LEVERS, "decode_rerank_worst") if n != "tile_size" and flags.FLAGS[n].present]
        why = f"explicit --anchors={ANCHORS.value} run without recipe levers"
    if unused:
        raise ValueError(f"{', '.join(unused)}: not used here: {why}")


def kascade_strategy(name: str, model, tok, topk_frac: float, *, verbose: bool = True):
    """The Kascade-family strategy `name` from the flags (see the module docstring)."""
    import kascade_jax
    from kascade_jax.calibration.resolve import resolve_recipe_flags
    from kascade_jax.registry import make_strategy

    cfg = model.config
    if _auto():
        return kascade_jax.strategy_for(model, name, recipe=recipe(), model_name=MODEL.value, tokenizer=tok,
                                        topk_frac=topk_frac, min_k=MIN_K.value, kernels=KERNELS.value,
                                        verbose=verbose)
    anchors, head_map, _ = resolve_recipe_flags(MODEL.value, recipe(), ANCHORS.value, HEAD_MAP.value or "",
                                                num_layers=cfg.num_layers, kv_heads=cfg.kv_heads, tile_size=TILE.value,
                                                recalibrate=recipe_flags.RECALIBRATE.value, model=model,
                                                tokenizer=tok)
    return make_strategy(name, cfg.num_layers, cfg.kv_heads, anchors=anchors, head_map=head_map, topk_frac=topk_frac,
                         min_k=MIN_K.value, tile_size=TILE.value, kernels=KERNELS.value)


def _fracs(values) -> list[float]:
    """--topk_fracs as numbers in (0, 1], or one line naming the bad item."""
    out = []
    for v in values:
        try:
            f = float(v)
        except ValueError:
            raise ValueError(f"--topk_fracs: {v!r} is not a number") from None
        if not 0 < f <= 1:
            raise ValueError(f"--topk_fracs: {v!r} is outside (0, 1]")
        out.append(f)
    if not out:
        raise ValueError("--topk_fracs is empty")
    return out


def main(argv):
    del argv
    import jax

    from kascade_jax.registry import KASCADE_FAMILY
    from models import generate as gen
    from models import load_model
    from models.attention import DenseStrategy

    # Everything that can be checked without the model, before it loads (a dense pass takes minutes on a CPU).
    check_kascade_flags()
    fracs = _fracs(FRACS.value)
    bad = [n for n in STRATEGIES.value if n not in KASCADE_FAMILY]
    if bad or not STRATEGIES.value:
        raise ValueError(f"--strategies takes Kascade-family names {list(KASCADE_FAMILY)}, got {STRATEGIES.value}")
    cli.check_output([OUT.value + ".json", OUT.value + ".md"], "--out")
    if DOC.value:
        text = cli.read_text_file(DOC.value, "--doc")
        if not text.strip():
            raise ValueError(f"--doc {DOC.value!r} is empty: agreement on an empty document means nothing")
    else:
        from kascade_jax.tasks.prose import prose_sentences

        text = " ".join(prose_sentences())
    model, tok = load_model(MODEL.value, "float32")
    doc_ids = tok.encode(text)[: DOC_TOKENS.value]
    question = "\n\nSummarize the document above in a few sentences."
    prompt = tok.encode_chat([{"role": "user", "content": tok.decode(doc_ids) + question}])
    if _auto():  # (explicit anchors run without levers)
        recipe_flags.check_levers_fit([recipe()], len(prompt), f"of {len(prompt)} tokens")
    # built before the dense pass, so a calibration error does not come minutes in; the first one prints the recipe
    runs = [(n, f, kascade_strategy(n, model, tok, f, verbose=not i))
            for i, (n, f) in enumerate((n, f) for n in STRATEGIES.value for f in fracs)]
    kcfg = runs[0][2].config
    kdesc = (f"{recipe().describe()} (kascade_jax.strategy_for)" if _auto() else
             f"--anchors={ANCHORS.value}, no recipe levers")
    hm_flag = "auto" if _auto() else HEAD_MAP.value or "identity"
    print(f"kascade: {kdesc}; anchors {list(kcfg.anchors)}, head_map {hm_flag}, kernels {KERNELS.value}", flush=True)
    print(f"prompt: {len(prompt)} tokens", flush=True)

    t0 = time.perf_counter()
    (dense,) = gen.generate(model, tok, [prompt], DenseStrategy(), max_new_tokens=NEW_TOKENS.value, chat=False,
                            chunk_size=CHUNK.value)
    dense_ids = dense.token_ids
    print(f"dense: {len(dense_ids)} tokens in {time.perf_counter() - t0:.1f}s: {dense.text[:300]!r}", flush=True)
    rows = []
    for name, frac, strategy in runs:
        t0 = time.perf_counter()
        preds = _teacher_forced(model, prompt, dense_ids[:-1], strategy, CHUNK.value)
        forced = sum(p == d for p, d in zip(preds, dense_ids)) / len(dense_ids)
        row = dict(strategy=name, topk_frac=frac, teacher_forced_agreement=forced, steps=len(dense_ids))
        if FREE.value:
            (free,) = gen.generate(model, tok, [prompt], strategy, max_new_tokens=NEW_TOKENS.value, chat=False,
                                   chunk_size=CHUNK.value)
            common = next((i for i, (a, b) in enumerate(zip(free.token_ids, dense_ids)) if a != b),
                          min(len(free.token_ids), len(dense_ids)))
            positional = sum(a == b for a, b in zip(free.token_ids, dense_ids)) / max(len(dense_ids), 1)
            row.update(free_common_prefix=common, free_positional_match=positional, free_text=free.text)
        row["seconds"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
        rows.append(row)

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=str(jax.devices()[0]), jax=jax.__version__, command=" ".join(sys.argv), model=MODEL.value,
                doc=DOC.value or "builtin prose", prompt_tokens=len(prompt), new_tokens=NEW_TOKENS.value,
                anchors=list(kcfg.anchors), head_map=[list(r) for r in kcfg.head_map] if kcfg.head_map else "identity",
                head_map_flag=hm_flag, kascade=kdesc, levers=recipe().levers() if _auto() else {},
                kernels=KERNELS.value, min_k=MIN_K.value, tile_size=kcfg.tile_size, dense_text=dense.text)
    os.makedirs(os.path.dirname(OUT.value) or ".", exist_ok=True)
    with open(OUT.value + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    with open(OUT.value + ".md", "w") as f:
        f.write(f"# Kascade vs dense greedy agreement ({meta['date']}, {meta['device']}, JAX {meta['jax']})\n\n")
        f.write(f"`{meta['command']}`  \nmodel {MODEL.value}, prompt {len(prompt)} tokens, {len(dense_ids)} decoded "
                f"tokens, anchors {meta['anchors']}, head_map {hm_flag}, {kdesc}, kernels {KERNELS.value}, "
                f"min_k {MIN_K.value}, tile {kcfg.tile_size}\n\n")
        f.write("| strategy | topk_frac | teacher-forced agreement | free-running common prefix | "
                "free-running positional match |\n|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['strategy']} | {r['topk_frac']} | {r['teacher_forced_agreement']:.3f} ({r['steps']} steps) | "
                    f"{r.get('free_common_prefix', '-')} | {r.get('free_positional_match', float('nan')):.3f} |\n")
    print(open(OUT.value + ".md").read())


if __name__ == "__main__":
    cli.run(main)
