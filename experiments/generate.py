"""Generate text: `python -m experiments.generate --model=smollm2-135m --prompt="What is the capital of France?"`.

Any strategy runs through the same prefill/decode code, e.g. `--strategy=kascade --anchors=0,4,12,20 --topk_frac=0.1`.
"""

from __future__ import annotations

import time

from absl import app, flags

from experiments import cli, common, devices, recipe_flags

PROMPT = flags.DEFINE_string("prompt", None, "Prompt text (chat template applied unless --nochat).")
PROMPT_FILE = flags.DEFINE_string("prompt_file", None, "Read the prompt from this file instead.")
MAX_NEW = flags.DEFINE_integer("max_new_tokens", 128, "Tokens to generate at most.")
TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "Sampling temperature (0 = greedy).")
TOP_P = flags.DEFINE_float("top_p", 1.0, "Nucleus sampling threshold.")
TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the top_k tokens only (0 = off).")
SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
STOP = flags.DEFINE_multi_string("stop", [], "Stop string (repeatable).")
CHAT = flags.DEFINE_boolean("chat", True, "Apply the model's chat template.")
STRATEGY = flags.DEFINE_string("strategy", "dense", "Attention strategy: dense, kascade, oracle_topk, no_remap, "
                               "all_heads_pooled, pre_softmax_pooling, decode_only, streaming_llm, quest, omnikv, less_is_more.")


def _read_prompt(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --prompt_file={path}: {getattr(e, 'strerror', None) or e}") from None


def main(argv):
    del argv
    from kascade_jax.registry import KASCADE_FAMILY
    from models import load_model
    from models.generate import check_sampling, generate

    if (PROMPT.value is None) == (PROMPT_FILE.value is None):
        raise app.UsageError("give exactly one of --prompt or --prompt_file")
    check_sampling(TEMPERATURE.value, TOP_P.value, TOP_K.value)  # before the model loads; generate() checks top_k <= vocab
    mesh = devices.setup()
    devices.check_batch(1, mesh)  # one prompt: a mesh may split the heads, not the batch
    text = PROMPT.value if PROMPT.value is not None else _read_prompt(PROMPT_FILE.value)
    common.check_strategy_flags(STRATEGY.value)
    model, tok = load_model(common.MODEL.value, common.DTYPE.value)
    ids = tok.encode_chat([{"role": "user", "content": text}]) if CHAT.value else tok.encode(text)
    if STRATEGY.value in KASCADE_FAMILY:  # before build_strategy, which may calibrate
        recipe_flags.check_levers_fit([common.recipe()], len(ids), f"of {len(ids)} tokens")
    strategy = common.build_strategy(STRATEGY.value, model, tok)
    model = devices.place(model, mesh)
    common.print_strategy(strategy)  # what `auto` chose, and which kernels run
    t0 = time.perf_counter()
    (res,) = generate(model, tok, [ids], strategy, max_new_tokens=MAX_NEW.value, temperature=TEMPERATURE.value,
                      top_p=TOP_P.value, top_k=TOP_K.value, seed=SEED.value, stop=tuple(STOP.value), chat=CHAT.value,
                      chunk_size=common.CHUNK.value)
    dt = time.perf_counter() - t0
    print(res.text)
    print(f"[{strategy.name}] prompt {res.prompt_tokens} tokens, {res.new_tokens} new tokens, {dt:.2f} s "
          f"(incl. compile), finish: {res.finish_reason}", flush=True)


if __name__ == "__main__":
    cli.run(main)
