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
