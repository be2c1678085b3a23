"""Turning a task's user message into the exact prompt text and token ids a model sees.

Every task builds `messages` (one user turn) plus an optional `answer_prefix` that starts the assistant turn,
as RULER does for chat models. The prompt text is `apply_chat_template(messages, add_generation_prompt=True)`
followed by the prefix, and the harness feeds its token ids to `generate(..., chat=False)`, so what is sized
here is exactly what the model reads. Works with any tokenizer object that has `.encode(text)` (a list of ids,
or an object with `.ids`) and, for chat models, `.apply_chat_template(messages, ...)`; a tokenizer without a
chat template gets the raw user text.
"""

from __future__ import annotations


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as the model will see them (special tokens written in the text are honoured)."""
    ids = tokenizer.encode(text)
    ids = getattr(ids, "ids", ids)
    return [int(i) for i in ids]


def chat_text(tokenizer, user_text: str, answer_prefix: str = "", *, chat: bool = True) -> str:
    """The full prompt text: chat markup around `user_text`, then the start of the answer."""
    if not chat or not hasattr(tokenizer, "apply_chat_template") or getattr(tokenizer, "chat_template", "") is None:
        return user_text + answer_prefix  # base models: the raw task text, as RULER does
    messages = [{"role": "user", "content": user_text}]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TypeError:  # wrappers that do not take `tokenize`
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if not isinstance(text, str):
        raise TypeError(f"apply_chat_template must return the prompt text (str), got {type(text).__name__}")
    return text + answer_prefix
