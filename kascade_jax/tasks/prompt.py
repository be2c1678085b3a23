"""Turning a task's user message into the exact prompt text and token ids a model sees.

Every task builds `messages` (one user turn) plus an optional `answer_prefix` that starts the assistant turn,
as RULER does for chat models. The prompt text is `apply_chat_template(messages, add_generation_prompt=True)`
followed by the prefix, and the harness feeds its token ids to `generate(..., chat=False)`, so what is sized
here is exactly what the model reads. Works with any tokenizer object that has `.encode(text)` (a list of ids,
or an object with `.ids`) and, for chat models, `.apply_chat_template(messages, ...)`; a tokenizer without a
chat template gets the raw user text. `largest_fitting` is the shared size search of the generated tasks,
`answer_budget` their rule for max_new_tokens.
"""

from __future__ import annotations


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as the model will see them (special tokens written in the text are honoured)."""
    ids = tokenizer.encode(text)
    ids = getattr(ids, "ids", ids)
    return [int(i) for i in ids]


def encode_many(tokenizer, texts) -> list[list[int]]:
    """`encode` of every text; through the tokenizer's threaded `encode_batch` when it has one."""
    texts = list(texts)
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None or not texts:
        return [encode(tokenizer, t) for t in texts]
    return [[int(i) for i in getattr(ids, "ids", ids)] for ids in batch(texts)]


def uses_chat_template(tokenizer, chat: bool = True) -> bool:
    """Whether `chat_text` wraps the user text in chat markup (False for base models and `chat=False`)."""
    return (bool(chat) and hasattr(tokenizer, "apply_chat_template")
            and getattr(tokenizer, "chat_template", "") is not None)


def chat_text(tokenizer, user_text: str, answer_prefix: str = "", *, chat: bool = True) -> str:
    """The full prompt text: chat markup around `user_text`, then the start of the answer."""
    if not uses_chat_template(tokenizer, chat):
        return user_text + answer_prefix  # base models: the raw task text, as RULER does
    messages = [{"role": "user", "content": user_text}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TypeError:  # wrappers that do not take `tokenize`
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template must return the prompt text (str), got {type(text).__name__}")
    return text + answer_prefix


def answer_budget(task_default: int, max_new_tokens: int | None) -> int:
    """A sample's generation budget: `max_new_tokens`, else its task's default; refused below 1."""
    max_new = task_default if max_new_tokens is None else int(max_new_tokens)
    if max_new < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
    return max_new


def largest_fitting(render, lo: int, base, budget: int, *, cap: int | None = None):
    """Largest haystack size n in [lo, cap] whose prompt fits `budget` tokens, by interpolation search on a bracket.

    `render(n)` returns a tuple whose item 1 is the prompt's token count; `base = render(lo)` must fit. Token counts
    grow almost linearly in n, so interpolating between the largest fitting and the smallest overflowing size
    converges in a few tokenizer calls (plain bisection would need ~12 at 8K tokens).
    Returns (render(n), n, render(n + 1), n + 1), the last two None when n == cap.
    """
    fit_n, fit = lo, base
    if cap is not None and lo >= cap:
        return fit, fit_n, None, None
    probe = lo + 16 if cap is None else min(lo + 16, cap)
    per_unit = max((render(probe)[1] - base[1]) / (probe - lo), 1e-3)
    guess = lo + max(1, int((budget - base[1]) / per_unit))
    guess = guess if cap is None else min(guess, cap)
    over_n, over = None, None
    while over is None:  # find an overflowing size above the estimate
        r = render(guess)
        if r[1] <= budget:
            fit_n, fit = guess, r
            if fit_n == cap:
                return fit, fit_n, None, None
            guess = fit_n + max(2, (fit_n - lo) // 16)
            guess = guess if cap is None else min(guess, cap)
        else:
            over_n, over = guess, r
    while over_n - fit_n > 1:
        slope = (over[1] - fit[1]) / (over_n - fit_n)
        guess = fit_n + int((budget - fit[1]) / max(slope, 1e-3))
        guess = min(max(guess, fit_n + 1), over_n - 1)
        r = render(guess)
        if r[1] <= budget:
            fit_n, fit = guess, r
            if guess + 1 < over_n:  # usually the interpolated size is the answer: confirm with its successor
                r2 = render(guess + 1)
                if r2[1] > budget:
                    over_n, over = guess + 1, r2
                else:
                    fit_n, fit = guess + 1, r2
        else:
            over_n, over = guess, r
    return fit, fit_n, over, over_n
