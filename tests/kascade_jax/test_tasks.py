"""The built-in RULER-style generators (tasks.synthetic): sizing, seeds/splits, answers in the prompt, metrics."""

import re

import numpy as np
import pytest

from kascade_jax.tasks import metrics, prose, synthetic
from tests.kascade_jax.kj_helpers import FakeTokenizer


TOK = FakeTokenizer()


def test_prose_is_deterministic_and_not_code():
    s = prose.prose_sentences()
    assert len(s) > 2000 and s == prose.prose_sentences()
    assert not any(">>>" in x or "{" in x or "=" in x for x in s)
    assert len(prose.word_list()) > 1000


@pytest.mark.parametrize("task", sorted(synthetic.TASKS))
def test_every_task_fits_and_contains_its_answers(task):
    length = 1500
    s = synthetic.generate_sample(task, TOK, length, 0, seed=3)
    assert s["prompt_tokens"] == len(TOK.encode(s["input"]))
    assert s["prompt_tokens"] + s["max_new_tokens"] <= length
    # The largest haystack that fits: one more unit must overflow (within a unit's size of the budget).
    assert s["prompt_tokens"] + s["max_new_tokens"] > length - 200
    assert s["answers"] and s["metric"] == "string_match_all"
    body = s["messages"][0]["content"]
    if task not in ("cwe", "fwe"):  # cwe/fwe answers appear many times, checked below
        for a in s["answers"]:
            assert a in body, (task, a)
    assert s["input"].endswith(s["answer_prefix"])
    # A perfect answer scores 1, an empty one 0.
    assert metrics.score(s["metric"], " ".join(s["answers"]), s["answers"]) == 1.0
    assert metrics.score(s["metric"], "", s["answers"]) == 0.0


def test_niah_needles_and_depth():
    s = synthetic.generate_sample("niah_multivalue", TOK, 3000, 1)
    body = s["messages"][0]["content"]
    assert len(s["answers"]) == 4 and body.count("One of the special magic numbers for") == 4
    s = synthetic.generate_sample("niah_multikey_2", TOK, 2000, 1)  # distractor-needle haystack
    assert s["messages"][0]["content"].count("One of the special magic numbers for") > 20
    assert s["messages"][0]["content"].count(f"is: {s['answers'][0]}.") == 1


def test_cwe_and_fwe_answers_are_the_most_frequent():
    s = synthetic.generate_sample("cwe", TOK, 2500, 0)
    listing = s["messages"][0]["content"].split("\n\n")[-1]
    counts = {w: c for w, c in zip(*np.unique(re.findall(r"\d+\. (\w+)", listing), return_counts=True))}
    top = sorted(counts, key=counts.get, reverse=True)[:10]
    assert set(top) == set(s["answers"]) and min(counts[w] for w in top) > max(
        c for w, c in counts.items() if w not in top)
    s = synthetic.generate_sample("fwe", TOK, 2500, 0)
    text = s["messages"][0]["content"].split("\n\n")[-1]
    words, counts = np.unique([w for w in text.split() if re.fullmatch(r"[a-z]{6}", w)], return_counts=True)
    top3 = [str(w) for w in words[np.argsort(-counts, kind="stable")][:3]]
    assert set(top3) == set(s["answers"])


def test_vt_chain():
    s = synthetic.generate_sample("vt", TOK, 1200, 2, seed=5)
    body = s["messages"][0]["content"].split("\n\n", 3)[-1]  # skip the one-shot example
    a = s["answers"]
    assert len(a) == 5
    value = re.search(rf"VAR {a[0]} = (\d+)\.", body).group(1)
    for prev, cur in zip(a, a[1:]):
        assert f"VAR {cur} = VAR {prev}." in body
    assert s["input"].rstrip().endswith(f"assigned the value {value}, they are:")


def test_seeds_splits_and_determinism():
    a = synthetic.generate_sample("niah_single_1", TOK, 1024, 0, seed=0, split="test")
    assert a == synthetic.generate_sample("niah_single_1", TOK, 1024, 0, seed=0, split="test")
    dev = synthetic.generate_samples("niah_single_1", TOK, 1024, 8, seed=0, split="dev")
    test = synthetic.generate_samples("niah_single_1", TOK, 1024, 8, seed=0, split="test")
    assert not {s["seed"] for s in dev} & {s["seed"] for s in test}
    assert not {s["answers"][0] for s in dev} & {s["answers"][0] for s in test}
    assert len({s["answers"][0] for s in test}) == 8
    assert synthetic.generate_sample("niah_single_1", TOK, 1024, 0, seed=1)["answers"] != a["answers"]


def test_longer_context_gives_longer_prompt():
    short = synthetic.generate_sample("niah_single_2", TOK, 1000, 0)
    long = synthetic.generate_sample("niah_single_2", TOK, 4000, 0)
    assert long["prompt_tokens"] > 3 * short["prompt_tokens"] - 500


def test_errors():
    with pytest.raises(ValueError, match="unknown synthetic task"):
        synthetic.generate_sample("niah_nope", TOK, 1000, 0)
    with pytest.raises(ValueError, match="split must be one of"):
        synthetic.generate_sample("vt", TOK, 1000, 0, split="train")
    with pytest.raises(ValueError, match="too small"):
        synthetic.generate_sample("cwe", TOK, 100, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        synthetic.generate_sample("vt", TOK, 1000, 0, max_new_tokens=0)
    with pytest.raises(ValueError, match="seed and index"):
        synthetic.generate_sample("vt", TOK, 1000, -1)
    with pytest.raises(ValueError, match="num_samples"):
        synthetic.generate_samples("vt", TOK, 1000, -1)


def test_string_match_metrics():
    assert metrics.string_match_all("The numbers are 123 and 456.", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert metrics.string_match_part("the ANSWER is abc", ["xyz", "Abc"]) == 1.0
    assert metrics.string_match_part("nothing", ["xyz"]) == 0.0
    with pytest.raises(ValueError, match="at least one reference"):
        metrics.string_match_all("x", [])


def _real_tokenizer():
    try:
        from models.tokenizer import load_tokenizer  # noqa: PLC0415
    except ImportError:
        pytest.skip("models.tokenizer is not available yet")
    return load_tokenizer("smollm2-135m")


def test_real_tokenizer_sizing():
    tok = _real_tokenizer()
    s = synthetic.generate_sample("niah_single_1", tok, 2048, 0)
    n = len(tok.encode(s["input"]) if not hasattr(tok.encode(s["input"]), "ids") else tok.encode(s["input"]).ids)
    assert n == s["prompt_tokens"] and 2048 - 60 < n + s["max_new_tokens"] <= 2048
    assert "<|im_start|>assistant" in s["input"]


def test_base_model_without_chat_template_gets_raw_text():
    class Base(FakeTokenizer):
        chat_template = None

    s = synthetic.generate_sample("vt", Base(), 1200, 0)
    assert not s["input"].startswith("<|im_start|>") and s["input"].endswith(s["answer_prefix"])
    assert synthetic.generate_sample("vt", TOK, 1200, 0, chat=False)["input"] == s["input"]
