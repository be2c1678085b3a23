"""LongBench v1 (THUDM/LongBench): official prompts, generation lengths, metrics and category averages.

Data is read in the official JSONL schema (`input, context, answers, length, dataset, language, all_classes, _id`)
from `<data_dir>/<task>.jsonl` (the layout of the official data.zip), or through `datasets` (`THUDM/LongBench`)
when online. It cannot be generated, so offline without a local copy we raise a clear error.

Prompting follows `LongBench/pred.py`: `dataset2prompt[task].format(**example)`, middle truncation of that prompt
to `max_length` tokens (keep the first and last halves), then the chat template except for the few-shot and code
tasks. The official harness truncates to a per-model `model2maxlen`; we truncate so that the final prompt plus
the task's generation length fits the model window. Scoring follows `LongBench/eval.py` (first line only for
trec/triviaqa/samsum/lsht, max over references). samsum stops at a newline, as the official harness does.
"""

from __future__ import annotations

import json
import os

from kascade_jax.tasks import metrics
from kascade_jax.tasks import prompt as prompt_lib

DATASET2PROMPT = {
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer the question as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nStory: {context}\n\nNow, answer the question based on the story as concisely as you can, using a single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based on the information in the article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",  # noqa: E501
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "musique": "Answer the question based on the given passages. Only give me the answer and do not output any other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",  # noqa: E501
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",  # noqa: E501
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",  # noqa: E501
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\nNow, write a one-page summary of all the news.\n\nSummary:",  # noqa: E501
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other words. The following are some examples.\n\n{context}\n\n{input}",  # noqa: E501
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",  # noqa: E501
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", etc.\n\nThe answer is: ",  # noqa: E501
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

DATASET2MAXLEN = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "multifieldqa_zh": 64, "hotpotqa": 32, "2wikimqa": 32,
    "musique": 32, "dureader": 128, "gov_report": 512, "qmsum": 512, "multi_news": 512, "vcsum": 512, "trec": 64,
    "triviaqa": 32, "samsum": 128, "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32,
    "passage_retrieval_zh": 32, "lcc": 64, "repobench-p": 64,
}

DATASET2METRIC = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "multifieldqa_zh": "qa_f1_zh",
    "hotpotqa": "qa_f1", "2wikimqa": "qa_f1", "musique": "qa_f1", "dureader": "rouge_zh", "gov_report": "rouge",
    "qmsum": "rouge", "multi_news": "rouge", "vcsum": "rouge_zh", "trec": "classification", "triviaqa": "qa_f1",
    "samsum": "rouge", "lsht": "classification", "passage_retrieval_en": "retrieval", "passage_count": "count",
    "passage_retrieval_zh": "retrieval_zh", "lcc": "code_sim", "repobench-p": "code_sim",
}

CATEGORIES = {  # the paper's six averages (LongBench's task groups)
    "SQA": ("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    "MQA": ("hotpotqa", "2wikimqa", "musique", "dureader"),
    "Summ": ("gov_report", "qmsum", "multi_news", "vcsum"),
    "Fewshot": ("trec", "triviaqa", "samsum", "lsht"),
    "Synthetic": ("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    "Code": ("lcc", "repobench-p"),
}

TASKS = tuple(DATASET2PROMPT)
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")
NO_CHAT_TASKS = ("trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p")
_FIELDS = ("input", "context", "answers", "length", "dataset", "language", "all_classes", "_id")


def check_task(task: str) -> str:
    if task not in DATASET2PROMPT:
        raise ValueError(f"unknown LongBench task {task!r}; allowed: {list(TASKS)}")
    return task


def load_examples(task: str, data_dir: str | None = None) -> list[dict]:
    """Raw examples of one task from `<data_dir>/<task>.jsonl`, else from the hub through `datasets`."""
    check_task(task)
    if data_dir is not None:
        path = os.path.join(data_dir, f"{task}.jsonl")
        if not os.path.exists(path):
            raise FileNotFoundError(f"LongBench file {path} not found (expected the official layout "
                                    f"<data_dir>/<task>.jsonl)")
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
    else:
        try:
            import datasets  # noqa: PLC0415
            rows = list(datasets.load_dataset("THUDM/LongBench", task, split="test"))
        except Exception as e:  # offline, or the hub refuses: say what to do
            raise RuntimeError(f"could not load LongBench task {task!r} through `datasets` ({type(e).__name__}: "
                               f"{e}); download the official data.zip and pass its folder as data_dir") from e
    for i, row in enumerate(rows):
        missing = [k for k in _FIELDS if k not in row]
        if missing:
            raise ValueError(f"LongBench {task} example {i} lacks fields {missing} of the official schema")
    return rows


def _decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True) if _takes_skip(tokenizer) else tokenizer.decode(ids)


def _takes_skip(tokenizer) -> bool:
    try:
        tokenizer.decode([], skip_special_tokens=True)
        return True
    except TypeError:
        return False


def build_sample(task: str, example: dict, tokenizer, *, max_length: int, index: int = 0, chat: bool = True,
                 max_new_tokens: int | None = None) -> dict:
    """Prompt an example: official template, middle truncation, chat wrap. `max_length`: the model window in tokens;
    `max_new_tokens` overrides the official generation length (the prompt is sized for whichever is used)."""
    check_task(task)
    max_new = DATASET2MAXLEN[task] if max_new_tokens is None else int(max_new_tokens)
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    use_chat = chat and task not in NO_CHAT_TASKS
    overhead = len(prompt_lib.encode(tokenizer, prompt_lib.chat_text(tokenizer, "", chat=use_chat)))
    budget = max_length - max_new - overhead
    if budget < 16:
        raise ValueError(f"max_length={max_length} leaves {budget} prompt tokens for {task} (generation {max_new}, "
                         f"chat markup {overhead}); need max_length >= {max_new + overhead + 16}")
    raw = DATASET2PROMPT[task].format(**example)
    ids = prompt_lib.encode(tokenizer, raw)
    truncated = len(ids) > budget
    if truncated:
        half = budget // 2
        raw = _decode(tokenizer, ids[:half]) + _decode(tokenizer, ids[len(ids) - half:])
    text = prompt_lib.chat_text(tokenizer, raw, chat=use_chat)
    n = len(prompt_lib.encode(tokenizer, text))
    # Re-tokenising decoded halves can merge differently; trim further in the rare case it overflows.
    while n + max_new > max_length and truncated:
        half -= max(1, (n + max_new - max_length + 1) // 2)
        raw = _decode(tokenizer, ids[:half]) + _decode(tokenizer, ids[len(ids) - half:])
        text = prompt_lib.chat_text(tokenizer, raw, chat=use_chat)
        n = len(prompt_lib.encode(tokenizer, text))
    return dict(task=task, index=index, input=text, answers=list(example["answers"]),
                all_classes=example.get("all_classes"), metric=DATASET2METRIC[task], max_new_tokens=max_new,
                first_line=task in FIRST_LINE_TASKS, stop=["\n"] if task == "samsum" else [],
                length=example.get("length"), language=example.get("language"), _id=example.get("_id"),
                prompt_tokens=n, truncated=truncated, context_length=max_length)


def load_samples(task: str, tokenizer, *, max_length: int, data_dir: str | None = None, num_samples: int | None = None,
                 seed: int = 0, chat: bool = True, max_new_tokens: int | None = None) -> list[dict]:
    """Prompted samples of one task; with num_samples, a seeded random subset (as the Kascade harness shuffles)."""
    rows = load_examples(task, data_dir)
    order = list(range(len(rows)))
    if num_samples is not None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1 or None, got {num_samples}")
        import numpy as np  # noqa: PLC0415
        order = sorted(np.random.default_rng(seed).permutation(len(rows))[:num_samples].tolist())
    return [build_sample(task, rows[i], tokenizer, max_length=max_length, index=i, chat=chat,
                         max_new_tokens=max_new_tokens) for i in order]


def score_prediction(sample: dict, prediction: str) -> float:
    """One example's official score in [0, 1]."""
    if sample.get("first_line"):
        prediction = prediction.lstrip("\n").split("\n")[0]
    return metrics.score(sample["metric"], prediction, sample["answers"], all_classes=sample.get("all_classes"))


def category_averages(task_scores: dict[str, float]) -> dict[str, float]:
    """The paper's six category means over the tasks present (a category with no task is left out)."""
    out = {}
    for cat, tasks in CATEGORIES.items():
        vals = [task_scores[t] for t in tasks if t in task_scores]
        if vals:
            out[cat] = sum(vals) / len(vals)
    return out
