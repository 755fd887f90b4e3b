// Tinker sessions, as the gateways stored them (the dashboard server reads the store: /tinker.json): each session's
// state and when its client was last heard, its models (each a session job) and their calls.
import { state } from "./state.js";
import { problem } from "./status.js";
import { $, ago, escape, printable } from "./text.js";

export async function refreshSessions() {
  try {
    const response = await fetch("tinker.json", { cache: "no-store" });
    const data = await response.json();
    if (!response.ok) throw new Error(data.error || response.statusText);
    state.tinker = data;
    problem("tinker", null);
  } catch (e) {
    state.tinker = null;
    problem("tinker", `Tinker sessions: ${e.message}`);
  }
  renderSessions();
}

function call(c) {
  const turn = c.seq === null ? "" : `#${c.seq} `;
  const error = c.error ? `: ${escape(printable(c.error))}` : "";
  return `<li class="call-${escape(c.state)}">${turn}${escape(c.what)} <span>${escape(c.state)}</span>${error}</li>`;
}

function model(m) {
  const counts = `${m.calls} calls` + (m.pending ? `, ${m.pending} pending` : "") + (m.failed ? `, ${m.failed} failed` : "");
  const saves = m.saves.length ? ` · saved ${m.saves.map(escape).join(", ")}` : "";
  const job = m.job ? ` · job <a href="?job=${escape(m.job)}">${escape(m.job)}</a>` : "";
  return `<div class="model" data-model="${escape(m.id)}"><b>${escape(m.id)}</b> (${m.kind === "base" ? "base sampler" : "training"}, ` +
    `${escape(m.base_model)})${job} · ${counts}${saves}<ul>${m.latest.map(call).join("")}</ul></div>`;
}

export function renderSessions() {
  const data = state.tinker;
  if (!data) {
    $("sessions").innerHTML = `<tr><td colspan="5">the Tinker store cannot be read now (the status line says why)</td></tr>`;
    return;
  }
  $("sessions").innerHTML = data.sessions.map((s) =>
    `<tr data-session="${escape(s.id)}"><td>${escape(s.id)}</td><td>${escape(s.tenant)}</td>` +
    `<td class="session-${escape(s.state)}">${escape(s.state)}</td><td>${ago(data.now - s.heard)}</td>` +
    `<td>${s.models.map(model).join("") || "no model yet"}${s.samplers ? `<div>${s.samplers} sampling sessions</div>` : ""}</td></tr>`)
    .join("") || `<tr><td colspan="5">no Tinker sessions${data.gateways.length ? "" : " (no gateway has recorded itself)"}</td></tr>`;
  $("sessions-count").textContent = data.total > data.sessions.length ? `the newest ${data.sessions.length} of ${data.total}` : "";
}
