"""An eval's item_schema as the JSON Schema it is (Draft 2020-12, by `jsonschema`): the schema itself checked when
the eval is created (a 400 naming the path in the schema: `data_source_config.item_schema.required`), and each
item of a run against it (a 400 naming the row and the path in the item: `data_source.source.content[3].item.answer`,
or the line of the file). References reach only within the schema (`#/$defs/...`): nothing is fetched."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote

import jsonschema
import referencing.exceptions
import regex
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError, best_match

from services.gateway.errors import bad_request

SCHEMA_FIELD = "data_source_config.item_schema"
PATTERN_S = 0.1  # one `pattern` on one value may take this long (a pattern that backtracks without end is refused)


def _search(pattern: str, text: str) -> bool | None:
    """re.search as JSON Schema means it, with a time limit: a tenant's pattern cannot hold the gateway's CPU.
    None: it ran out of its time."""
    try:
        return regex.search(pattern, text, timeout=PATTERN_S) is not None
    except TimeoutError:
        return None


def _too_slow(pattern: str) -> ValidationError:
    return ValidationError(
        f"the pattern {pattern!r} took more than {PATTERN_S}s on one value (it backtracks without end); write a "
        "simpler one"
    )


def _pattern(validator, pattern, instance, schema):
    if validator.is_type(instance, "string"):
        found = _search(pattern, instance)
        if found is None:
            yield _too_slow(pattern)
        elif not found:
            yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if validator.is_type(instance, "object"):
        for pattern, subschema in patterns.items():
            for key, value in instance.items():
                found = _search(pattern, key)
                if found is None:
                    yield _too_slow(pattern)
                elif found:
                    yield from validator.descend(value, subschema, path=key, schema_path=pattern)


Items = validators.extend(Draft202012Validator, {"pattern": _pattern, "patternProperties": _pattern_properties})
_UNUSABLE = (referencing.exceptions.Unresolvable, RecursionError)  # jsonschema wraps the first, keeping its class


def path_of(parts: Iterable[Any], root: str) -> str:
    """A path of keys and indexes as a field: root.key[3].other."""
    out = root
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def check(schema: dict[str, Any]) -> None:
    """A schema an eval can keep, or a 400 naming where it is wrong."""
    try:
        Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        field = path_of(e.absolute_path, SCHEMA_FIELD)
        raise bad_request(f"{field}: {e.message}; an item_schema is a JSON Schema (Draft 2020-12)", field) from None
    except RecursionError:
        raise bad_request(f"{SCHEMA_FIELD}: the schema nests too deep to check", SCHEMA_FIELD) from None
    for ref, where in _refs(schema, SCHEMA_FIELD):
        if not _resolves(schema, ref):
            raise bad_request(
                f"{where}: {ref!r} names nothing within the item_schema; a $ref reaches only within it "
                "(#/$defs/NAME, or an $anchor), nothing is fetched",
                where,
            )


def _refs(node: Any, where: str, depth: int = 0):
    if depth > 100:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("$ref", "$dynamicRef") and isinstance(v, str):
                yield v, f"{where}.{k}"
            else:
                yield from _refs(v, f"{where}.{k}", depth + 1)
    elif isinstance(node, list):
        for n, v in enumerate(node):
            yield from _refs(v, f"{where}[{n}]", depth + 1)


def _resolves(schema: dict[str, Any], ref: str) -> bool:
    if not ref.startswith("#"):
        return False
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        return fragment in {a for a, _ in _anchors(schema)}
    node: Any = schema
    for token in fragment.split("/")[1:]:
        key = token.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return False
    return True


def _anchors(node: Any, depth: int = 0):
    if depth > 100:
        return
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("$anchor", "$dynamicAnchor") and isinstance(v, str):
                yield v, node
            else:
                yield from _anchors(v, depth + 1)
    elif isinstance(node, list):
        for v in node:
            yield from _anchors(v, depth + 1)


def validate_items(items: list[Any], schema: dict[str, Any] | None, where) -> None:
    """Each item valid under the schema, or a 400 from `where(n, path, why)` for the first that is not (n its row,
    path its field within the item: `item.answer`)."""
    if not schema:
        return
    try:
        Draft202012Validator.check_schema(schema)
    except (jsonschema.SchemaError, RecursionError):  # stored before item_schemas were checked
        raise bad_request(
            "the eval's item_schema is not a valid JSON Schema (it was stored before schemas were checked); create "
            "the eval again with a valid one",
            SCHEMA_FIELD,
        ) from None
    validator = Items(schema)
    for n, item in enumerate(items):
        try:
            error = best_match(validator.iter_errors(item))
        except _UNUSABLE as e:
            raise bad_request(
                f"the eval's item_schema cannot be applied to item {n} ({type(e).__name__}: {e}); create the eval "
                "again with references that resolve within it",
                SCHEMA_FIELD,
            ) from None
        if error is not None:
            parts = list(error.absolute_path)
            if error.validator == "required" and isinstance(error.instance, dict):
                missing = [k for k in error.validator_value if k not in error.instance]
                parts += missing[:1]
            raise where(n, path_of(parts, "item"), f"{error.message}, which the eval's item_schema requires")
