"""Graders checked at the door, where OpenAI checks them: a reinforcement job's grader at fine_tuning.jobs.create
and each testing criterion at evals.create, as /graders/validate checks a grader (every field; a python grader's
source loaded in the sandbox: it compiles and defines grade()), and its `{{item.<path>}}` templates resolved
against what the items will be: the first rows of the job's files, or the eval's item_schema. A refusal is a 400
naming the path as the client sent it (`method.reinforcement.grader.source`, `testing_criteria[1].reference`).

What runs the grader later is not the gateway (a job's on its node, an eval's in the evals service), so what only
that host can say (a judge engine configured, python graders allowed there) is left to it; where this gateway may
not run python graders itself (`--python-graders`), their source is checked by that host when it loads it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from schemas.graders import (
    Grader,
    LabelModelGrader,
    MultiGrader,
    PythonGrader,
    ScoreModelGrader,
    StringCheckGrader,
    TextSimilarityGrader,
)
from services.gateway.errors import bad_request
from services.gateway.graders import Graders
from services.graders import Deadline, sandbox, templates

ROWS_CHECKED = 3  # a job's file rows each `{{item.x}}` is resolved against (the trainer checks every row later)


async def sources_load(graders: Graders, tenant: str, grader: Grader, field: str) -> None:
    """Each python grader's source loaded in the sandbox, as /graders/validate loads it (on the tenant's grader
    turns, within one request's sandbox time): a 400 naming its `source` when it does not compile or defines no
    grade(). Call it on a grader that check() passed."""
    sources = [(g, where) for g, where in leaves(grader, field) if isinstance(g, PythonGrader)]
    if not sources or sandbox.refusal(graders.context):
        return  # none, or not allowed to run here: the host that runs it checks it as it loads it
    s = graders.context.request_sandbox_s
    deadline = Deadline.after(s, f"this request's {s:g} s of sandbox time (its python graders' loads together)")
    async with graders.turns.turn(tenant):
        for g, where in sources:
            why = await sandbox.check_source_async(g.source, graders.context, deadline)
            if why:
                raise bad_request(
                    f"{where}.source: {why}; define grade(sample, item) returning a number",
                    f"{where}.source",
                    "invalid_grader",
                )


def leaves(grader: Grader, field: str) -> Iterator[tuple[Grader, str]]:
    """Each grader that is not a multi, with its path."""
    if isinstance(grader, MultiGrader):
        for name, sub in grader.graders.items():
            yield from leaves(sub, f"{field}.graders.{name}")
    else:
        yield grader, field


def texts(grader: Grader, field: str) -> Iterator[tuple[str, str]]:
    """Each text of the grader that may hold templates, with its path."""
    for g, where in leaves(grader, field):
        if isinstance(g, (StringCheckGrader, TextSimilarityGrader)):
            yield g.input, f"{where}.input"
            yield g.reference, f"{where}.reference"
        elif isinstance(g, (ScoreModelGrader, LabelModelGrader)):
            for k, message in enumerate(g.input):
                yield from _content(message.content, f"{where}.input[{k}].content")


def _content(content: Any, field: str) -> Iterator[tuple[str, str]]:
    if isinstance(content, str):
        yield content, field
        return
    parts = content if isinstance(content, list) else [content]
    for k, part in enumerate(parts):
        where = f"{field}[{k}]" if isinstance(content, list) else field
        if isinstance(part, str):
            yield part, where
        elif hasattr(part, "text"):
            yield part.text, f"{where}.text"
        elif hasattr(part, "image_url"):
            yield part.image_url, f"{where}.image_url"


def item_paths(grader: Grader, field: str) -> Iterator[tuple[list[str], str]]:
    """Each `{{item.<path>}}` of the grader: the path's keys, and the field it is in."""
    for text, where in texts(grader, field):
        for space, path in templates.references(text):  # check() has refused any that does not parse
            if space == "item" and path:
                yield path, where


def against_rows(grader: Grader, field: str, rows: list[Any], file: str, param: str) -> None:
    """Each `{{item.<path>}}` found in each row (a job's item is its row), or a 400 naming the template's field."""
    for path, where in item_paths(grader, field):
        for n, row in enumerate(rows):
            missing = _missing(row, path)
            if missing is not None:
                raise bad_request(
                    f"{where}: {{{{item.{'.'.join(path)}}}}}: row {n + 1} of {param} {file} has no field "
                    f"{missing!r}; the grader reads it from every row: add it to the rows, or fix the template",
                    where,
                    "invalid_grader",
                )


def _missing(node: Any, path: list[str]) -> str | None:
    for key in path:
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return key
    return None


def against_schema(grader: Grader, field: str, schema: dict[str, Any]) -> None:
    """Each `{{item.<path>}}` declared by the eval's item_schema, or a 400 naming the template's field. A path is
    followed through `properties` (and `items` for a list index) as far as the schema declares them; a key that an
    object's declared properties do not have is refused unless its additionalProperties allows one."""
    for path, where in item_paths(grader, field):
        missing = _undeclared(schema, path)
        if missing is not None:
            raise bad_request(
                f"{where}: {{{{item.{'.'.join(path)}}}}}: the eval's item_schema declares no {missing!r}; declare it "
                "in data_source_config.item_schema's properties, or fix the template",
                where,
                "invalid_grader",
            )


def _undeclared(schema: Any, path: list[str]) -> str | None:
    node = schema
    for key in path:
        if not isinstance(node, dict):
            return None
        properties, extra = node.get("properties"), node.get("additionalProperties")
        if isinstance(properties, dict) and key in properties:
            node = properties[key]
        elif key.isdigit() and isinstance(node.get("items"), dict):
            node = node["items"]
        elif isinstance(properties, dict) and extra in (None, False):
            return key
        else:
            return None  # the schema says no more of it: anything may be there
    return None
