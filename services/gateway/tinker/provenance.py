"""stable_reinforce's inputs from what the sampler recorded: a datum names, by provenance spans, the sampled
sequence behind each of its targets (a sequence_id asample gave out, sampled with record_stability_info); the
gateway reads that sample's stored outcome (kept a day, as every future) and fills the datum's recorded
log-probabilities and the mask of its sampled tokens (schemas.sessions.RECORDED_LOGPROBS, SAMPLED_MASK), checking
that its targets are the tokens the sequence sampled and that only sampled tokens carry an advantage."""

from __future__ import annotations

from schemas.sessions import RECORDED_LOGPROBS, SAMPLED_MASK, ForwardBackward
from schemas.tinker_store import FutureRecord, valid_id
from services.gateway.tinker import proto
from services.gateway.tinker.futures import Book
from services.gateway.tinker.http import TinkerRefusal

RESERVED = (RECORDED_LOGPROBS, SAMPLED_MASK)
HOW = (
    "sample with record_stability_info=True (create_sampling_client or save_weights_and_get_sampling_client) and "
    "name each sequence in the datum with Datum.with_provenance, as the cookbook's RL loops do"
)


def sequence_id(request: str, index: int, at: int) -> str:
    """The id asample gives the `index`th sequence of sample request `request` (`at`: when, in whole seconds)."""
    return f"{request}-{index}-{at}"


def parse_sequence_id(ident: str) -> tuple[str, int] | None:
    """(request id, index) of an id sequence_id made; None for anything else (a request id no call could have is
    never a key to look up, and only ASCII digits are an index: '²'.isdigit() is true but int('²') raises)."""
    request, _, rest = ident.rpartition("-")
    request, _, index = request.rpartition("-")
    if not valid_id(request) or not index.isascii() or not index.isdigit() or len(index) > 9:
        return None
    return request, int(index)


def check_inputs(fb: ForwardBackward) -> None:
    """No client sends the inputs the gateway fills."""
    for i, d in enumerate(fb.data):
        for name in RESERVED:
            if name in d.inputs:
                raise TinkerRefusal(400, f"data[{i}].loss_fn_inputs[{name!r}] is filled by the server; leave it out")


class Recorded:
    """The sequences one request names, each sample's stored outcome read once."""

    def __init__(self, book: Book, tenant: str) -> None:
        self.book, self.tenant = book, tenant
        self.samples: dict[str, list[tuple[list[int], list[float]]]] = {}

    async def sequence(self, ident: str, where: str) -> tuple[list[int], list[float]]:
        parsed = parse_sequence_id(ident)
        if parsed is None:
            raise TinkerRefusal(400, f"{where}: sequence_id {ident[:80]!r} is none that asample gave out; {HOW}")
        request, index = parsed
        if request not in self.samples:
            self.samples[request] = await self._read(request, ident, where)
        sequences = self.samples[request]
        if index >= len(sequences):
            raise TinkerRefusal(400, f"{where}: sequence_id {ident[:80]!r} names no sequence of its sample")
        return sequences[index]

    async def _read(self, request: str, ident: str, where: str) -> list[tuple[list[int], list[float]]]:
        future = await self.book.find(self.tenant, request)
        if future is None or future.kind != "sample":
            raise TinkerRefusal(400, f"{where}: no recorded sample of yours has sequence {ident[:80]!r} (sequences are "
                                     f"kept a day after sampling); {HOW}")  # fmt: skip
        if not future.args.get("stability"):
            raise TinkerRefusal(400, f"{where}: sequence {ident[:80]!r} was sampled without record_stability_info; "
                                     f"{HOW}")  # fmt: skip
        return await self._outcome(future, ident, where)

    async def _outcome(self, future: FutureRecord, ident: str, where: str) -> list[tuple[list[int], list[float]]]:
        if future.outcome is None:
            raise TinkerRefusal(400, f"{where}: the sample of sequence {ident[:80]!r} has not finished; fetch its "
                                     "result first")  # fmt: skip
        outcome = await self.book.read(future.outcome)
        if outcome.body is None:
            raise TinkerRefusal(400, f"{where}: the sample of sequence {ident[:80]!r} failed; it recorded nothing")
        return proto.sampled(outcome.body)


async def fill(book: Book, tenant: str, fb: ForwardBackward, spans: list[list[proto.Span] | None]) -> None:
    """Each datum's recorded log-probabilities and sampled-token mask, from the spans it names."""
    recorded = Recorded(book, tenant)
    for i, (d, runs) in enumerate(zip(fb.data, spans)):
        where = f"data[{i}]"
        if runs is None:
            raise TinkerRefusal(400, f"{where}: stable_reinforce needs each datum's provenance; {HOW}")
        targets, advantages = d.inputs.get("target_tokens", []), d.inputs.get("advantages", [])
        if sum(run.length for run in runs) != len(targets):
            raise TinkerRefusal(400, f"{where}.loss_fn_input_spans cover {sum(r.length for r in runs)} positions; "
                                     f"its target_tokens have {len(targets)}: the spans tile them")  # fmt: skip
        logprobs, mask, at = [0.0] * len(targets), [0.0] * len(targets), 0
        for run in runs:
            tokens, sampler = await recorded.sequence(run.sequence_id, where)
            if run.sampled:
                if run.offset + run.length > len(tokens):
                    raise TinkerRefusal(400, f"{where}: a span reaches past the {len(tokens)} tokens sequence "
                                             f"{run.sequence_id[:80]!r} sampled")  # fmt: skip
                if [int(t) for t in targets[at : at + run.length]] != tokens[run.offset : run.offset + run.length]:
                    raise TinkerRefusal(400, f"{where}: target_tokens at positions {at}..{at + run.length - 1} are "
                                             f"not the tokens sequence {run.sequence_id[:80]!r} sampled")  # fmt: skip
                logprobs[at : at + run.length] = sampler[run.offset : run.offset + run.length]
                mask[at : at + run.length] = [1.0] * run.length
            at += run.length
        for p, (a, m) in enumerate(zip(advantages, mask)):
            if a != 0 and not m:
                raise TinkerRefusal(400, f"{where}: advantages[{p}] is {a} on a token no sequence sampled; "
                                         "stable_reinforce takes advantages on sampled tokens only")  # fmt: skip
        d.inputs[RECORDED_LOGPROBS], d.inputs[SAMPLED_MASK] = logprobs, mask
