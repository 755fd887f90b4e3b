"""An eval's item_schema is matched with a time limit per pattern: a pattern that backtracks without end is a
refusal naming it, never a gateway thread held for minutes."""

from __future__ import annotations

import time

import pytest

from services.gateway.errors import OpenAIError
from services.gateway.evals.item_schema import PATTERN_S, validate_items


def where(n, path, why):
    return OpenAIError(400, f"row {n}: {path}: {why}", path)


def test_a_pattern_that_backtracks_without_end_is_refused_within_its_time():
    schema = {"type": "object", "properties": {"answer": {"type": "string", "pattern": "^(a|aa)+$"}}}
    started = time.monotonic()
    with pytest.raises(OpenAIError) as refused:
        validate_items([{"answer": "a" * 64 + "!"}], schema, where)
    assert time.monotonic() - started < 20 * PATTERN_S
    assert "backtracks" in str(refused.value) and refused.value.error.param == "item.answer"


def test_patterns_still_match_as_json_schema_means():
    schema = {
        "type": "object",
        "properties": {"id": {"pattern": "^q-\\d+$"}},
        "patternProperties": {"^x-": {"type": "integer"}},
    }
    validate_items([{"id": "q-12", "x-n": 3}], schema, where)
    with pytest.raises(OpenAIError, match="does not match"):
        validate_items([{"id": "q-12"}, {"id": "12"}], schema, where)
    with pytest.raises(OpenAIError, match="is not of type 'integer'"):
        validate_items([{"id": "q-1", "x-n": "three"}], schema, where)
