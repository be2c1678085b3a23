"""AIME-24: 30 competition problems with integer answers, graded by `math_grader`, sampled over N seeded runs.

Reads a local JSONL or parquet file with `problem` and `answer` fields (the HuggingFaceH4/aime_2024 schema), or
the hub dataset through `datasets` when online; offline without a file it raises a clear error. The protocol is
the Kascade reference's (`eval_aime.py`): temperature 0.6, top-p 0.95, runs with seeds 0..N-1, the score is the
mean pass@1 over runs and the decode length is averaged too. The prompt is its "reason step by step, put the
answer in \\boxed{}" format. The generation length defaults to what the model window leaves (the reference uses
32768 on 128K-context models).
"""

from __future__ import annotations

import json
import os

from kascade_jax.tasks import prompt as prompt_lib

TASK = "aime24"
TEMPERATURE = 0.6
TOP_P = 0.95
NUM_RUNS = 8
PROMPT = "Please reason step by step, and put your final answer within \\boxed{{}}.\n\nProblem: {problem}"


def load_problems(path: str | None = None) -> list[dict]:
    """[{id, problem, answer}] from a .jsonl/.parquet file, else HuggingFaceH4/aime_2024 through `datasets`."""
    if path is not None:
        if not os.path.exists(path):
            raise FileNotFoundError(f"AIME file {path} not found")
        if path.endswith(".parquet"):
            import pandas as pd  # noqa: PLC0415
            rows = pd.read_parquet(path).to_dict("records")
        elif path.endswith((".jsonl", ".json")):
            with open(path, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
        else:
            raise ValueError(f"AIME file must be .jsonl or .parquet, got {path!r}")
    else:
        try:
            import datasets  # noqa: PLC0415
            rows = list(datasets.load_dataset("HuggingFaceH4/aime_2024", split="train"))
        except Exception as e:
            raise RuntimeError(f"could not load HuggingFaceH4/aime_2024 through `datasets` ({type(e).__name__}: {e}); "
                               f"pass a local .jsonl/.parquet file with problem/answer fields") from e
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
