"""The calls that changed a training session, by the gateway's call id, with their answers: kept beside the state a
checkpoint carries (a pause's, a save_state's), so a call sent again after its gateway died (the node had answered,
the outcome was never stored) is answered as it was, never run a second time, even by the next attempt of the
session that resumed from that checkpoint. The latest KEPT calls are remembered; their answers while they fit in
ANSWER_BYTES (a forward's log-probs can be large), an older one's id alone (a repeat of it is told it ran)."""

from __future__ import annotations

import collections
from pathlib import Path

import msgspec

from schemas.sessions import AppliedCall, CallError, ForwardBackward, LoadWeights, OptimStep, SaveWeights, SessionReply

FILE = "applied_calls.json"
KEPT = 256  # call ids remembered: far more than a gateway ever sends again (the calls whose outcomes it lost)
ANSWER_BYTES = 8 * 2**20  # their answers, at most, encoded
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(list[AppliedCall])
_reply = msgspec.json.Decoder(SessionReply)  # type: ignore[arg-type]  # a union of tagged Structs


def changes_state(call) -> bool:
    """A call whose second run would change the session again (a sample, a forward alone or a ping would not)."""
    if isinstance(call, ForwardBackward):
        return not call.forward_only
    return isinstance(call, OptimStep | SaveWeights | LoadWeights)


class AppliedCalls:
    def __init__(self) -> None:
        self.answers: collections.OrderedDict[str, bytes | None] = collections.OrderedDict()
        self.size = 0

    def answer(self, call_id: str) -> SessionReply | None:
        """What the call answered when it ran, if it ran; None: it did not (run it)."""
        if not call_id or call_id not in self.answers:
            return None
        kept = self.answers[call_id]
        if kept is None:
            return CallError(message=f"call {call_id} ran already; its answer is no longer kept (too large to keep)")
        return _reply.decode(kept)

    def remember(self, call_id: str, call, reply: SessionReply) -> None:
        if not call_id or not changes_state(call):
            return
        self._put(call_id, _encode(reply))

    def _put(self, call_id: str, encoded: bytes | None) -> None:
        self._drop(call_id)
        self.answers[call_id] = encoded
        self.size += len(encoded or b"")
        while len(self.answers) > KEPT:
            self._drop(next(iter(self.answers)))
        for old in list(self.answers):  # the oldest answers give way first; their ids stay
            if self.size <= ANSWER_BYTES:
                break
            if self.answers[old] is not None:
                self.size -= len(self.answers[old] or b"")
                self.answers[old] = None

    def _drop(self, call_id: str) -> None:
        if call_id in self.answers:
            self.size -= len(self.answers.pop(call_id) or b"")

    def save(self, directory: Path) -> None:
        """Beside the state in `directory` (written whole, then renamed: a checkpoint never holds half of it)."""
        kept = [{"id": i, "reply": None if a is None else msgspec.Raw(a)} for i, a in self.answers.items()]
        directory.mkdir(parents=True, exist_ok=True)
        part = directory / (FILE + ".part")
        part.write_bytes(_encode(kept))
        part.replace(directory / FILE)

    def load(self, directory: Path) -> int:
        """What a checkpoint kept (none in one made before calls were kept: an empty memory); how many."""
        source = directory / FILE
        if not source.is_file():
            return 0
        for applied in _decode.decode(source.read_bytes()):
            self._put(applied.id, None if applied.reply is None else _encode(applied.reply))
        return len(self.answers)
