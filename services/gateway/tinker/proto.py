"""The Tinker API's protobuf messages, to and from jetlora's session calls: a ForwardBackwardRequest becomes a
schemas.sessions.ForwardBackward; a session's ForwardResult and SampleResult become the ForwardBackwardOutput and
SampleResponse the client decodes. Tensors are little-endian arrays (int32 tokens; float32 or int64 inputs)."""

from __future__ import annotations

import math
import sys
from array import array
from dataclasses import dataclass

from google.protobuf import descriptor_pool, message_factory

from schemas.sessions import Datum, ForwardBackward, ForwardResult, SampleResult
from services.gateway.tinker.schema_pb import DESCRIPTOR

CONTENT_TYPE = "application/x-protobuf"
_pool = descriptor_pool.DescriptorPool()
_pool.AddSerializedFile(DESCRIPTOR)


def _message(name: str):
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequest = _message("ForwardBackwardRequest")
ForwardBackwardOutput = _message("ForwardBackwardOutput")
SampleResponse = _message("SampleResponse")
DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
STOP, LENGTH = 0, 1


class ProtoRefused(ValueError):
    """A request the gateway cannot take as sent; `field` names the part at fault."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


def _little(kind: str, raw: bytes, where: str) -> array:
    values = array(kind)
    if len(raw) % values.itemsize:
        raise ProtoRefused(
            f"{where} holds {len(raw)} bytes, not a whole number of {values.itemsize}-byte values", where
        )
    values.frombytes(raw)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def _floats(values) -> array:
    """float32s, NaN where the session sent null (a number that was not finite)."""
    return array("f", (NAN if v is None else v for v in values))


NAN = float("nan")


def _bytes(values: array) -> bytes:
    if sys.byteorder != "little":
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _tensor(t, where: str) -> list[float]:
    if t.WhichOneof("encoding") != "dense":
        raise ProtoRefused(f"{where} is sparse; send it dense", where)
    kinds = {DTYPE_FLOAT32: "f", DTYPE_INT64: "q", DTYPE_INT32: "i"}
    if t.dtype not in kinds:
        raise ProtoRefused(f"{where} has dtype {t.dtype}; send float32 or int64", where)
    if len(t.shape) > 1:
        raise ProtoRefused(f"{where} has shape {list(t.shape)}; one value per input token is served", where)
    values = [float(v) for v in _little(kinds[t.dtype], t.dense, where)]
    if t.shape and t.shape[0] != len(values):
        raise ProtoRefused(f"{where} has shape {list(t.shape)} but {len(values)} values", where)
    if not all(math.isfinite(v) for v in values):
        raise ProtoRefused(f"{where} holds a NaN or an infinity; send finite numbers", where)
    return values


def _tokens(datum, i: int) -> list[int]:
    tokens: list[int] = []
    for chunk in datum.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise ProtoRefused(f"data[{i}].model_input holds a {kind} chunk; only encoded text is served", f"data[{i}]")
        tokens += _little("i", chunk.encoded_text.tokens, f"data[{i}].model_input.tokens").tolist()
    return tokens


def forward_backward(body: bytes):
    """The ForwardBackwardRequest in the body (its model_id and seq_id name the call; call_of reads the rest)."""
    req = ForwardBackwardRequest()
    try:
        req.ParseFromString(body)
    except Exception as e:  # protobuf's DecodeError
        raise ProtoRefused(f"the body is not a ForwardBackwardRequest ({e})", "body") from None
    return req


def call_of(req) -> ForwardBackward:
    """The session call of a ForwardBackwardRequest; ProtoRefused names the datum or input it cannot take."""
    config = {k: v for k, v in req.loss_fn_config.items()}
    for key, value in req.loss_fn_config_v2.items():
        if value.WhichOneof("value") == "number":
            config[key] = value.number
    for key, number in config.items():
        if not math.isfinite(number):
            raise ProtoRefused(f"loss_fn_config[{key[:40]!r}] is {number}; give a finite number", "loss_fn_config")
    data = [
        Datum(
            tokens=_tokens(d, i),
            inputs={name: _tensor(t, f"data[{i}].loss_fn_inputs.{name}") for name, t in d.loss_fn_inputs.items()},
        )
        for i, d in enumerate(req.data)
    ]
    for i, d in enumerate(data):
        if any(t < 0 for t in d.tokens):
            raise ProtoRefused(f"data[{i}].model_input holds a negative token id", f"data[{i}].model_input.tokens")
        if any(t < 0 or t != int(t) for t in d.inputs.get("target_tokens", ())):
            where = f"data[{i}].loss_fn_inputs.target_tokens"
            raise ProtoRefused(f"{where} holds what is not a token id (a whole number from 0)", where)
    return ForwardBackward(data=data, loss_fn=req.loss_fn, config=config, forward_only=req.forward_only)


@dataclass(frozen=True)
class Span:
    """A run of a datum's positions that came from a sampled sequence: its prompt's tokens, or the tokens it
    sampled, [offset, offset + length) of that sequence's (Tinker's ProvenanceSpan)."""

    sampled: bool
    sequence_id: str
    offset: int
    length: int


def provenance(req) -> list[list[Span] | None]:
    """Each datum's loss_fn_input_spans (its targets' provenance), None where it names none."""
    out: list[list[Span] | None] = []
    for i, d in enumerate(req.data):
        if not d.loss_fn_input_spans:
            out.append(None)
            continue
        spans = []
        for span in d.loss_fn_input_spans:
            kind = span.WhichOneof("span")
            if kind is None:
                raise ProtoRefused(f"data[{i}].loss_fn_input_spans holds an empty span", f"data[{i}]")
            run = getattr(span, kind)
            if run.offset < 0 or run.length < 0 or not run.sequence_id:
                where = f"data[{i}].loss_fn_input_spans"
                raise ProtoRefused(f"{where}: a span needs a sequence_id, an offset and a length from 0", where)
            spans.append(Span(kind == "sampled_tokens", run.sequence_id[:400], run.offset, run.length))
        out.append(spans)
    return out


def sampled(body: bytes) -> list[tuple[list[int], list[float]]]:
    """The (tokens, log-probabilities) of each sequence of a SampleResponse sample_output wrote."""
    out = SampleResponse()
    out.ParseFromString(body)
    return [(_little("i", s.tokens, "tokens").tolist(), _little("f", s.logprobs, "logprobs").tolist())
            for s in out.sequences]  # fmt: skip


def forward_output(result: ForwardResult) -> bytes:
    """The client's ForwardBackwardOutput: one record with every datum's target log-probs, and loss:sum."""
    out = ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    record = out.loss_fn_outputs.add()
    record.type_tag, record.num_datums = "ArrayRecord", len(result.logprobs)
    offsets, data = array("q", [0]), array("f")
    for row in result.logprobs:
        data.extend(_floats(row))
        offsets.append(len(data) * 4)
    field = record.fields["logprobs"]
    field.data, field.offsets, field.dtype = _bytes(data), _bytes(offsets), DTYPE_FLOAT32
    out.metrics["loss:sum"] = NAN if result.loss is None else result.loss
    out.metrics["num_tokens:sum"] = float(result.tokens)
    return out.SerializeToString()


def sample_output(result: SampleResult) -> bytes:
    out = SampleResponse()
    if result.prompt_logprobs is not None:  # the first token has none: NaN, as Tinker sends it
        out.prompt_logprobs = _bytes(_floats([None, *result.prompt_logprobs]))
    for s in result.sequences:
        seq = out.sequences.add()
        seq.stop_reason = STOP if s.stop == "stop" else LENGTH
        seq.tokens = _bytes(array("i", s.tokens))
        seq.logprobs = _bytes(_floats(s.logprobs))
    return out.SerializeToString()
