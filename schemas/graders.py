"""OpenAI's grader JSON as msgspec Structs (openai.types.graders), and what a grader grades and returns."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import Struct, field

Role = Literal["user", "assistant", "system", "developer"]
Metric = Literal[
    "cosine", "fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"
]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
GRADER_TYPES = ("string_check", "text_similarity", "python", "score_model", "label_model", "multi")


class _Strict(Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """Unknown fields are refused by name, so a typo is not silently ignored."""


class PromptCacheBreakpoint(_Strict):
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class InputText(_Strict, tag_field="type", tag="input_text"):
    """Text for the judge; may hold templates."""

    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class OutputText(_Strict, tag_field="type", tag="output_text"):
    """A model's earlier output; may hold templates."""

    text: str


class InputImage(_Strict, tag_field="type", tag="input_image"):
    image_url: str
    detail: str | None = None


class InputAudioData(_Strict):
    data: str
    format: Literal["mp3", "wav"]


class InputAudio(_Strict, tag_field="type", tag="input_audio"):
    input_audio: InputAudioData


ContentPart = InputText | OutputText | InputImage | InputAudio
Content = str | ContentPart | list[str | ContentPart]


class InputMessage(_Strict):
    """One message to the judge model (EvalItem): content may hold templates."""

    content: Content
    role: Role
    type: Literal["message"] | None = None


class SamplingParams(_Strict):
    max_completions_tokens: int | None = None
    reasoning_effort: ReasoningEffort | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None


class StringCheckGrader(_Strict, tag_field="type", tag="string_check"):
    """Compares input with reference: eq, ne, like (contains), ilike (contains, any case)."""

    input: str
    name: str
    operation: Literal["eq", "ne", "like", "ilike"]
    reference: str


class TextSimilarityGrader(_Strict, tag_field="type", tag="text_similarity"):
    """Scores input against reference with a text-similarity metric, in [0, 1]."""

    evaluation_metric: Metric
    input: str
    name: str
    reference: str


class PythonGrader(_Strict, tag_field="type", tag="python"):
    """Source defining `grade(sample, item) -> float`, run in a sandbox."""

    name: str
    source: str
    image_tag: str | None = None


class ScoreModelGrader(_Strict, tag_field="type", tag="score_model"):
    """A judge model asked for a number within `range` (default [0, 1])."""

    input: list[InputMessage]
    model: str
    name: str
    range: list[float] | None = None
    sampling_params: SamplingParams | None = None


class LabelModelGrader(_Strict, tag_field="type", tag="label_model"):
    """A judge model asked for one of `labels`; 1 when it is one of `passing_labels`, else 0."""

    input: list[InputMessage]
    labels: list[str]
    model: str
    name: str
    passing_labels: list[str]


class MultiGrader(_Strict, tag_field="type", tag="multi"):
    """Named graders combined by the formula `calculate_output` over their scores. A named grader may itself be a
    multi (OpenAI's types list the other five; jetlora also takes a nested multi)."""

    calculate_output: str
    graders: dict[str, Grader]
    name: str


Grader = StringCheckGrader | TextSimilarityGrader | PythonGrader | ScoreModelGrader | LabelModelGrader | MultiGrader


class Sample(Struct, kw_only=True):
    """What a grader grades: the `sample` namespace of templates and of a python grader's `grade(sample, item)`."""

    output_text: str
    output_json: dict[str, Any] | None = None
    output_tools: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def from_model_sample(cls, text: str) -> Sample:
        """OpenAI's `model_sample`: the text, and `output_json` when the text is a JSON object."""
        try:
            parsed = msgspec.json.decode(text)
        except (msgspec.DecodeError, RecursionError):
            parsed = None
        return cls(output_text=text, output_json=parsed if isinstance(parsed, dict) else None)


class GradeResult(Struct, kw_only=True, omit_defaults=True):
    """One sample's score; `error` says why it scored 0 (empty when it did not fail)."""

    score: float
    error: str = ""
    error_kind: str = ""  # OpenAI's metadata.errors flag: python_grader_runtime_error, formula_parse_error, ...
    sub_scores: dict[str, float] = field(default_factory=dict)  # multi: each named grader's score
    token_usage: int = 0  # tokens the judge model spent (model graders)


def normalize_multi(raw: Any) -> Any:
    """A multi grader whose `graders` is one grader (openai-python's typed shape), as a dict keyed by its name."""
    if isinstance(raw, dict) and raw.get("type") == "multi":
        inner = raw.get("graders")
        if isinstance(inner, dict) and isinstance(inner.get("type"), str):
            return {**raw, "graders": {str(inner.get("name") or inner["type"]): inner}}
    return raw
