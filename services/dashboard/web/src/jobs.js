// The jobs table: the scheduler's newest jobs; a row chosen shows the job below (job_view.js).
import { state } from "./state.js";
import { $, escape, fmt, printable } from "./text.js";
import { renderArtifacts } from "./job_view.js";

export function renderJobs(choose) {
  $("jobs").innerHTML = state.jobs.map(  // newest first, as the scheduler lists them
    (j) =>
    `<tr data-job="${escape(j.id)}" class="${j.id === state.selected ? "sel" : ""}"><td><a href="?job=${escape(j.id)}">${escape(j.id)}</a></td>` +
    `<td class="state-${escape(j.state)}">${escape(j.state)}</td><td>${escape(j.node ?? "")}${j.group ? ` (${escape(j.group)})` : ""}</td>` +
    `<td>${j.step}/${j.steps}</td><td>${fmt(j.loss)}</td><td>${escape(printable(j.label))}</td><td>${escape(printable(j.message))}</td></tr>`).join("") ||
    `<tr><td colspan="7">no jobs yet</td></tr>`;
  for (const tr of $("jobs").querySelectorAll("tr[data-job]")) {
    tr.onclick = (ev) => { ev.preventDefault(); choose(tr.dataset.job); };
  }
  const job = state.jobs.find((j) => j.id === state.selected);
  if (job) renderArtifacts(job);
}
