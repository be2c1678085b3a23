"""End-to-end model throughput: prefill tokens/s and decode tokens/s of `generate`'s jitted loop.

`python -m experiments.speed --model=smollm2-135m --batch=1 --prompt_len=1024 --new_tokens=128 [--strategy=kascade ...]`

Wall-clock over many steps after a warm-up run (compile excluded, results fetched to the host, so the device work
is complete); this times whole-model steps, not kernels — kernel timings use CUPTI in `experiments.bench`.
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import numpy as np
from absl import flags

from experiments import cli, common, devices, recipe_flags
from kascade_jax.registry import KASCADE_FAMILY

BATCH = flags.DEFINE_integer("batch", 1, "Sequences per batch.", lower_bound=1)
PROMPT_LEN = flags.DEFINE_integer("prompt_len", 1024, "Prompt tokens per sequence (random ids).", lower_bound=1)
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "Decode steps timed.", lower_bound=1)
STRATEGY = flags.DEFINE_string("strategy", "dense", "Attention strategy name.")
REPEATS = flags.DEFINE_integer("repeats", 3, "Timed repetitions (median reported).", lower_bound=1)
OUT = flags.DEFINE_string("out", None, "Optional JSON output file (an existing one needs --overwrite).")


def main(argv):
    del argv
    from models import load_model
    from models import generate as gen
    from models.sharding import init_cache

    if OUT.value:
        if os.path.isdir(OUT.value):
            raise ValueError(f"--out {OUT.value!r} is a directory: give a file path, e.g. {OUT.value.rstrip('/')}/speed.json")
        cli.check_output([OUT.value], "--out")
    mesh = devices.setup()
    devices.check_batch(BATCH.value, mesh)
    common.check_strategy_flags(STRATEGY.value)
    if STRATEGY.value in KASCADE_FAMILY:
        recipe_flags.check_levers_fit([common.recipe()], PROMPT_LEN.value, f"at --prompt_len={PROMPT_LEN.value}")
    model, tok = load_model(common.MODEL.value, common.DTYPE.value)
    strategy = common.build_strategy(STRATEGY.value, model, tok)
    model = devices.place(model, mesh)
    common.print_strategy(strategy)
    rng = np.random.default_rng(0)
    b, p, n = BATCH.value, PROMPT_LEN.value, NEW_TOKENS.value
    prompts = rng.integers(100, model.config.vocab - 100, (b, p)).tolist()
    max_len = -(-(p + n + 1) // 64) * 64

    def run_prefill():
        cache = init_cache(model, b, max_len)
        logits, cache = gen.prefill(model, np.array(prompts), [p] * b, cache, strategy, chunk_size=common.CHUNK.value)
        jax.block_until_ready(logits)
        return cache

    def run_generate():
        # eos=() through a tokenizer without EOS ids, so every sequence decodes exactly n tokens
        class NoEos:
            eos_token_ids = ()

            def decode(self, ids, skip_special_tokens=True):
                return ""

        gen.generate(model, NoEos(), prompts, strategy, max_new_tokens=n, max_len=max_len, chunk_size=common.CHUNK.value)

    from tqdm import tqdm

    with tqdm(total=2, desc="compile (prefill, generate)", file=sys.stderr) as bar:
        run_prefill(); bar.update()
        run_generate(); bar.update()
    t_pre, t_gen = [], []
    for _ in tqdm(range(REPEATS.value), desc="timed repeats", file=sys.stderr):
        t0 = time.perf_counter(); run_prefill(); t_pre.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); run_generate(); t_gen.append(time.perf_counter() - t0)
    pre, tot = float(np.median(t_pre)), float(np.median(t_gen))
    dec = max(tot - pre, 1e-9)
    res = dict(model=common.MODEL.value, strategy=strategy.name, device=str(jax.devices()[0]), jax=jax.__version__,
               mesh=devices.MESH.value, batch=b, prompt_len=p, new_tokens=n, dtype=common.DTYPE.value, prefill_s=pre,
               prefill_tok_per_s=b * p / pre, decode_s=dec, decode_tok_per_s=b * n / dec)
    print(json.dumps(res, indent=1))
    if OUT.value:
        os.makedirs(os.path.dirname(OUT.value) or ".", exist_ok=True)
        with open(OUT.value, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    cli.run(main)
