"""A paired comparison of two completed runs of one eval (schemas/gates.py): the evals service owns the runs' per-item
results, so whoever decides by them (the registry's gates) asks it, on the tenant's own subject."""

from __future__ import annotations

from schemas.evals import EvalRun
from schemas.gates import CompareReply, Unpaired, compare
from schemas.jobs import Error
from services.evals.store import EvalStore


async def paired(store: EvalStore, candidate: EvalRun, incumbent: EvalRun) -> CompareReply | Error:
    """The comparison, or an Error naming the run at fault and what to do."""
    if candidate.eval != incumbent.eval:
        return Error(
            f"run {candidate.id} is of eval {candidate.eval}, run {incumbent.id} of {incumbent.eval}: compare two runs "
            "of one eval",
            "incumbent",
        )
    if _path(candidate) != _path(incumbent):  # like with like: an engine's sampling is not the trainer's
        return Error(
            f"run {candidate.id} was sampled by {candidate.via}, run {incumbent.id} by {incumbent.via}: compare runs "
            "sampled the same way (`--via trainer` for both, as gates run them)",
            "incumbent",
        )
    for field, r in (("candidate", candidate), ("incumbent", incumbent)):
        if r.state != "completed":
            return Error(
                f"run {r.id} is {r.state}{': ' + r.message if r.message else ''}; compare completed runs", field
            )
    mine, _ = await store.results(candidate)
    theirs, _ = await store.results(incumbent)
    try:
        found = compare(
            mine,
            theirs,
            eval=candidate.eval,
            candidate=candidate.model,
            incumbent=incumbent.model,
            candidate_run=candidate.id,
            incumbent_run=incumbent.id,
        )
    except Unpaired as e:
        return Error(str(e), "incumbent")
    return CompareReply(comparison=found)


def _path(run: EvalRun) -> str:
    """What sampled the run: the trainer, or an engine (whichever engine on whichever node)."""
    return run.via.partition(" ")[0]
