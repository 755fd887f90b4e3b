"""A chat template rendered without transformers' per-call work.

`apply_chat_template` rebuilds every message as plain data and looks its template up on each call: for rows of
plain strings that is most of the time a dataset's rendering takes. Rendering the compiled template (the one
transformers compiles and caches, in its sandbox) with the same variables gives the same text; the trainer
compares the two on a dataset's first rows and uses this only where they agree.
"""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any, cast

try:
    from transformers.utils.chat_template_utils import _compile_jinja_template

    COMPILES = True
except ImportError:  # a transformers that moved it: every render goes through apply_chat_template
    COMPILES = False

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def render_messages(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], fast: bool = True) -> str:
    """The conversation's text, as apply_chat_template(messages, tokenize=False) gives it."""
    compiled = _compiled(tokenizer.chat_template) if fast and COMPILES else None
    if compiled is None:
        return template_text(tokenizer, messages)
    return compiled.render(
        messages=messages, tools=None, documents=None, add_generation_prompt=False, **_special_tokens(tokenizer)
    )


def template_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], **options: Any) -> str:
    """apply_chat_template(messages, tokenize=False, **options): the text (transformers types the result as any of
    what the call can return: ids, a batch, text)."""
    return cast(str, tokenizer.apply_chat_template(messages, tokenize=False, **options))


@lru_cache(maxsize=8)
def _compiled(template: str):
    try:
        return _compile_jinja_template(template)
    except Exception:  # what apply_chat_template would say about it, it says on the exact path
        return None


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict:
    return {k: v if isinstance(v, str) else list(v) for k, v in tokenizer.special_tokens_map.items()}
