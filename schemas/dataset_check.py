"""Checking a JSON-lines dataset row by row as its bytes stream past: the format, every row, the limits, the stats.

The same check runs in `jetlora datasets put` (before sending) and in the artifact service (before storing),
so a file with one bad row anywhere is refused whole, with the line numbers of its first bad rows.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Literal

import msgspec

from schemas.dataset_rows import DatasetInvalid, detect_format, row_error
from schemas.datasets import (
    FORMATS,
    HEAD_CHARS,
    HEAD_ROWS,
    ROLES,
    ROW_TYPES,
    DatasetFormat,
    DatasetLimits,
    DatasetStats,
)

__all__ = ["DatasetChecker", "DatasetInvalid", "UTF8_BOM", "check_file", "detect_format", "row_error"]

UTF8_BOM = b"\xef\xbb\xbf"
_decoders: dict[str, msgspec.json.Decoder] = {fmt: msgspec.json.Decoder(t) for fmt, t in ROW_TYPES.items()}
_CHAT_ROLES = ("system", "user", "assistant")  # what _chat_counts counts, in its order
assert set(_CHAT_ROLES) == set(ROLES), "_chat_counts counts each role by name"
_BLANK_LINE_AFTER = re.compile(rb"\n[ \t\r\n]")  # a line that begins with JSON whitespace may be blank


def _where(e: msgspec.ValidationError) -> str:
    text = str(e)
    reason, _, where = text.rpartition(" - at `")
    if not reason:
        return text
    return f"{where.rstrip('`').removeprefix('$').removeprefix('.') or 'the row'}: {reason}"


def _chat_counts(row) -> tuple[int, int, int, int, int] | None:
    """A chat row's (characters, assistant turns learnt, system, user and assistant messages); None when it breaks
    a rule (row_error says which): a role not in ROLES, a weight not 0 or 1 or on another role, nothing to learn."""
    chars = trained = system = user = assistant = 0
    for m in row.messages:
        role = m.role
        if role == "assistant":
            weight = m.weight
            if weight is None or weight == 1:
                trained += 1
            elif weight != 0:
                return None
            assistant += 1
        elif m.weight is not None:
            return None
        elif role == "user":
            user += 1
        elif role == "system":
            system += 1
        else:
            return None
        chars += len(m.content)
    return (chars, trained, system, user, assistant) if trained else None


class DatasetChecker:
    """Feed it the file's bytes in any pieces; finish() returns the stats or raises DatasetInvalid."""

    def __init__(self, fmt: DatasetFormat | Literal["auto"] = "auto", limits: DatasetLimits | None = None) -> None:
        self.fmt: DatasetFormat | None = None if fmt == "auto" else fmt
        self.limits = limits or DatasetLimits()
        self.partial = b""
        self.line = 0
        self.rows = 0
        self.size = 0
        self.errors: list[str] = []
        self.bad_rows = 0
        self.chars = 0
        self.chars_max = 0
        self.roles: Counter[str] = Counter()
        self.turns_trained = 0
        self.head: list[str] = []

    def feed(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limits.max_bytes:
            self._refuse(
                f"the file is over {self.limits.max_bytes:,} bytes, the service's limit (max_bytes); "
                "split it, or raise the limit (jetlora artifacts --dataset-max-mib)"
            )
        data = self.partial + data
        end = data.rfind(b"\n")
        self.partial = data[end + 1 :]
        if end >= 0 and not self._block(data, end):
            for line in data[:end].split(b"\n"):
                self._row(line)
        if len(self.partial) > self.limits.max_row_bytes:
            self._refuse_long_row(self.line + 1)

    def _block(self, data: bytes, end: int) -> bool:
        """The whole lines data[:end] checked at once (one decode for all of them), where that gives what the line
        by line check would; False where it may not (the first rows, a blank line, any error): then they go line by
        line."""
        if self.fmt in (None, "evals") or len(self.head) < HEAD_ROWS or end > self.limits.max_row_bytes:
            return False
        if data[:1].isspace() or _BLANK_LINE_AFTER.search(data, 0, end):
            return False  # no line is blank, so each holds a row or more, and as many rows as lines is one each
        try:
            rows = _decoders[self.fmt].decode_lines(memoryview(data)[:end])
        except msgspec.DecodeError:
            return False
        if len(rows) != data.count(b"\n", 0, end) + 1 or self.rows + len(rows) > self.limits.max_rows:
            return False  # a line with two rows in it; or over the limit, refused at its line
        self.rows += len(rows)
        if self.fmt == "chat":
            self._chat_rows(rows)
            return True
        for row in rows:
            self.line += 1
            if reason := row_error(self.fmt, row):
                self._bad(reason)
            else:
                self._count(row, b"")
        return True

    def _chat_rows(self, rows: list) -> None:
        """A block of chat rows: the rules and the stats in one pass (the common case at size)."""
        first_line, system, user, assistant = self.line + 1, 0, 0, 0
        chars_all, chars_max, trained_all = 0, self.chars_max, 0
        for i, row in enumerate(rows):
            if (counted := _chat_counts(row)) is None:
                self.line = first_line + i
                self._bad(row_error("chat", row) or "")  # raises in the service, which stops at the first bad row
                continue
            chars, trained, s, u, a = counted
            chars_all, trained_all, chars_max = chars_all + chars, trained_all + trained, max(chars_max, chars)
            system, user, assistant = system + s, user + u, assistant + a
        self.line = first_line + len(rows) - 1
        self.chars, self.chars_max = self.chars + chars_all, chars_max
        self.turns_trained += trained_all
        self.roles.update({role: n for role, n in zip(_CHAT_ROLES, (system, user, assistant)) if n})

    def finish(self) -> DatasetStats:
        if self.partial:
            self._row(self.partial)
            self.partial = b""
        if self.errors:
            self._refuse_bad_rows()
        if not self.rows:
            raise DatasetInvalid(["the file has no rows; a dataset is JSON lines, one example per line"])
        assert self.fmt is not None  # the first row set it
        return DatasetStats(
            format=self.fmt,
            rows=self.rows,
            chars_mean=round(self.chars / self.rows, 1),
            chars_max=self.chars_max,
            roles=dict(self.roles),
            turns_trained=self.turns_trained,
            head=self.head,
        )

    def _row(self, line: bytes) -> None:
        self.line += 1
        if self.line == 1:
            line = line.removeprefix(UTF8_BOM)  # Excel and Windows tools begin a UTF-8 file with one
        line = line.removesuffix(b"\r")  # a CRLF file's line ends
        if len(line) > self.limits.max_row_bytes:
            self._refuse_long_row(self.line)
        if not line.strip():
            return  # blank lines are skipped, by the trainer too
        if self.fmt is None:
            self.fmt = detect_format(line)
        self.rows += 1
        if self.rows > self.limits.max_rows:
            self._refuse(
                f"the file has more than {self.limits.max_rows:,} rows, the service's limit (max_rows); "
                "split it, or raise the limit (jetlora artifacts --dataset-max-rows)"
            )
        try:
            row = _decoders[self.fmt].decode(line)
        except msgspec.ValidationError as e:
            return self._bad(f"{_where(e)}; a {self.fmt} row is {FORMATS[self.fmt]}")
        except msgspec.DecodeError as e:
            return self._bad(f"not JSON ({e})")
        if self.fmt == "chat":  # the common case at size: its rules and its stats in one pass over the messages
            return self._chat(row, line)
        if reason := row_error(self.fmt, row):
            return self._bad(reason)
        self._count(row, line)

    def _chat(self, row, line: bytes) -> None:
        if (counted := _chat_counts(row)) is None:
            return self._bad(row_error("chat", row) or "")  # the rules' own words for what is wrong
        chars, trained, *by_role = counted
        self.roles.update({role: n for role, n in zip(_CHAT_ROLES, by_role) if n})
        self.turns_trained += trained
        self._counted(chars, line)

    def _count(self, row, line: bytes) -> None:
        if self.fmt == "qa":
            chars = len(row.q) + len(row.a)
        elif self.fmt == "alpaca":
            chars = len(row.instruction) + len(row.input) + len(row.output)
        elif self.fmt == "preference":
            chars = sum(len(m.content) for m in row.input.messages + row.preferred_output + row.non_preferred_output)
        elif self.fmt == "rft":
            chars = sum(len(m.content) for m in row.messages)
            self.roles.update(m.role for m in row.messages)
        elif self.fmt == "evals":  # no text of its own: the row's JSON, as sent (evals rows go line by line)
            chars = len(line)
        else:
            chars = len(row.text)
        self._counted(chars, line)

    def _counted(self, chars: int, line: bytes) -> None:
        self.chars += chars
        self.chars_max = max(self.chars_max, chars)
        if len(self.head) < HEAD_ROWS:
            self.head.append(line.decode(errors="replace")[:HEAD_CHARS])

    def _bad(self, reason: str) -> None:
        self.bad_rows += 1
        if len(self.errors) < self.limits.max_errors:
            self.errors.append(f"line {self.line:,}: {reason}")
        if len(self.errors) >= self.limits.max_errors:
            self._refuse_bad_rows()

    def _refuse_bad_rows(self) -> None:
        if self.limits.max_errors == 1:  # the service: it stops the transfer at the first
            raise DatasetInvalid(
                self.errors, f"{self.errors[0]}; nothing was stored (the check stops at the first bad row)"
            )
        more = " (and maybe more: the check stops there)" if len(self.errors) >= self.limits.max_errors else ""
        raise DatasetInvalid(
            self.errors, f"{self.bad_rows} bad row(s){more}, nothing was stored; {'; '.join(self.errors)}"
        )

    def _refuse_long_row(self, line: int) -> None:
        self._refuse(
            f"line {line:,} is over {self.limits.max_row_bytes:,} bytes, the limit of one row "
            "(max_row_bytes); shorten it, or raise the limit (jetlora artifacts --dataset-max-row-kib)"
        )

    def _refuse(self, reason: str) -> None:
        raise DatasetInvalid([reason], f"{reason}; nothing was stored")


def check_file(
    path, fmt: DatasetFormat | Literal["auto"] = "auto", limits: DatasetLimits | None = None, block: int = 1 << 20
) -> DatasetStats:
    """Check a whole file on disk (what `jetlora datasets put` does before sending)."""
    checker = DatasetChecker(fmt, limits)
    with open(path, "rb") as f:
        while data := f.read(block):
            checker.feed(data)
    return checker.finish()
