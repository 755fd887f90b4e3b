"""Text from the bus made safe for a terminal: what a job, an agent or a tenant wrote is shown, never obeyed."""

from __future__ import annotations

import re

_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str, one_line: bool = True) -> str:
    """`text` with each control character (escape sequences, NUL, bidi overrides; newlines and tabs too when
    one_line) written as its escape, e.g. '\\x1b'."""
    escaped = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode(), text)
    return escaped.replace("\n", "\\n").replace("\t", "\\t") if one_line else escaped


def cell(text: str):
    """A table cell that rich prints as it is: escaped, and never read as rich's [markup]."""
    from rich.text import Text

    return Text(printable(text))
