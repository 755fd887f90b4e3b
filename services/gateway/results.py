"""A succeeded job's results file, as OpenAI gives one (`result_files`, purpose `fine-tune-results`): a CSV of the
metrics at each logged step, rendered on request from the job's progress events, so nothing is stored twice.
Its id names the job (`file-results-<job>`); it is found only within the job's tenant."""

from __future__ import annotations

import csv
import io

from schemas.events import Progress
from schemas.gateway import FileObject, GatewayJob
from schemas.job_status import JobSummary
from services.gateway.errors import not_found
from services.gateway.events import JobEvents
from services.gateway.lookups import job_summary_or_none
from services.gateway.openai_map import STATUS
from services.gateway.records import JobRecords

PREFIX = "file-results-"
FILENAME = "step_metrics.csv"
# OpenAI's columns that jetlora has (it measures no token accuracy): valid_loss and full_valid_loss are the same
# figure, as jetlora evaluates the whole validation file each time
COLUMNS = ["step", "train_loss", "valid_loss", "full_valid_loss", "learning_rate", "trained_tokens"]
DPO_COLUMNS = ["rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy"]
RFT_COLUMNS = ["train_mean_reward", "train_reward_std", "train_pass_rate", "full_valid_mean_reward"]  # as its events


def results_file_id(job: str) -> str:
    return PREFIX + job


def is_results_file(ident: str) -> bool:
    return ident.startswith(PREFIX)


def render(progress: list[Progress], record: GatewayJob | None) -> bytes:
    """One row per logged step. The eval loss is shown at the steps it was measured at (every `eval_steps`, and
    the last), not carried to the steps between as the progress events carry it."""
    method = record.method if record else "supervised"
    every = record.eval_steps if record else 0
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(COLUMNS + {"dpo": DPO_COLUMNS, "reinforcement": RFT_COLUMNS}.get(method, []))
    for i, p in enumerate(progress):
        at_eval = (every and p.step % every == 0) or i == len(progress) - 1
        valid = p.eval_loss if p.eval_loss is not None and at_eval else None
        row = [p.step, p.loss, valid, valid, p.lr, p.tokens]
        if method == "dpo":
            pref = p.preference
            row += [pref.rewards_chosen, pref.rewards_rejected, pref.margin, pref.accuracy] if pref else [None] * 4
        elif method == "reinforcement":
            rl = p.reinforcement
            row += [rl.reward, rl.reward_std, rl.pass_rate] if rl else [None] * 3
            row.append(p.eval_reward if p.eval_reward is not None and at_eval else None)
        writer.writerow(["" if v is None else v for v in row])
    return out.getvalue().encode()


class Results:
    def __init__(self, nc, events: JobEvents, records: JobRecords) -> None:
        self.nc, self.events, self.records = nc, events, records

    async def summary(self, tenant: str, ident: str) -> JobSummary:
        """The job a results file id names: a 404 unless it is the tenant's and it succeeded."""
        job = ident.removeprefix(PREFIX)
        summary = await job_summary_or_none(self.nc, tenant, job)
        if summary is None or STATUS[summary.state] != "succeeded":  # a succeeded job's only, as its result_files
            raise not_found("file", ident)
        return summary

    async def _render(self, tenant: str, summary: JobSummary) -> bytes:
        found = await self.records.get(tenant, summary.id)
        return render(await self.events.progress(tenant, summary.id), found[0] if found else None)

    async def content(self, tenant: str, ident: str) -> bytes:
        return await self._render(tenant, await self.summary(tenant, ident))

    async def file(self, tenant: str, ident: str) -> FileObject:
        summary = await self.summary(tenant, ident)
        return FileObject(
            id=ident,
            bytes=len(await self._render(tenant, summary)),
            created_at=int(summary.updated),
            filename=FILENAME,
            purpose="fine-tune-results",
        )
