"""Built-in RULER-style synthetic long-context tasks, generated in code at any length in the model's tokens.

`--tasks=synthetic` (names `synthetic:<task>`): the quick, dependency-free stand-in for RULER, and the source of the
calibration development set (`kascade_jax.calibration.devset`). The real benchmark, from NVIDIA's own generators and
data, is `kascade_jax.tasks.ruler`.

Follows NVIDIA/RULER (`scripts/data/synthetic/{niah,variable_tracking,common_words_extraction,
freq_words_extraction}.py`, templates from `constants.py`) with offline substitutes:
- the Paul Graham essay haystack is replaced by stdlib docstring prose (`prose.py`);
- wonderwords' word lists are replaced by `prose.word_list()`;
- sentence splitting needs no NLTK (the prose is pre-split).

Sizing follows RULER: `context_length` includes the generation budget, i.e. the prompt (chat markup and answer
prefix included) has at most `context_length - max_new_tokens` tokens, and as many haystack units as fit
(found by an interpolation search over the haystack size with the real tokenizer, ~5-8 encodes per sample).

Seeds: sample `index` of (task, context_length, split) draws from
`SeedSequence([seed, SPLITS[split], crc32(task), context_length, index])`, so the "dev" split used to calibrate
anchors never shares a random stream with the "test" split. Metrics are RULER's `string_match_all`
(every task here; `string_match_part` is in `metrics.py` for QA-style tasks).

Deliberately not here: RULER's qa_1/qa_2 and the essay haystack (real RULER: `kascade_jax.tasks.ruler`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import uuid
import zlib

import numpy as np

from kascade_jax.tasks import prompt as prompt_lib
from kascade_jax.tasks import prose

SPLITS = {"test": 0, "dev": 1}

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_NOISE_SENTENCES = [s + "." for s in NOISE[:-1].split(". ")]

_NIAH_TEMPLATE = (
    "Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_v} afterwards.\n{context}\n"
    "What are all the special magic {type_v} for {query} mentioned in the provided text?")
_NIAH_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"
_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
_VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
                "Question: Find all variables that are assigned the value {query} in the text above.")
_VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
              "assigned the value {query}, they are: ")
_CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.\n{context}\n"
                 "Question: What are the 10 most common words in the above list?")
_CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
_FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                 "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                 "the dots '....'. What are the three most frequently appeared words in the above coded text?")
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
_DEPTHS = np.linspace(0.0, 1.0, 40)  # RULER's 40 evenly spaced insertion depths


@dataclasses.dataclass(frozen=True)
class RulerTask:
    """One RULER configuration (names and defaults as in RULER's synthetic.yaml)."""

    name: str
    kind: str  # "niah" | "vt" | "cwe" | "fwe"
    max_new_tokens: int
    haystack: str = "noise"  # niah/vt: "noise" | "prose" | "needle" (distractor needles)
    type_k: str = "words"  # niah key type: "words" | "numbers" | "uuids"
    type_v: str = "numbers"  # niah value type: "numbers" | "uuids"
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1
    metric: str = "string_match_all"


TASKS = {t.name: t for t in (
    RulerTask("niah_single_1", "niah", 128, haystack="noise"),
    RulerTask("niah_single_2", "niah", 128, haystack="prose"),
    RulerTask("niah_single_3", "niah", 128, haystack="prose", type_v="uuids"),
    RulerTask("niah_multikey_1", "niah", 128, haystack="prose", num_k=4),
    RulerTask("niah_multikey_2", "niah", 128, haystack="needle"),
    RulerTask("niah_multikey_3", "niah", 128, haystack="needle", type_k="uuids", type_v="uuids"),
    RulerTask("niah_multivalue", "niah", 128, haystack="prose", num_v=4),
    RulerTask("niah_multiquery", "niah", 128, haystack="prose", num_k=4, num_q=4),
    RulerTask("vt", "vt", 30, haystack="noise"),
    RulerTask("cwe", "cwe", 120),
    RulerTask("fwe", "fwe", 50),
)}


def get_task(name: str) -> RulerTask:
    if name not in TASKS:
        raise ValueError(f"unknown synthetic task {name!r}; allowed: {sorted(TASKS)}")
    return TASKS[name]


def sample_seed(task: str, context_length: int, index: int, *, seed: int = 0, split: str = "test") -> int:
    """The 63-bit seed of one sample; disjoint streams per split by construction of the SeedSequence."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    if seed < 0 or index < 0:
        raise ValueError(f"seed and index must be >= 0, got seed={seed}, index={index}")
    ss = np.random.SeedSequence([seed, SPLITS[split], zlib.crc32(task.encode()), context_length, index])
    return int(ss.generate_state(2, np.uint32).astype(np.uint64) @ np.array([1 << 31, 1], np.uint64))


# ----------------------------------------------------------------------------- content builders
# Each builder maps (seed, haystack size `n`) -> (user text, answer prefix, answers, extra). It must be
# deterministic in (seed, n) and grow monotonically in tokens with n, for the size search.

def _rand_key(rng, kind: str) -> str:
    if kind == "words":
        words = prose.word_list()
        return f"{words[rng.integers(len(words))]}-{words[rng.integers(len(words))]}"
    if kind == "numbers":
        return str(int(rng.integers(10**6, 10**7)))
    return str(uuid.UUID(int=int(rng.integers(0, 2**63)) << 64 | int(rng.integers(0, 2**63)), version=4))


def _distinct(rng, kind: str, count: int, exclude=()) -> list[str]:
    out, seen = [], set(exclude)
    while len(out) < count:
        item = _rand_key(rng, kind)
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def _insert(units: list[str], needles: list[str], depths) -> list[str]:
    """Insert needles (in order) at fractional depths of the unit list."""
    out = list(units)
    for pos_needle in sorted(zip((int(round(d * len(units))) for d in depths), range(len(needles))), reverse=True):
        out.insert(pos_needle[0], needles[pos_needle[1]])
    return out


def _join_query(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _build_niah(task: RulerTask, seed: int, n: int):
    rng = np.random.default_rng(seed)
    keys = _distinct(rng, task.type_k, task.num_k)
    values = [_distinct(rng, task.type_v, task.num_v) for _ in keys]
    needles = [_NEEDLE.format(type_v=task.type_v, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    order = rng.permutation(len(needles))
    needles = [needles[i] for i in order]
    depths = np.sort(rng.choice(_DEPTHS, size=len(needles), replace=False))
    queried = [int(i) for i in np.sort(rng.choice(len(keys), size=task.num_q, replace=False))]
    query_keys = [keys[i] for i in queried]
    answers = [v for i in queried for v in values[i]]
    hay_rng = np.random.default_rng([seed, 1])  # independent of n-dependent draws below
    if task.haystack == "noise":
        units = [NOISE] * n
        sep = " "
    elif task.haystack == "prose":
        sents = prose.prose_sentences()
        start = int(hay_rng.integers(len(sents)))
        units = [sents[(start + i) % len(sents)] for i in range(n)]
        sep = " "
    elif task.haystack == "needle":
        dk = _distinct(hay_rng, task.type_k, n, exclude=keys)
        units = [_NEEDLE.format(type_v=task.type_v, key=k, value=_rand_key(hay_rng, task.type_v)) for k in dk]
        sep = "\n"
    else:
        raise ValueError(f"unknown haystack {task.haystack!r}")
    context = sep.join(_insert(units, needles, depths))
    query = _join_query(query_keys)
    text = _NIAH_TEMPLATE.format(type_v=task.type_v, context=context, query=query)
    prefix = _NIAH_PREFIX.format(type_v=task.type_v, query=query)
    return text, prefix, answers, dict(depths=[float(d) for d in depths], keys=query_keys)


def _vt_instance(rng, n: int, num_chains: int = 1, num_hops: int = 4, var_len: int = 5):
    names = set()
    while len(names) < num_chains * (num_hops + 1):
        names.add("".join(chr(65 + int(c)) for c in rng.integers(0, 26, size=var_len)))
    names = sorted(names)
    rng.shuffle(names)
    chains, answers, values = [], [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        value = int(rng.integers(10000, 100000))
        chain = [f"VAR {vs[0]} = {value}."] + [f"VAR {vs[j + 1]} = VAR {vs[j]}." for j in range(num_hops)]
        chains.append(chain)
        answers.append(vs)
        values.append(value)
    statements = [s for chain in chains for s in chain]  # keep each chain in order
    depths = np.sort(rng.uniform(0, 1, size=len(statements)))
    context = " ".join(_insert([NOISE] * n, statements, depths))
    text = _VT_TEMPLATE.format(context=context, query=values[0])
    prefix = _VT_PREFIX.format(num_v=num_hops + 1, query=values[0])
    return text, prefix, answers[0]


def _build_vt(task: RulerTask, seed: int, n: int):
    icl_text, icl_prefix, icl_answers = _vt_instance(np.random.default_rng([seed, 2]), 8)
    text, prefix, answers = _vt_instance(np.random.default_rng(seed), n)
    example = f"{icl_text}\n{icl_prefix.strip()} {' '.join(icl_answers)}\n\n"
    return example + text, prefix, answers, {}


def _cwe_instance(rng, num_words: int, common: int, uncommon: int, num_common: int = 10):
    words = prose.word_list()
    chosen = [words[i] for i in rng.choice(len(words), size=num_common + num_words, replace=False)]
    common_words, rest = chosen[:num_common], chosen[num_common:]
    items = common_words * common + rest * uncommon
    rng.shuffle(items)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
    return _CWE_TEMPLATE.format(context=context), _CWE_PREFIX, common_words


def _build_cwe(task: RulerTask, seed: int, n: int, context_length: int):
    # RULER shrinks the repetition counts below 4K tokens so that the common words still fit.
    small = context_length < 4096
    common, uncommon = (6, 1) if small else (30, 3)
    icl_text, icl_prefix, icl_answers = _cwe_instance(np.random.default_rng([seed, 2]), 10, 3, 1)
    text, prefix, answers = _cwe_instance(np.random.default_rng(seed), n, common, uncommon)
    example = f"{icl_text}\n{icl_prefix.strip()} {' '.join(f'{i + 1}. {w}' for i, w in enumerate(icl_answers))}\n\n"
    return example + text, prefix, answers, {}


@functools.lru_cache(maxsize=64)
def _fwe_vocab(seed: tuple, vocab_size: int = 2000, word_len: int = 6) -> tuple[str, ...]:
    """RULER's random coded vocabulary, ranked (cached: the size search renders one sample many times)."""
    rng = np.random.default_rng(list(seed))
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(chr(97 + int(c)) for c in rng.integers(0, 26, size=word_len)))
    vocab = sorted(vocab)
    rng.shuffle(vocab)
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    return tuple(vocab)


def _fwe_instance(seed: tuple, num_words: int, alpha: float = 2.0):
    vocab = _fwe_vocab(seed)
    zeta = math.pi ** 2 / 6 if alpha == 2.0 else sum(k ** -alpha for k in range(1, 100_000))
    counts = (num_words * np.arange(1, len(vocab) + 1, dtype=np.float64) ** -alpha / zeta).astype(int)
    items = [w for w, c in zip(vocab, counts) for _ in range(c)]
    np.random.default_rng([*seed, 1]).shuffle(items)
    return _FWE_TEMPLATE.format(context=" ".join(items)), _FWE_PREFIX, list(vocab[1:4])


def _build_fwe(task: RulerTask, seed: int, n: int):
    icl_text, icl_prefix, icl_answers = _fwe_instance((seed, 2), 60)
    text, prefix, answers = _fwe_instance((seed,), n)
    example = f"{icl_text}\n{icl_prefix.strip()} {' '.join(icl_answers)}\n\n"
    return example + text, prefix, answers, {}


def _build(task: RulerTask, seed: int, n: int, context_length: int):
    if task.kind == "niah":
        return _build_niah(task, seed, n)
    if task.kind == "vt":
        return _build_vt(task, seed, n)
    if task.kind == "cwe":
        return _build_cwe(task, seed, n, context_length)
    return _build_fwe(task, seed, n)


def _min_units(task: RulerTask) -> int:
    # fwe needs enough words that the three answers are strictly more frequent than the rest of the tail.
    return {"fwe": 40, "cwe": 1}.get(task.kind, 0)


# ----------------------------------------------------------------------------- public API

def _renderer(spec: RulerTask, tokenizer, context_length: int, index: int, seed: int, split: str, chat: bool):
    """(the sample's seed, render(n) -> (prompt, tokens, text, prefix, answers, extra) at haystack size n)."""
    s = sample_seed(spec.name, int(context_length), index, seed=seed, split=split)

    def render(n):
        text, prefix, answers, extra = _build(spec, s, n, context_length)
        full = prompt_lib.chat_text(tokenizer, text, prefix.lstrip(" "), chat=chat)
        return full, len(prompt_lib.encode(tokenizer, full)), text, prefix, answers, extra

    return s, render


def min_context_length(task: str, tokenizer, context_length: int, max_new_tokens: int | None = None, *,
                       index: int = 0, seed: int = 0, split: str = "test", chat: bool = True) -> int:
    """The smallest context length that sample `index` of (task, context_length) fits: `generate_sample` with these
    arguments refuses exactly when `context_length` is below it (its error names this number). Renders only the
    smallest prompt (a sample's content, hence this number, depends on context_length, index, seed and split)."""
    spec = get_task(task)
    max_new = prompt_lib.answer_budget(spec.max_new_tokens, max_new_tokens)
    _, render = _renderer(spec, tokenizer, context_length, index, seed, split, chat)
    return render(_min_units(spec))[1] + max_new


def generate_sample(task: str, tokenizer, context_length: int, index: int, *, seed: int = 0, split: str = "test",
                    max_new_tokens: int | None = None, chat: bool = True) -> dict:
    """One sample whose prompt plus `max_new_tokens` fits `context_length` tokens (the largest haystack that does)."""
    spec = get_task(task)
    max_new = prompt_lib.answer_budget(spec.max_new_tokens, max_new_tokens)
    budget = int(context_length) - max_new
    s, render = _renderer(spec, tokenizer, context_length, index, seed, split, chat)
    lo = _min_units(spec)
    base = render(lo)
    if base[1] > budget:
        raise ValueError(f"context_length={context_length} is too small for {task} with max_new_tokens={max_new}: "
                         f"the smallest prompt has {base[1]} tokens, so context_length must be >= {base[1] + max_new}")
    best, best_n, _, _ = prompt_lib.largest_fitting(render, lo, base, budget)
    full, n_tokens, text, prefix, answers, extra = best
    return dict(task=task, context_length=int(context_length), split=split, index=int(index), seed=s,
                input=full, messages=[{"role": "user", "content": text}], answer_prefix=prefix.lstrip(" "),
                answers=list(answers), metric=spec.metric, max_new_tokens=max_new, prompt_tokens=n_tokens,
                haystack_units=best_n, **extra)


def generate_samples(task: str, tokenizer, context_length: int, num_samples: int, *, seed: int = 0,
                     split: str = "test", max_new_tokens: int | None = None, start: int = 0,
                     chat: bool = True) -> list[dict]:
    """Samples `start .. start + num_samples - 1` of one (task, context_length, split)."""
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    return [generate_sample(task, tokenizer, context_length, start + i, seed=seed, split=split,
                            max_new_tokens=max_new_tokens, chat=chat) for i in range(num_samples)]
