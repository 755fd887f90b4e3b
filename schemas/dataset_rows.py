"""What each dataset format asks of a row beyond its types, and which format a file's first row says it is: the
rules the streaming check (schemas/dataset_check.py) applies to every row."""

from __future__ import annotations

import msgspec

from schemas.datasets import FORMATS, ROLES, DatasetFormat

_any = msgspec.json.Decoder()
_SIGNATURES: dict[DatasetFormat, set[str]] = {
    "chat": {"messages"},
    "qa": {"q", "a"},
    "alpaca": {"instruction", "output"},
    "text": {"text"},
    "preference": {"input", "preferred_output", "non_preferred_output"},
}


class DatasetInvalid(Exception):
    """A file that is not a dataset jetlora can store: what is wrong, where, and how to fix it."""

    def __init__(self, errors: list[str], summary: str = "") -> None:
        super().__init__(summary or "; ".join(errors))
        self.errors = errors


def detect_format(row: bytes) -> DatasetFormat:
    """The format a row's keys say; DatasetInvalid when none or more than one fits."""
    try:
        obj = _any.decode(row)
    except msgspec.DecodeError as e:
        raise DatasetInvalid([f"the first row is not JSON ({e})"]) from None
    keys = set(obj) if isinstance(obj, dict) else set()
    fits = [fmt for fmt, needed in _SIGNATURES.items() if needed <= keys]
    if fits == ["chat"]:
        fits = _chat_or_rft(obj["messages"])
    if len(fits) == 1:
        return fits[0]
    known = "; ".join(f"{fmt}: {shape}" for fmt, shape in FORMATS.items())
    if not fits:
        raise DatasetInvalid(
            [f"the first row's keys {sorted(keys)} fit no format ({known}); fix the rows or say --format"]
        )
    raise DatasetInvalid([f"the first row fits several formats ({', '.join(fits)}); say which with --format"])


def _chat_or_rft(messages) -> list[DatasetFormat]:
    """chat and rft rows both hold messages: ending with an answer, a chat row; with no answer at all, an rft row
    (the turn the model is to answer); ending unanswered after earlier answers, either (--format says which)."""
    roles = [m.get("role") for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []
    if not roles or roles[-1] == "assistant":
        return ["chat"]
    return ["chat", "rft"] if "assistant" in roles else ["rft"]


def row_error(fmt: str, row) -> str | None:
    """What is wrong with one decoded row beyond its types, or None."""
    if fmt == "evals":
        return None  # any JSON object: what an eval's runs need of it is theirs to check (its item_schema)
    if fmt == "qa":
        return None if row.q.strip() and row.a.strip() else "q and a must both have text"
    if fmt == "alpaca":
        return None if row.instruction.strip() and row.output.strip() else "instruction and output must both have text"
    if fmt == "text":
        return None if row.text.strip() else "text is empty"
    if fmt == "preference":
        return _preference_error(row)
    if fmt == "rft":
        return _rft_error(row)
    if not row.messages:
        return "messages is empty; a conversation needs at least a user and an assistant message"
    for n, m in enumerate(row.messages, 1):
        if m.role not in ROLES:
            return f"message {n} has role {m.role!r}; roles are {', '.join(ROLES)}"
        if m.weight not in (None, 0, 1):
            return f"message {n} has weight {m.weight}; a weight is 0 (context only) or 1 (learnt)"
        if m.weight is not None and m.role != "assistant":
            return f"message {n} is a {m.role} message with a weight; only assistant messages take one"
    if not any(m.role == "assistant" and m.weight != 0 for m in row.messages):
        return "no assistant message to learn (none, or all have weight 0); add one or drop the row"
    return None


def _preference_error(row) -> str | None:
    if not row.input.messages or row.input.messages[-1].role == "assistant":
        return "input.messages must hold the conversation up to the answer, ending with a user (or system) message"
    for n, m in enumerate(row.input.messages, 1):
        if m.role not in ROLES:
            return f"input.messages[{n}] has role {m.role!r}; roles are {', '.join(ROLES)}"
    for side in ("preferred_output", "non_preferred_output"):
        out = getattr(row, side)
        if len(out) != 1 or out[0].role != "assistant" or not out[0].content.strip():
            return f'{side} must be one assistant message with text, e.g. [{{"role": "assistant", "content": "..."}}]'
    if row.preferred_output[0].content == row.non_preferred_output[0].content:
        return "preferred_output and non_preferred_output are the same answer; a pair must differ to teach anything"
    return None


def _rft_error(row) -> str | None:
    if not row.messages:
        return "messages is empty; an rft row holds the conversation up to the user turn the model answers"
    for n, m in enumerate(row.messages, 1):
        if m.role not in ROLES:
            return f"message {n} has role {m.role!r}; roles are {', '.join(ROLES)}"
    if row.messages[-1].role != "user":
        return (
            f"the messages end with a {row.messages[-1].role} message; an rft row ends with the user turn the model "
            "answers (its answers are sampled and graded, never given): drop the answer, or upload the rows as chat"
        )
    return None
