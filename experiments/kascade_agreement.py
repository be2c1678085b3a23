"""Per-token agreement of Kascade greedy decoding with dense greedy decoding on one long document.

`python -m experiments.kascade_agreement --doc=my_long_doc.txt --doc_tokens=4000` (default document: prose built from
Python standard-library docstrings, kascade_jax.tasks.prose)

The document (truncated to --doc_tokens tokens) is wrapped in a chat prompt asking for a summary. Dense greedy decoding
gives the reference continuation of --new_tokens tokens. For each --topk_fracs value, Kascade (--anchors,
--head_map; or any --strategies of kascade_jax.registry, oracle_topk selecting in every layer) is measured two ways:
- teacher-forced: Kascade prefills the prompt, then decodes the *dense* continuation token by token; agreement =
  share of steps whose Kascade argmax equals the dense token (the prefill's last logits count as step 0);
- free-running: Kascade greedy-generates on its own; we report the length of the common prefix with the dense
  output and the positional match rate.
Writes JSON and a Markdown table to --out (default runs/kascade_agreement.{json,md}; an existing one needs
--overwrite). Every flag, the document included, is checked before the model loads.

`--anchors=auto` takes the model's shipped default recipe (`calibration.resolve.recipe_kascade`, the path of
`experiments.common.build_strategy`): the DP anchors of its calibration (or those the recipe pins) with their
calibrated head map (unless --head_map names one; --head_map=identity for none) and its levers (sink_tokens,
recent_window, dense_suffix); the meta records anchors, head map and recipe. Explicit anchors run without levers,
with --head_map (default identity; auto: the calibrated map for those anchors). --anchors is checked before the
model loads.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time

from absl import flags

from experiments import cli

DOC = flags.DEFINE_string("doc", None, "Text file with the long document (default: built-in stdlib prose).")
DOC_TOKENS = flags.DEFINE_integer("doc_tokens", 4000, "Truncate the document to this many tokens.", lower_bound=1)
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 64, "Tokens decoded after the prompt.", lower_bound=1)
MODEL = flags.DEFINE_string("model", "smollm2-135m", "Model alias or path.")
ANCHORS = flags.DEFINE_string("anchors", "0,4,12,20", "Kascade anchor layers, as everywhere: 'auto' (the DP's "
                              "choice on the model's calibration), 'even' (5 evenly spaced), '' (the paper's scaled "
                              "to depth) or a list like 0,4,12,20")
HEAD_MAP = flags.DEFINE_string("head_map", None, "Head map: identity, auto (the calibrated map), or a .npy/.json "
                                "path (default: auto with --anchors=auto, else identity).")
FRACS = flags.DEFINE_list("topk_fracs", ["0.1", "0.2"], "Top-k fractions to measure.")
STRATEGIES = flags.DEFINE_list("strategies", ["kascade"], "Strategy names (kascade_jax.registry) to measure.")
FREE = flags.DEFINE_boolean("free_running", True, "Also measure free-running greedy generation.")
MIN_K = flags.DEFINE_integer("min_k", 128, "Minimum Top-k budget.")
TILE = flags.DEFINE_integer("tile_size", 32, "Prefill query tile.")
CHUNK = flags.DEFINE_integer("chunk_size", 1024, "Prefill chunk size (multiple of 64).")
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


def resolve_kascade(model, tok, anchors_flag: str, head_map_flag: str | None, model_name: str, tile_size: int,
                    dtype: str = "float32"):
    """(anchors, head_map rows or None, levers dict, description) from the flag values (see the module docstring)."""
    from kascade_jax.calibration.resolve import parse_anchors, recipe_kascade, resolve_head_map

    cfg = model.config
    chosen = parse_anchors(anchors_flag, cfg.num_layers)
    hm_flag = head_map_flag or ("auto" if chosen == "auto" else "identity")
    if chosen == "auto":
        kw, desc = recipe_kascade(model_name, cfg.num_layers, cfg.kv_heads, dtype=dtype, tile_size=tile_size,
                                  model=model, tokenizer=tok)
        chosen = kw["anchors"]
        levers = {f: v for f, v in kw.items() if f not in ("anchors", "head_map", "tile_size")}  # --tile_size rules
        auto_map = kw["head_map"]
    else:
        levers, desc, auto_map = {}, f"anchors {list(chosen)} (--anchors), no recipe levers", None
    if hm_flag == "identity":
        head_map = None
    else:
        from kascade_jax.recipes import load_recipe

        calib = load_recipe(model_name, "default").calibration_kwargs(dtype)
        hm = resolve_head_map(hm_flag, chosen, cfg.num_layers, cfg.kv_heads, auto_map=auto_map, model=model,
                              tokenizer=tok, model_name=model_name, tile_size=tile_size, **calib)
        head_map = tuple(tuple(int(h) for h in row) for row in hm)
    return tuple(chosen), head_map, levers, f"{desc}; head_map {hm_flag}"


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

    from kascade_jax.calibration.resolve import parse_anchors
    from kascade_jax.registry import KASCADE_FAMILY, make_strategy
    from models import generate as gen
    from models import load_model
    from models.attention import DenseStrategy

    # Everything that can be checked without the model, before it loads (a dense pass takes minutes on a CPU).
    parse_anchors(ANCHORS.value, 1 << 20)  # the syntax (the layer range once the model has loaded)
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
    cfg = model.config
    doc_ids = tok.encode(text)[: DOC_TOKENS.value]
    question = "\n\nSummarize the document above in a few sentences."
    prompt = tok.encode_chat([{"role": "user", "content": tok.decode(doc_ids) + question}])
    print(f"prompt: {len(prompt)} tokens", flush=True)

    t0 = time.perf_counter()
    (dense,) = gen.generate(model, tok, [prompt], DenseStrategy(), max_new_tokens=NEW_TOKENS.value, chat=False,
                            chunk_size=CHUNK.value)
    dense_ids = dense.token_ids
    print(f"dense: {len(dense_ids)} tokens in {time.perf_counter() - t0:.1f}s: {dense.text[:300]!r}", flush=True)
    chosen, head_map, levers, kdesc = resolve_kascade(model, tok, ANCHORS.value, HEAD_MAP.value, MODEL.value,
                                                      TILE.value)
    print(f"kascade ({ANCHORS.value or 'registry default'}): {kdesc}", flush=True)
    rows = []
    for name, frac in [(n, f) for n in STRATEGIES.value for f in fracs]:
        anchors = tuple(chosen) if name != "oracle_topk" else None
        strategy = make_strategy(name, cfg.num_layers, cfg.kv_heads, anchors=anchors, head_map=head_map,
                                 topk_frac=frac, min_k=MIN_K.value, tile_size=TILE.value, **levers)
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
                doc=DOC.value or "builtin prose", prompt_tokens=len(prompt), new_tokens=NEW_TOKENS.value, anchors=list(chosen),
                head_map=[list(r) for r in head_map] if head_map else "identity",
                head_map_flag=HEAD_MAP.value or ("auto" if ANCHORS.value == "auto" else "identity"), kascade=kdesc,
                levers=levers, min_k=MIN_K.value, tile_size=TILE.value, dense_text=dense.text)
    os.makedirs(os.path.dirname(OUT.value) or ".", exist_ok=True)
    with open(OUT.value + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=2)
    with open(OUT.value + ".md", "w") as f:
        f.write(f"# Kascade vs dense greedy agreement ({meta['date']}, {meta['device']}, JAX {meta['jax']})\n\n")
        f.write(f"`{meta['command']}`  \nmodel {MODEL.value}, prompt {len(prompt)} tokens, {len(dense_ids)} decoded "
                f"tokens, anchors {list(chosen)}, head_map {meta['head_map_flag']}, {kdesc}, min_k {MIN_K.value}, "
                f"tile {TILE.value}\n\n")
        f.write("| strategy | topk_frac | teacher-forced agreement | free-running common prefix | "
                "free-running positional match |\n|---|---|---|---|---|\n")
        for r in rows:
            f.write(f"| {r['strategy']} | {r['topk_frac']} | {r['teacher_forced_agreement']:.3f} ({r['steps']} steps) | "
                    f"{r.get('free_common_prefix', '-')} | {r.get('free_positional_match', float('nan')):.3f} |\n")
    print(open(OUT.value + ".md").read())


if __name__ == "__main__":
    cli.run(main)
