"""Templates in graders' texts: `{{sample.output_text}}`, `{{sample.output_json.<path>}}`, `{{item.<path>}}`
(a path of keys and list indexes, joined by dots). A string value is put in as it is, any other as JSON."""

from __future__ import annotations

import re
from typing import Any

import msgspec

_TAG = re.compile(r"\{\{(.*?)\}\}", re.S)
_PATH = re.compile(r"^(sample|item)((?:\.[^.\s{}]+)*)$")
SAMPLE_FIELDS = ("output_text", "output_json", "output_tools")
HINT = "templates are {{sample.output_text}}, {{sample.output_json.<path>}} or {{item.<path>}}"


class TemplateError(ValueError):
    """A template that is not well formed, or names what the sample or item does not have."""


def references(text: str) -> list[tuple[str, list[str]]]:
    """Each template's namespace and path, in order; TemplateError naming the first one that is wrong."""
    out = []
    for m in _TAG.finditer(text):
        inner = m.group(1).strip()
        found = _PATH.match(inner)
        if found is None:
            raise TemplateError(f"unknown template {m.group(0)!r}; {HINT}")
        space, path = found.group(1), [p for p in found.group(2).split(".") if p]
        if space == "sample" and (not path or path[0] not in SAMPLE_FIELDS):
            raise TemplateError(f"unknown template {m.group(0)!r}: a sample has {', '.join(SAMPLE_FIELDS)}; {HINT}")
        if space == "sample" and path[0] == "output_text" and len(path) > 1:
            raise TemplateError(f"{m.group(0)!r}: output_text is text, it has no fields; {HINT}")
        out.append((space, path))
    rest = _TAG.sub("", text)
    if "{{" in rest:
        raise TemplateError(f"a '{{{{' is never closed by '}}}}' in {text[:80]!r}; {HINT}")
    return out


def check(text: str) -> str | None:
    """Why the text's templates are wrong, or None."""
    try:
        references(text)
    except TemplateError as e:
        return str(e)
    return None


def render(text: str, sample: dict[str, Any], item: Any) -> str:
    """The text with each template replaced; TemplateError naming a field the sample or item lacks."""
    if "{{" not in text:
        return text

    def value(m: re.Match) -> str:
        found = _PATH.match(m.group(1).strip())
        if found is None:
            raise TemplateError(f"unknown template {m.group(0)!r}; {HINT}")
        space, path = found.group(1), [p for p in found.group(2).split(".") if p]
        got = _lookup(sample if space == "sample" else item, path, space)
        return got if isinstance(got, str) else msgspec.json.encode(got).decode()

    return _TAG.sub(value, text)


def _lookup(root: Any, path: list[str], space: str) -> Any:
    node, seen = root, space
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            raise TemplateError(f"{{{{{seen}.{key}}}}}: {seen} has no field {key!r}")
        seen = f"{seen}.{key}"
    return node
