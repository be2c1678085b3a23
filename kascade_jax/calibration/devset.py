"""Development sets for calibration: prompts (token ids) of a given size in the model's tokens.

`builtin` (the offline default) cycles through
- RULER-style tasks from the built-in generator `kascade_jax.tasks.synthetic` on its "dev" split: multi-key needle
  retrieval in prose (niah_multikey_1), multi-value and multi-query needles, and multi-hop variable tracking (vt);
- natural prose: consecutive stdlib docstring sentences (`kascade_jax.tasks.prose`) followed by a question
  about the passage, so the haystack is language rather than repeated noise.
Each prompt gets a target length drawn uniformly from [min_tokens, max_tokens]. Disjointness from evaluation:
RULER samples come from the "dev" split, whose SeedSequence differs from the "test" split by construction;
the prose prompts draw from `SeedSequence([seed, DEVSET_TAG, index])`, a stream no evaluation generator uses.

Any Hugging Face `datasets` dataset with a text-like field works too (`--dataset=bdsaglam/musique` with
`--dataset_config=answerable`, as the paper): MuSiQue-style `paragraphs` + `question`, `context` + `question`,
or a plain `text`/`document`/`article` field. Prompts outside [min_tokens, max_tokens] are skipped. Offline, the
load fails with a clear error that points to `--dataset=builtin`.

Deliberately not here: running the model or any statistics.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kascade_jax.tasks import prompt as prompt_lib
from kascade_jax.tasks import prose as prose_lib
from kascade_jax.tasks import synthetic

DEVSET_TAG = 0xCA11B  # the seed-stream tag of built-in calibration prose prompts; evaluation never uses it
BUILTIN = "builtin"
BUILTIN_ANSWERS = "builtin_answers"  # the built-in set with each RULER-style prompt followed by its gold answer
BUILTINS = (BUILTIN, BUILTIN_ANSWERS)
_RULER_KINDS = ("niah_multikey_1", "vt", "niah_multivalue", "niah_multiquery")
_KINDS = _RULER_KINDS[:2] + ("prose",) + _RULER_KINDS[2:]
_PROSE_QUESTIONS = (
    "Summarize the passage above in three sentences.",
    "Which Python modules or classes does the passage above describe? List them.",
    "What is the main idea of the passage above? Answer briefly.",
    "Write two questions that the passage above answers.",
)


@dataclasses.dataclass(frozen=True)
class DevPrompt:
    kind: str
    token_ids: tuple[int, ...]


def _check_sizes(num_prompts: int, min_tokens: int, max_tokens: int):
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if not 64 <= min_tokens <= max_tokens:
        raise ValueError(f"need 64 <= min_tokens <= max_tokens, got min_tokens={min_tokens}, max_tokens={max_tokens}")


def builtin_devset(tokenizer, num_prompts: int, *, min_tokens: int = 2048, max_tokens: int = 4096, seed: int = 0,
                   start: int = 0, chat: bool = True, answers: bool = False) -> list[DevPrompt]:
    """Prompts `start .. start + num_prompts - 1` of the built-in development set (deterministic in seed).

    answers=True: every RULER-style prompt ends with its gold answer, as the model would write it, so that the last
    query tiles are the answer being copied from the needles (what a decode step does); prose prompts are unchanged.
    """
    _check_sizes(num_prompts, min_tokens, max_tokens)
    out = []
    for index in range(start, start + num_prompts):
        rng = np.random.default_rng(np.random.SeedSequence([seed, DEVSET_TAG, index]))
        target = int(rng.integers(min_tokens, max_tokens + 1))
        kind = _KINDS[index % len(_KINDS)]
        if kind == "prose":
            ids = _prose_prompt(tokenizer, rng, target, chat)
        else:
            spec = synthetic.get_task(kind)
            sample = synthetic.generate_sample(kind, tokenizer, target + spec.max_new_tokens, index, seed=seed,
                                               split="dev", chat=chat)
            text = sample["input"] + (" " + " ".join(sample["answers"]) if answers else "")
            ids = prompt_lib.encode(tokenizer, text)
        out.append(DevPrompt(kind, tuple(ids)))
    return out


def _prose_prompt(tokenizer, rng, target: int, chat: bool) -> list[int]:
    sentences = prose_lib.prose_sentences()
    question = _PROSE_QUESTIONS[int(rng.integers(len(_PROSE_QUESTIONS)))]
    first = int(rng.integers(len(sentences)))

    def render(n):
        passage = " ".join(sentences[(first + i) % len(sentences)] for i in range(n))
        text = prompt_lib.chat_text(tokenizer, f"Read the following text.\n\n{passage}\n\n{question}", chat=chat)
        return prompt_lib.encode(tokenizer, text)

    lo, hi = 1, 2
    while len(render(hi)) <= target:  # bracket, then binary-search the most sentences that fit the target
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(render(mid)) <= target else (lo, mid)
    return render(lo)


def _record_text(rec: dict) -> str | None:
    if isinstance(rec.get("paragraphs"), list):  # MuSiQue: every paragraph, each wrapped in blank lines
        paras = [p.get("paragraph_text", p.get("text", "")) if isinstance(p, dict) else str(p) for p in rec["paragraphs"]]
        body = "".join(f"\n\n{p}\n\n" for p in paras)
        return f"Answer the question based on the paragraphs.{body}Question: {rec.get('question', '')}"
    for field in ("context", "input"):
        if isinstance(rec.get(field), str) and rec[field].strip():
            q = rec.get("question") or rec.get("query") or ""
            return f"{rec[field]}\n\nQuestion: {q}" if q else rec[field]
    for field in ("text", "document", "article", "content"):
        if isinstance(rec.get(field), str) and rec[field].strip():
            return rec[field]
    return None


def hf_devset(name: str, tokenizer, num_prompts: int, *, config: str | None = None, split: str = "validation",
              min_tokens: int = 2048, max_tokens: int = 4096, seed: int = 0, chat: bool = True) -> list[DevPrompt]:
    """Prompts from a Hugging Face dataset, shuffled with `seed`, keeping those of [min_tokens, max_tokens] tokens."""
    _check_sizes(num_prompts, min_tokens, max_tokens)
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # offline, unknown name, missing config: one clear message
        raise ValueError(f"could not load dataset {name!r} (config={config!r}, split={split!r}): "
                         f"{type(e).__name__}: {e}. Offline? Use --dataset={BUILTIN}.") from e
    ds = ds.shuffle(seed=seed)
    out, seen, too_short, too_long, no_text = [], 0, 0, 0, 0
    for rec in ds:
        seen += 1
        text = _record_text(rec)
        if text is None:
            no_text += 1
            if no_text == 8 and not out:
                raise ValueError(f"dataset {name!r} has no text-like field (paragraphs/context/input/text/document); "
                                 f"fields: {sorted(rec)}")
            continue
        ids = prompt_lib.encode(tokenizer, prompt_lib.chat_text(tokenizer, text, chat=chat))
        if len(ids) < min_tokens:
            too_short += 1
        elif len(ids) > max_tokens:
            too_long += 1
        else:
            out.append(DevPrompt(name, tuple(ids)))
            if len(out) == num_prompts:
                return out
    raise ValueError(f"dataset {name!r} gave only {len(out)} prompts of {min_tokens}..{max_tokens} tokens out of {seen} "
                     f"records ({too_short} shorter, {too_long} longer); widen --calib_min_tokens/"
                     f"--calib_max_tokens or lower "
                     f"--calib_num_prompts (asked {num_prompts})")


def load_devset(dataset: str, tokenizer, num_prompts: int, *, min_tokens: int = 2048, max_tokens: int = 4096,
                seed: int = 0, dataset_config: str | None = None, dataset_split: str = "validation",
                start: int = 0, chat: bool = True) -> list[DevPrompt]:
    if dataset in BUILTINS:
        return builtin_devset(tokenizer, num_prompts, min_tokens=min_tokens, max_tokens=max_tokens, seed=seed,
                              start=start, chat=chat, answers=dataset == BUILTIN_ANSWERS)
    if start:
        raise ValueError(f"start is only supported for --dataset={BUILTIN} or {BUILTIN_ANSWERS}, got start={start}")
    return hf_devset(dataset, tokenizer, num_prompts, config=dataset_config, split=dataset_split,
                     min_tokens=min_tokens, max_tokens=max_tokens, seed=seed, chat=chat)
