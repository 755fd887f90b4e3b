"""Turning request bytes into a typed request, or into every error a submitter should fix at once."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from msgspec import Struct

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)
_json_any = msgspec.json.Decoder()
_PATTERN_MEANINGS: dict[str, str] = {}  # msgspec's words for a failed pattern -> ours


def pattern(regex: str, meaning: str) -> str:
    """A regex for Meta(pattern=...): the JSON Schema shows the regex, a submitter who misses it reads `meaning`."""
    _PATTERN_MEANINGS[f"Expected `str` matching regex {regex!r}"] = meaning
    return regex


class FieldError(Struct):
    """One thing wrong with a request: where, and how to fix it."""

    field: str
    reason: str


class InvalidRequest(Exception):
    """A request that does not decode or does not hold: each error names its field and the fix."""

    def __init__(self, errors: list[FieldError]) -> None:
        super().__init__("; ".join(f"{e.field or '(request)'}: {e.reason}" for e in errors))
        self.errors = errors


def field_error(err: msgspec.ValidationError, prefix: str = "") -> FieldError:
    """msgspec says `... - at `$.train.batch_size``: split that into field and reason."""
    text = str(err)
    reason, where = text, ""
    if " - at `" in text:
        reason, _, where = text.rpartition(" - at `")
        where = where.rstrip("`").removeprefix("$").removeprefix(".")
    named = re.search(r"(?:missing required|unknown) field `([^`]+)`", reason)
    if named:
        where = f"{where}.{named.group(1)}" if where else named.group(1)
    if "unknown field" in reason:
        reason += "; remove it (see schemas/json/ for the fields)"
    reason = _PATTERN_MEANINGS.get(reason, reason)
    where = ".".join(p for p in (prefix, where) if p).replace(".[", "[")
    return FieldError(field=where, reason=reason)


def not_json(e: Exception, hint: str) -> FieldError:
    return FieldError("", f"the request is not valid JSON ({e}); {hint}")


def decoder_for(request_type: type[T], hint: str = "send a JSON object") -> Callable[[bytes], T]:
    """A cached msgspec decoder that raises InvalidRequest naming the field; an empty body reads as `{}`."""
    decoder = msgspec.json.Decoder(request_type)

    def decode(data: bytes) -> T:
        try:
            return decoder.decode(data or b"{}")
        except msgspec.ValidationError as e:
            raise InvalidRequest([field_error(e)]) from None
        except msgspec.DecodeError as e:
            raise InvalidRequest([not_json(e, hint)]) from None
        except RecursionError:
            raise InvalidRequest([FieldError("", f"the JSON nests too deeply to be read; {hint}")]) from None

    return decode


def _struct_type(tp) -> type | None:
    """The Struct class a field holds (itself or as `X | None`), else None."""
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return tp
    args = getattr(tp, "__args__", ())
    structs = [a for a in args if isinstance(a, type) and issubclass(a, msgspec.Struct)]
    return structs[0] if len(structs) == 1 and all(a in (structs[0], type(None)) for a in args) else None


def struct_errors(value: Any, cls: type[msgspec.Struct], prefix: str = "") -> list[FieldError]:
    """Every field of `value` (decoded JSON) that does not fit `cls`, each checked on its own, nested Structs
    field by field, so one bad field does not hide the next."""
    if not isinstance(value, dict):
        try:
            msgspec.convert(value, cls)
        except msgspec.ValidationError as e:
            return [field_error(e, prefix)]
        return []
    errors = []
    fields = {f.encode_name: f for f in msgspec.structs.fields(cls)}
    if cls.__struct_config__.forbid_unknown_fields:
        for key in value:
            if key not in fields:
                errors.append(
                    FieldError(
                        ".".join(p for p in (prefix, key) if p),
                        "unknown field; remove it (see schemas/json/ for the fields)",
                    )
                )
    for name, f in fields.items():
        where = ".".join(p for p in (prefix, name) if p)
        if name not in value:
            if f.required:
                errors.append(FieldError(where, f"missing required field `{name}`"))
            continue
        nested = _struct_type(f.type)
        if nested is not None and isinstance(value[name], dict):
            errors += struct_errors(value[name], nested, where)
            continue
        try:
            msgspec.convert(value[name], f.type, strict=True)
        except msgspec.ValidationError as e:
            errors.append(field_error(e, where))
    return errors


def parse_all(
    data: bytes, cls: type[S], checks: Callable[[S], list[FieldError]], placeholders: dict[str, Any], hint: str
) -> S:
    """Decode `data` as `cls` and run `checks` on it; raise InvalidRequest with every error found at once.

    When some fields are wrong, the checks still run on the rest: wrong fields fall back to their defaults (or to
    `placeholders` for required ones) and checks about them are not repeated. JSON that cannot even be read as
    values (nested too deep, a number out of range) is refused as a whole, saying so."""
    try:
        return _parse_all(data, cls, checks, placeholders, hint)
    except RecursionError:
        raise InvalidRequest([FieldError("", f"the JSON nests too deeply to be read; {hint}")]) from None
    except msgspec.ValidationError as e:  # what even a plain JSON value cannot hold, e.g. the number 1e999
        reason = str(e).split(" - at ")[0]
        raise InvalidRequest([FieldError("", f"{reason} (a number too large for a float?); {hint}")]) from None


def _parse_all(
    data: bytes, cls: type[S], checks: Callable[[S], list[FieldError]], placeholders: dict[str, Any], hint: str
) -> S:
    try:
        return_value = msgspec.json.decode(data, type=cls)
    except msgspec.ValidationError:
        return_value = None
    except msgspec.DecodeError as e:
        raise InvalidRequest([not_json(e, hint)]) from None
    if return_value is not None:
        errors = checks(return_value)
        if errors:
            raise InvalidRequest(errors)
        return return_value
    raw = _json_any.decode(data)
    errors = struct_errors(raw, cls) or [field_error(_validation_error(data, cls))]
    if isinstance(raw, dict):
        bad = {e.field.split(".")[0].split("[")[0] for e in errors}
        repaired = {k: v for k, v in raw.items() if k not in bad}
        repaired.update({k: v for k, v in placeholders.items() if k in bad})
        try:
            errors += [
                e for e in checks(msgspec.convert(repaired, cls)) if e.field.split(".")[0].split("[")[0] not in bad
            ]
        except msgspec.ValidationError:
            pass  # a nested field broke the repair too: the errors found so far are what can be said
    raise InvalidRequest(errors)


def _validation_error(data: bytes, cls) -> msgspec.ValidationError:
    try:
        msgspec.json.decode(data, type=cls)
    except msgspec.ValidationError as e:
        return e
    raise AssertionError("unreachable: the request decoded")
