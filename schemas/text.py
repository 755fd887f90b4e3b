"""Text a field may hold: some text, one printable line, a name."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from schemas.validate import pattern

Text = Annotated[str, Meta(pattern=pattern(r"\S", "must have some text, not only spaces"))]
_CONTROLS = "\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"  # and the bidi overrides
OneLine = Annotated[
    str,
    Meta(
        pattern=pattern(
            f"^[^{_CONTROLS}]*\\Z",
            "must be one line of printable text: no control "
            "characters (newlines, tabs, escape sequences, bidi overrides)",
        )
    ),
]
Name = Annotated[
    str,
    Meta(
        pattern=pattern(
            f"^(?=.*\\S)[^{_CONTROLS}]*\\Z",
            "must be one line of printable text, not "
            "only spaces: no control characters (newlines, tabs, escape sequences)",
        )
    ),
]
