"""Text from the bus made safe for a terminal: what a job, an agent or a tenant wrote is shown, never obeyed; and a
model's answer shown readably (an untrained base's bytes are not an answer)."""

from __future__ import annotations

import re

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNREADABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufffd]")
NO_ANSWER = "(no answer yet: random weights)"  # the dashboard's page says the same (web/src/text.js)


def printable(text: str, one_line: bool = True) -> str:
    """`text` with each control character (escape sequences, NUL, bidi overrides; newlines and tabs too when
    one_line) written as its escape, e.g. '\\x1b'."""
    escaped = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
    return escaped.replace("\n", "\\n").replace("\t", "\\t") if one_line else escaped


def readable(text: str) -> bool:
    """Whether a model's answer is text a person can read: no control character (newlines and tabs aside) and no
    byte that did not decode (U+FFFD), but for those of a character cut at the end (the token budget ran out)."""
    kept = text.rstrip("\ufffd")
    return not _UNREADABLE.search(kept) and (bool(kept.strip()) or kept == text)


def base_answer(text: str) -> str:
    """How a base model's answer is shown: as it is when readable, else NO_ANSWER (a base with random weights, as
    the demo's, answers with bytes)."""
    return text.strip() if readable(text) else NO_ANSWER


def cell(text: str):
    """A table cell that rich prints as it is: escaped, and never read as rich's [markup]."""
    from rich.text import Text

    return Text(printable(text))
