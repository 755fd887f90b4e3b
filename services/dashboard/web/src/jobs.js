// The jobs table: the scheduler's newest jobs; a row chosen shows the job below (job_view.js). A job preempted by
// fair sharing is marked, with who preempted it and why (it goes on from its checkpoint when its turn comes).
import { state } from "./state.js";
import { $, escape, fmt, printable } from "./text.js";
import { renderArtifacts } from "./job_view.js";
import { preemptedBy } from "./tenants.js";

function stateCell(j) {
  const by = preemptedBy(j);
  const mark = by ? ` <span class="preempted" title="${escape(printable(by))}">preempted</span>` : "";
  return `<td class="state-${escape(j.state)}">${escape(j.state)}${mark}</td>`;
}

function message(j) {
  const by = preemptedBy(j);
  return by && !j.message.includes(by) ? `${by}; ${j.message}` : j.message;
}

export function renderJobs(choose) {
  $("jobs").innerHTML = state.jobs.map(  // newest first, as the scheduler lists them
    (j) =>
    `<tr data-job="${escape(j.id)}" class="${j.id === state.selected ? "sel" : ""}${preemptedBy(j) ? " was-preempted" : ""}">` +
    `<td><a href="?job=${escape(j.id)}">${escape(j.id)}</a></td><td>${j.tenant == null ? '<span class="dim">admin</span>' : escape(j.tenant)}</td>` +
    `${stateCell(j)}<td>${escape(j.node ?? "")}${j.group ? ` (${escape(j.group)})` : ""}</td>` +
    `<td>${j.step}/${j.steps}</td><td>${fmt(j.loss)}</td><td>${escape(printable(j.label))}</td><td>${escape(printable(message(j)))}</td></tr>`).join("") ||
    `<tr><td colspan="8">no jobs yet</td></tr>`;
  for (const tr of $("jobs").querySelectorAll("tr[data-job]")) {
    tr.onclick = (ev) => { ev.preventDefault(); choose(tr.dataset.job); };
  }
  const job = state.jobs.find((j) => j.id === state.selected);
  if (job) renderArtifacts(job);
}
