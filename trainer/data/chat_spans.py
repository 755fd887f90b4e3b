"""The assistant turns of a rendered conversation, found in that one render.

The exact way (formats.render_chat) renders the conversation up to each assistant turn and compares prefixes:
about five renders for a two-turn row. A template that writes each turn as header, content, end marker, and
earlier turns as they were, lets each turn be found in the one render of the whole conversation: what the
template writes just before an assistant's content and just after it is learnt once per template, from a probe
conversation, and each turn is accepted only where its content stands, verbatim, between the two. A row where
that does not hold is left to the exact way, which says what is wrong with the template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainer.data.chat_render import template_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_USER, _ASSISTANT = "\ue000", "\ue001"  # private-use characters: nothing a template writes contains them


@dataclass(frozen=True)
class TurnMarks:
    """What a template writes just before an assistant turn's content (header) and just after it: its end of
    turn (learnt with the content; may be empty) and the whitespace that follows it (not learnt)."""

    header: str
    end: str
    gap: str


def turn_marks(tokenizer: PreTrainedTokenizerBase) -> TurnMarks | None:
    """This template's marks, or None when its turns do not render so (the exact way is then used throughout)."""
    user = {"role": "user", "content": _USER}
    render = lambda messages, **kw: template_text(tokenizer, messages, **kw)  # noqa: E731
    try:
        asked, prompted = render([user]), render([user], add_generation_prompt=True)
        answered = render([user, {"role": "assistant", "content": _ASSISTANT}])
    except Exception:  # a template that refuses the probe (e.g. one that wants a system turn first)
        return None
    at = answered.find(_ASSISTANT)
    if at < 0 or not prompted.startswith(asked) or answered[:at] != prompted:
        return None
    header, after = prompted[len(asked) :], answered[at + 1 :]
    end = after.rstrip()
    if not header or not after or _ASSISTANT in after:
        return None
    return TurnMarks(header, end, after[len(end) :])


def assistant_spans(text: str, messages: list, marks: TurnMarks) -> list[tuple[int, int]] | None:
    """The [start, end) of each learnt assistant turn (content and end marker) in the rendered text, in order;
    None when some turn is not there as the marks say (the caller falls back to the exact way)."""
    spans, cursor = [], 0
    for m in messages:
        if m.role != "assistant":
            found = text.find(m.content, cursor)
            cursor = found + len(m.content) if found >= 0 else cursor
            continue
        at = text.find(marks.header + m.content + marks.end + marks.gap, cursor)
        # without an end marker the exact way's span stops where the turn's text does, trailing spaces dropped
        learnt = m.content + marks.end if marks.end else m.content.rstrip()
        if at < 0 or not learnt:
            return None
        start = at + len(marks.header)
        cursor = start + len(m.content) + len(marks.end)
        if m.weight != 0:
            spans.append((start, start + len(learnt)))
    return spans
