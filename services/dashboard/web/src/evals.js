// Adapters, their versions' eval scores and their gates: the registry's list (what each name serves, on which
// nodes, a gate under way or the last one's decision) and the evals service's runs (each grader's mean with its
// 95% interval, and the share that passed).
import { state } from "./state.js";
import { ask } from "./status.js";
import { $, escape, fmt, pct, printable } from "./text.js";

const RUNS_SHOWN = 50;

export async function refreshAdapters(ctx) {
  const { config, nc } = ctx;
  const [adapters, runs] = await Promise.all([
    ask(nc, "adapters", config.subjects.list_adapters, {}, "adapter registry"),
    ask(nc, "evals", config.subjects.eval_runs, {}, "evals service"),
  ]);
  if (adapters) state.adapters = adapters.adapters || [];
  if (runs) state.runs = runs.runs || [];
  renderAdapters(adapters !== null);
  renderRuns(runs !== null);
}

function gateOf(alias) {
  if (alias.gate) {
    const g = alias.gate;
    return `evaluating @${g.version} against ${g.incumbent ? "@" + g.incumbent : "the base " + escape(g.base_model)}` +
      ` on eval ${escape(g.eval)}${g.note ? `: ${escape(printable(g.note))}` : ""}`;
  }
  const canary = alias.canary ? `canary @${alias.canary.version} on ${alias.canary.nodes.map(escape).join(", ")}` : "";
  return [escape(printable(alias.last_gate)), canary, escape(printable(alias.last_rollout))].filter(Boolean).join("<br>") || "–";
}

function renderAdapters(answered) {
  if (!answered && !state.adapters.length) {
    $("adapters").innerHTML = `<tr><td colspan="5">the adapter registry does not answer (the status line says why)</td></tr>`;
    return;
  }
  $("adapters").innerHTML = state.adapters.map(({ alias, versions, nodes }) =>
    `<tr data-adapter="${escape(alias.name)}"><td>${escape(alias.name)}</td>` +
    `<td>${alias.retired ? "retired" : alias.current ? "@" + alias.current : "–"}</td>` +
    `<td>${versions.map((v) => `@${v.version} job ${escape(v.job)} eval loss ${fmt(v.eval_loss)}`).join("<br>")}</td>` +
    `<td>${nodes.map((n) => escape(`${n.node}: @${n.version} ${n.state}` +
      (n.smoke ? ` (${Math.round(n.smoke.latency_ms)} ms)` : ""))).join("<br>")}</td>` +
    `<td class="gate">${gateOf(alias)}</td></tr>`).join("") ||
    `<tr><td colspan="5">none registered</td></tr>`;
}

function scores(summary) {
  if (!summary) return "–";
  return summary.graders.map((g) => `${escape(g.name)} ${fmt(g.mean, 3)} [${fmt(g.low, 3)}, ${fmt(g.high, 3)}], ` +
    `pass ${pct(g.pass_rate)}` + (g.errored ? `, ${g.errored} errors` : "")).join("<br>") +
    ` <span class="dim">(${summary.items} items)</span>`;
}

function renderRuns(answered) {
  if (!answered && !state.runs.length) {
    $("runs").innerHTML = `<tr><td colspan="5">the evals service does not answer (the status line says why)</td></tr>`;
    return;
  }
  const model = (r) => (r.adapter ? `${r.adapter}@${r.version}` : r.base_model ? `${r.base_model} (base)` : "samples");
  const runs = [...state.runs].sort((a, b) => model(a).localeCompare(model(b)) || b.created - a.created).slice(0, RUNS_SHOWN);
  $("runs").innerHTML = runs.map((r) =>
    `<tr data-run="${escape(r.id)}" data-model="${escape(model(r))}"><td>${escape(model(r))}</td><td>${escape(r.eval)}</td>` +
    `<td class="run-${escape(r.state)}" title="${escape(printable(r.message))}">${escape(r.state)}` +
    `${r.state === "failed" && r.message ? `: ${escape(printable(r.message))}` : ""}</td>` +
    `<td>${scores(r.summary)}</td><td>${escape(printable(r.via))}</td></tr>`).join("") ||
    `<tr><td colspan="5">no eval runs</td></tr>`;
}
