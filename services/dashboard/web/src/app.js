// jetlora's dashboard: talks to NATS directly over WebSocket. Subjects come from /config.json, which the dashboard
// server builds from schemas/names.py (the one place subjects are spelt); the Tinker sessions come from the server
// (/tinker.json), which reads the gateways' store; the tenants' fair shares come from the scheduler. Each panel is a
// module; this one connects and keeps them fed.
import { wsconnect } from "@nats-io/nats-core";
import { jetstream } from "@nats-io/jetstream";
import { Chart, LineController, LineElement, PointElement, LinearScale, Legend, Tooltip } from "chart.js";
import { state } from "./state.js";
import { ask, poll, problem, setConnected, watchRefusals } from "./status.js";
import { $ } from "./text.js";
import { onHeartbeat, renderNodes } from "./nodes.js";
import { renderJobs } from "./jobs.js";
import { select } from "./job_view.js";
import { renderGroups } from "./groups.js";
import { followRewards, renderRewards } from "./rewards.js";
import { refreshSessions } from "./sessions.js";
import { refreshAdapters } from "./evals.js";
import { renderTenants } from "./tenants.js";

Chart.register(LineController, LineElement, PointElement, LinearScale, Legend, Tooltip);

async function main() {
  const config = await (await fetch("config.json")).json();
  // replies come under the dashboard user's own inbox prefix, the only one its permissions let it read
  const nc = await wsconnect({ servers: config.ws_url, name: "jetlora-dashboard", inboxPrefix: config.inbox_prefix });
  setConnected(`connected to ${config.ws_url}`);
  nc.closed().then((err) => problem("connection", `the connection to NATS closed${err ? `: ${err.message}` : ""}; reload the page`));
  watchRefusals(nc);
  const ctx = { config, nc, js: jetstream(nc) };
  const choose = (job) => select(ctx, job).catch((e) => problem("job", `job ${job}: ${e.message}`));
  nc.subscribe(config.subjects.heartbeats, { callback: (err, msg) => { if (!err) onHeartbeat(msg.json()); } });
  setInterval(() => { renderNodes(); renderGroups(); }, 1000);
  const wanted = new URLSearchParams(location.search).get("job");
  if (wanted) choose(wanted);
  poll(2000, async () => {
    const [jobs, nodes, tenants] = await Promise.all([
      ask(nc, "jobs", config.subjects.list_jobs, {}, "job list (the scheduler)"),
      ask(nc, "nodes", config.subjects.list_nodes, {}, "node list (the scheduler)"),
      ask(nc, "tenants", config.subjects.tenants, {}, "tenants (the scheduler)"),
    ]);
    if (jobs) state.jobs = jobs.jobs || [];
    if (nodes) state.nodes = nodes.nodes || [];
    if (tenants) state.tenants = tenants; // asked with the jobs: a job marked preempted and the shares agree
    renderJobs(choose);
    renderNodes();
    renderGroups();
    renderTenants();
    renderRewards(ctx); // the grpo jobs' states, as the scheduler now says them
  });
  poll(3000, () => refreshAdapters(ctx));
  poll(2000, refreshSessions);
  followRewards(ctx);
}

main().catch((e) => { $("status").textContent = `cannot connect: ${e.message}`; });
