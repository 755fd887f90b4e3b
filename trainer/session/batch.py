"""Several members' forward_backward calls in one pass of the shared base: their datums as one right-padded batch,
each member's rows through its own LoRA (trainer/multi_lora/layer.py's routing), each member's loss from its own
rows under its own loss function, one backward over their sum. The members' adapters are disjoint and each loss
depends on its own rows alone (nothing in a decoder mixes rows), so each member's gradient is its own loss's, as
if it had run alone; its log-probs and loss equal its own pass's to float rounding (other widths of padding, other
shapes of matmul). A member's loss that is not a number stays its own (the gradient of a sum is 1 for each term,
never the others' values). If the pass fails, every member's gradients are put back as they were before it and
each call is run on its own, so one member's bad call fails its call alone."""

from __future__ import annotations

import torch

from schemas.sessions import ForwardBackward, ForwardResult
from trainer.session import model as ops
from trainer.multi_lora.layer import Routing
from trainer.multi_lora.shared_base import SharedBase
from trainer.session.member import SessionMember

Work = list[tuple[SessionMember, ForwardBackward]]


def batchable(call) -> bool:
    """A call that may run in a shared pass: a forward_backward that trains (a forward alone, which clients compare
    with other forwards, always runs in its own pass: its log-probs are the same to the bit every time)."""
    return isinstance(call, ForwardBackward) and not call.forward_only


def forward_backward_together(base: SharedBase, work: Work, device: str) -> list[ForwardResult]:
    """Each member's ForwardResult, in the order of `work` (its calls checked already, ops.check_batch)."""
    params = [p for member, _ in work for p in member.params]
    grads = [None if p.grad is None else p.grad.clone() for p in params]
    try:
        return _together(base, work, device)
    except Exception:
        for p, g in zip(params, grads):  # what the failed pass added is taken back
            p.grad = g
        raise


def _together(base: SharedBase, work: Work, device: str) -> list[ForwardResult]:
    data = [d for _, fb in work for d in fb.data]
    ids, mask = ops.padded(data, device)
    targets = ops.column(data, "target_tokens", ids.shape[1], device, torch.long)
    spans, at = [], 0
    for member, fb in work:
        spans.append(slice(at, at + len(fb.data)))
        at += len(fb.data)
    base.model.train()
    with base.routed(Routing([(member.name, rows) for (member, _), rows in zip(work, spans)])):
        lp = ops.target_logprobs(base.model, ids, mask, targets)
    losses = []
    for (_, fb), rows in zip(work, spans):
        losses.append(ops.loss_of(fb, lp[rows], fb.data, mask[rows]))
    total = sum((loss for loss, _ in losses), start=torch.zeros((), device=lp.device))
    total.backward()
    out = lp.detach().cpu()
    results = []
    for (member, fb), rows, (loss, weighed) in zip(work, spans, losses):
        mine = out[rows]
        logprobs = [mine[i, : len(d.tokens)].tolist() for i, d in enumerate(fb.data)]
        results.append(member.took(fb, logprobs, float(loss.detach()), weighed))
    return results
