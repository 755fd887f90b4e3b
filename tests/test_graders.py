"""OpenAI's graders (services/graders) against tables of known inputs and outputs: string_check's operations,
text_similarity's metrics checked against the libraries' own values, templates of sample and item fields, multi's
formula with nested graders; bad graders refused by check() naming the field; score_model and label_model against
a real local HTTP server speaking OpenAI's chat completions shape."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from aiohttp import web

from schemas.graders import Sample
from services.graders import GraderContext, check, grade_many, grade_many_async
from services.graders.decode import decode_grader
from services.graders.similarity import words
from tests.conftest import ROOT

CTX = GraderContext()


def grader(raw: dict):
    found, errors = decode_grader(raw)
    assert found is not None, errors
    return found


def grade(raw: dict, output: str, item: dict | None = None, ctx: GraderContext = CTX):
    [result] = grade_many(grader(raw), [Sample.from_model_sample(output)], [item or {}], ctx)
    return result


def fields(raw: dict, ctx: GraderContext | None = None) -> dict[str, str]:
    found, errors = decode_grader(raw)
    if found is not None:
        errors = check(found, "grader", ctx)
    return {e.field: e.reason for e in errors}


def string_check(op: str, input: str = "{{sample.output_text}}", reference: str = "{{item.answer}}") -> dict:
    return {"type": "string_check", "name": "s", "operation": op, "input": input, "reference": reference}


@pytest.mark.parametrize(
    "op,output,answer,score",
    [
        ("eq", "Paris", "Paris", 1.0),
        ("eq", "Paris", "paris", 0.0),
        ("eq", "Paris ", "Paris", 0.0),
        ("ne", "Paris", "Rome", 1.0),
        ("ne", "Paris", "Paris", 0.0),
        ("like", "The answer is Paris.", "Paris", 1.0),
        ("like", "The answer is paris.", "Paris", 0.0),
        ("like", "Paris", "The answer is Paris", 0.0),  # the input contains the reference, not the other way
        ("ilike", "THE ANSWER IS PARIS", "paris", 1.0),
        ("ilike", "Rome", "paris", 0.0),
    ],
)
def test_string_check_operations(op, output, answer, score):
    result = grade(string_check(op), output, {"answer": answer})
    assert (result.score, result.error) == (score, "")


def _library_values(metric: str, hyp: str, ref: str) -> float:
    """What each library itself says, called directly."""
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz, utils

        return fuzz.WRatio(hyp, ref, processor=utils.default_process) / 100
    if metric == "bleu":
        import sacrebleu

        return sacrebleu.sentence_bleu(hyp, [ref]).score / 100
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return sentence_gleu([words(ref)], words(hyp))
    if metric == "meteor":
        from nltk.translate.meteor_score import meteor_score

        class NoSynonyms:
            def synsets(self, word):
                return []

        return meteor_score([words(ref)], words(hyp), wordnet=NoSynonyms())
    from rouge_score import rouge_scorer

    kind = "rouge" + metric.removeprefix("rouge_").upper()
    return rouge_scorer.RougeScorer([kind]).score(ref, hyp)[kind].fmeasure


METRICS = ["fuzzy_match", "bleu", "gleu", "meteor", "rouge_1", "rouge_2", "rouge_3", "rouge_4", "rouge_5", "rouge_l"]
REFERENCE = "the quick brown fox jumps over the lazy dog near the river bank"
PAIRS = {
    "identical": REFERENCE,
    "disjoint": "an entirely unrelated sentence about ships",
    "partial": "the quick brown fox jumped over a sleepy dog near the bank",
}


@pytest.mark.parametrize("metric", METRICS)
def test_text_similarity_metrics_agree_with_their_libraries(metric):
    raw = {
        "type": "text_similarity",
        "name": "t",
        "evaluation_metric": metric,
        "input": "{{sample.output_text}}",
        "reference": "{{item.reference}}",
    }
    got = {k: grade(raw, text, {"reference": REFERENCE}).score for k, text in PAIRS.items()}
    for k, text in PAIRS.items():
        assert got[k] == pytest.approx(_library_values(metric, text, REFERENCE)), (metric, k)
    assert got["identical"] == pytest.approx(1.0, abs=0.01)  # METEOR's fragmentation penalty leaves 0.998
    assert got["disjoint"] < 0.5 and (metric == "fuzzy_match" or got["disjoint"] == 0.0)
    assert got["disjoint"] < got["partial"] < got["identical"] or metric in ("rouge_3", "rouge_4", "rouge_5")
    assert all(0.0 <= v <= 1.0 for v in got.values())


def test_meteor_matches_stems_without_wordnet():
    raw = {
        "type": "text_similarity",
        "name": "m",
        "evaluation_metric": "meteor",
        "input": "cats running",
        "reference": "cat runs",
    }
    assert grade(raw, "").score > 0.4  # "cats"/"cat" and "running"/"runs" share Porter stems


def test_templates_read_sample_and_item_fields():
    raw = string_check(
        "eq",
        input="{{sample.output_json.answer.city}}|{{ sample.output_json.tags.1 }}|{{item.n}}|{{item.meta}}",
        reference='{{item.city}}|b|3|{"k":[1,2]}',
    )
    output = json.dumps({"answer": {"city": "Paris"}, "tags": ["a", "b"]})
    assert grade(raw, output, {"city": "Paris", "n": 3, "meta": {"k": [1, 2]}}).score == 1.0
    missing = grade(raw, "not json", {"city": "Paris", "n": 3, "meta": {}})
    assert missing.score == 0.0 and missing.error_kind == "invalid_variable_error"
    assert "sample.output_json" in missing.error, missing.error


def test_sample_from_model_sample_fills_output_json_only_for_an_object():
    assert Sample.from_model_sample('{"a": 1}').output_json == {"a": 1}
    assert Sample.from_model_sample("[1, 2]").output_json is None
    assert Sample.from_model_sample("plain").output_json is None


def test_multi_combines_named_graders_with_its_formula_including_a_nested_multi():
    raw = {
        "type": "multi",
        "name": "overall",
        "calculate_output": "0.5 * exact + 0.5 * max(parts, 0) ^ 2 - abs(-0) + floor(0.9)",
        "graders": {
            "exact": string_check("ilike"),
            "parts": {
                "type": "multi",
                "name": "parts",
                "calculate_output": "(city + sqrt(fuzzy)) / 2",
                "graders": {
                    "city": string_check("like", reference="{{item.city}}"),
                    "fuzzy": {
                        "type": "text_similarity",
                        "name": "fuzzy",
                        "evaluation_metric": "fuzzy_match",
                        "input": "{{sample.output_text}}",
                        "reference": "{{item.answer}}",
                    },
                },
            },
        },
    }
    right = grade(raw, "Paris", {"answer": "paris", "city": "Paris"})
    assert right.score == pytest.approx(1.0) and right.sub_scores == {"exact": 1.0, "parts": pytest.approx(1.0)}
    wrong = grade(raw, "Rome", {"answer": "paris", "city": "Paris"})
    fuzzy = _library_values("fuzzy_match", "Rome", "paris")
    assert wrong.score == pytest.approx(0.5 * ((0 + math.sqrt(fuzzy)) / 2) ** 2)


def test_multi_scores_0_naming_the_grader_that_failed_and_a_formula_that_cannot_be_computed():
    raw = {
        "type": "multi",
        "name": "m",
        "calculate_output": "a + b",
        "graders": {"a": string_check("eq"), "b": string_check("eq", reference="{{item.gone}}")},
    }
    failed = grade(raw, "x", {"answer": "x"})
    assert failed.score == 0.0 and failed.error.startswith("graders.b:") and failed.sub_scores["a"] == 1.0
    raw = {"type": "multi", "name": "m", "calculate_output": "log(a)", "graders": {"a": string_check("eq")}}
    zero = grade(raw, "x", {"answer": "y"})
    assert zero.score == 0.0 and zero.error_kind == "formula_parse_error" and "cannot be computed" in zero.error


def test_openai_clients_typed_multi_with_one_grader_is_taken_by_its_name():
    raw = {
        "type": "multi",
        "name": "m",
        "calculate_output": "exact * 2",
        "graders": {**string_check("eq"), "name": "exact"},
    }
    assert grade(raw, "a", {"answer": "a"}).score == 2.0


def test_check_refuses_bad_graders_naming_each_field():
    bad = {
        "type": "multi",
        "name": "m",
        "calculate_output": "exact + missing",
        "graders": {
            "exact": string_check("eq", input="{{sample.output}}"),
            "sim": {
                "type": "text_similarity",
                "name": "c",
                "evaluation_metric": "cosine",
                "input": "x",
                "reference": "{{item.a",
            },
            "answer": {
                "type": "multi",
                "name": "a",
                "calculate_output": "exact +* 2",
                "graders": {"exact": string_check("eq")},
            },
            "judge": {
                "type": "label_model",
                "name": "j",
                "model": "m",
                "input": [{"role": "user", "content": "{{foo.bar}}"}],
                "labels": ["good", "bad"],
                "passing_labels": ["great"],
            },
            "score": {
                "type": "score_model",
                "name": "s",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "range": [1, 1],
            },
        },
    }
    errors = fields(bad)
    assert "unknown name 'missing'" in errors["grader.calculate_output"]
    assert "unknown template" in errors["grader.graders.exact.input"]
    assert "embedding model" in errors["grader.graders.sim.evaluation_metric"]
    assert "never closed" in errors["grader.graders.sim.reference"]
    assert "unexpected '*'" in errors["grader.graders.answer.calculate_output"]
    assert "{{foo.bar}}" in errors["grader.graders.judge.input[0].content"]
    assert "great" in errors["grader.graders.judge.passing_labels"]
    assert "low < high" in errors["grader.graders.score.range"]
    assert "grader.graders.score.model" not in errors  # no context: what can run here is not asked
    assert "judge engine" in fields(bad, CTX)["grader.graders.score.model"]


def test_decoding_names_missing_and_unknown_fields_and_types():
    errors = fields(
        {
            "type": "multi",
            "name": "m",
            "calculate_output": "a",
            "graders": {
                "a": {"type": "string_check", "name": "a", "input": "x", "operation": "eq", "colour": 1},
                "b": {"type": "regex"},
            },
        }
    )
    assert "missing required field" in errors["grader.graders.a.reference"]
    assert "unknown field" in errors["grader.graders.a.colour"]
    assert "string_check" in errors["grader.graders.b.type"]
    [not_an_object] = decode_grader([1])[1]
    assert not_an_object.field == "grader" and "JSON object" in not_an_object.reason


def test_python_graders_are_refused_where_the_operator_turned_them_off():
    raw = {"type": "python", "name": "p", "source": "def grade(s, i):\n    return 1.0\n"}
    off = GraderContext(python_graders="off")
    assert "turned off" in fields(raw, off)["grader.type"]
    result = grade(raw, "x", ctx=off)
    assert result.score == 0.0 and result.error_kind == "python_grader_server_error"
    assert "give the source" in fields({**raw, "source": "  "})["grader.source"]


def test_grading_imports_no_torch():
    code = "import sys, services.graders, services.graders.grade; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


class Judge:
    """A real HTTP server speaking OpenAI's chat completions: answers with what `reply` gives for a request."""

    def __init__(self, reply) -> None:
        self.reply = reply
        self.requests: list[tuple[str | None, dict]] = []

    async def __aenter__(self) -> str:
        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            self.requests.append((request.headers.get("Authorization"), body))
            status, content, refusal = self.reply(body)
            message = {"role": "assistant", "content": content, "refusal": refusal}
            payload = {
                "id": "c",
                "object": "chat.completion",
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12},
            }
            return web.json_response(payload if status == 200 else {"error": {"message": "overloaded"}}, status=status)

        app = web.Application()
        app.router.add_post("/v1/chat/completions", completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}/v1"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()


SCORE = {
    "type": "score_model",
    "name": "judge",
    "model": "llama-judge",
    "range": [0, 10],
    "sampling_params": {"temperature": 0.0, "seed": 7, "max_completions_tokens": 50},
    "input": [
        {"role": "system", "content": "Score the answer from 0 to 10."},
        {"role": "user", "content": [{"type": "input_text", "text": "Q: {{item.question}} A: {{sample.output_text}}"}]},
    ],
}
LABEL = {
    "type": "label_model",
    "name": "tone",
    "model": "llama-judge",
    "labels": ["polite", "rude", "neutral"],
    "passing_labels": ["polite", "neutral"],
    "input": [{"role": "user", "content": "Label the tone of: {{sample.output_text}}"}],
}


async def _grade_async(raw, outputs, items, ctx):
    return await grade_many_async(grader(raw), [Sample.from_model_sample(o) for o in outputs], items, ctx)


async def test_score_model_asks_the_judge_engine_with_rendered_messages():
    judge = Judge(lambda body: (200, json.dumps({"result": 7 if "Paris" in json.dumps(body["messages"]) else 2}), None))
    async with judge as url:
        ctx = GraderContext(judge_url=url, judge_api_key="k-1")
        assert fields(SCORE, ctx) == {}
        results = await _grade_async(SCORE, ["Paris", "Rome"], [{"question": "capital of France?"}] * 2, ctx)
    assert [(r.score, r.error, r.token_usage) for r in results] == [(7.0, "", 12), (2.0, "", 12)]
    auth, body = judge.requests[0]
    assert auth == "Bearer k-1" and body["model"] == "llama-judge"
    assert body["temperature"] == 0.0 and body["seed"] == 7 and body["max_tokens"] == 50
    assert body["response_format"]["json_schema"]["schema"]["properties"]["result"] == {"type": "number"}
    user = body["messages"][1]["content"][0]
    assert user["type"] == "text" and user["text"] in (
        "Q: capital of France? A: Paris",
        "Q: capital of France? A: Rome",
    )


async def test_label_model_passes_on_passing_labels():
    async with Judge(
        lambda body: (200, json.dumps({"result": "rude" if "idiot" in json.dumps(body) else "polite"}), None)
    ) as url:
        results = await _grade_async(LABEL, ["Thank you!", "you idiot"], [{}, {}], GraderContext(judge_url=url))
    assert [r.score for r in results] == [1.0, 0.0]


@pytest.mark.parametrize(
    "reply,kind,words_",
    [
        ((200, "eleven", None), "model_grader_parse_error", "not a number"),
        ((200, '{"result": 11}', None), "model_grader_parse_error", "outside the grader's range"),
        ((200, "", "I cannot grade this"), "model_grader_refusal_error", "refused"),
        ((503, "", None), "model_grader_server_error", "request id judge-"),
    ],
)
async def test_a_judge_that_fails_scores_0_saying_why(reply, kind, words_):
    async with Judge(lambda body: reply) as url:
        [result] = await _grade_async(SCORE, ["Paris"], [{"question": "q"}], GraderContext(judge_url=url))
    assert result.score == 0.0 and result.error_kind == kind and words_ in result.error, result


async def test_a_bare_number_answer_is_read_and_an_unreachable_judge_is_a_server_error():
    async with Judge(lambda body: (200, " 4.5 ", None)) as url:
        [result] = await _grade_async(SCORE, ["x"], [{"question": "q"}], GraderContext(judge_url=url))
    assert result.score == 4.5
    [down] = await _grade_async(SCORE, ["x"], [{"question": "q"}], GraderContext(judge_url=url, judge_timeout_s=2))
    assert down.score == 0.0 and down.error_kind == "model_grader_server_error"
    [none] = await _grade_async(SCORE, ["x"], [{"question": "q"}], CTX)
    assert none.score == 0.0 and "no judge engine" in none.error


def test_where_the_sandbox_cannot_isolate_python_graders_need_the_operator_to_turn_them_on():
    from services.graders.blocking import run
    from services.graders.sandbox import SandboxStatus, _call_deadline, _session, refusal

    elsewhere = SandboxStatus(False, "no namespaces on this machine", unisolated="a cgroup of its own")
    refused = refusal(CTX, elsewhere)
    assert "no namespaces on this machine" in refused and "--python-graders on" in refused
    shared = refusal(GraderContext(python_graders="on"), elsewhere)  # a node shared by tenants: never unisolated
    assert "no namespaces on this machine" in shared and "--single-tenant" in shared
    assert refusal(GraderContext(python_graders="on", single_tenant=True), elsewhere) == ""
    nowhere = SandboxStatus(False, "no namespaces on this machine")  # nothing could end what a grader leaves
    assert "cannot run on this machine" in refusal(GraderContext(python_graders="on", single_tenant=True), nowhere)
    source = "import os\ndef grade(sample, item):\n    return float(len(os.environ))\n"
    case = [(0, {"output_text": "x"}, {})]
    unisolated = run(_session(source, case, CTX, False, _call_deadline(CTX, 1, None)))  # what "on" runs there
    result = unisolated.results[0]
    assert result.error == "" and result.score <= 1.0  # its own process, an empty environment (Python's LC_CTYPE)
