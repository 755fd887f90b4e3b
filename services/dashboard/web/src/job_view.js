// One job: its loss curve (replayed from its first event, then followed live), its figures, the base model's
// and the adapter's answers to its sample prompts, and its artifacts.
import { DeliverPolicy } from "@nats-io/jetstream";
import { Chart } from "chart.js";
import { state } from "./state.js";
import { $, baseAnswer, escape, fmt, printable } from "./text.js";

const WINDOW = 20; // moving-average window, as in Unsloth Studio
const dec = new TextDecoder();
const sub = (template, values) => template.replace(/\{(\w+)\}/g, (_, k) => values[k]);

export function renderArtifacts(job) {
  $("artifacts").innerHTML = job.artifacts.map((a) =>
    `<li><a href="artifacts/${escape(job.id)}/${escape(a.kind)}" download>${escape(a.kind)}</a> ${a.size} bytes, sha256 ${escape(a.sha256.slice(0, 16))}…</li>`)
    .join("") || "<li>none yet</li>";
}

function movingAverage(points) {
  const out = [];
  let sum = 0;
  points.forEach((p, i) => {
    sum += p.y;
    if (i >= WINDOW) sum -= points[i - WINDOW].y;
    out.push({ x: p.x, y: sum / Math.min(i + 1, WINDOW) });
  });
  return out;
}

function newChart() {
  if (state.chart) state.chart.destroy();
  state.chart = new Chart($("loss"), {
    type: "line",
    data: { datasets: [
      { label: "loss", data: [], borderColor: "#9ab", pointRadius: 1, borderWidth: 1, yAxisID: "y" },
      { label: `moving average (${WINDOW})`, data: [], borderColor: "#e63", pointRadius: 0, borderWidth: 2, yAxisID: "y" },
      { label: "eval loss", data: [], borderColor: "#36c", pointRadius: 3, showLine: true, yAxisID: "y" },
      // grpo's: the completions' mean reward at each step and the held-out prompts' at each evaluation
      { label: "reward", data: [], borderColor: "#2a2", pointRadius: 1, borderWidth: 2, yAxisID: "reward" },
      { label: "eval reward", data: [], borderColor: "#a2a", pointRadius: 3, showLine: true, yAxisID: "reward" },
    ] },
    options: {
      animation: false, parsing: false,
      plugins: { legend: { labels: { filter: (item, data) => data.datasets[item.datasetIndex].data.length > 0 } } },
      scales: {
        x: { type: "linear", title: { display: true, text: "step" } },
        // named, and named by each loss dataset: else Chart.js binds them to the first y scale it finds (reward's)
        y: { type: "linear", position: "left", title: { display: true, text: "loss" } },
        reward: { type: "linear", position: "right", display: false, title: { display: true, text: "reward" } },
      },
    },
  });
}

export function rewardFigures(ev) {
  const r = ev.reinforcement;
  if (!r) return "";
  const kl = r.kl === null || r.kl === undefined ? "" : ` · kl ${fmt(r.kl, 4)}`;
  return ` · reward ${fmt(r.reward, 3)} ± ${fmt(r.reward_std, 3)} · eval reward ${fmt(ev.eval_reward, 3)} · ` +
    `pass ${fmt(100 * r.pass_rate, 0)}%${kl} · ${fmt(r.rollouts_per_s, 1)} rollouts/s` +
    (r.grading_failures ? ` · ${r.grading_failures} grading failures` : "");
}

// a state event as `jetlora watch` says it: a pause says who asked (a preemption: which tenant, and why)
function stateLine(ev) {
  const by = ev.state === "paused" && ev.paused_by ? ` (by ${printable(ev.paused_by)})` : "";
  return `${ev.state}: ${printable(ev.message)}${by}`;
}

function showSamples() {
  const { base, adapter } = state.samples;
  const prompts = (adapter || base).samples.map((s) => s.prompt);
  const scored = (x) => (x.score === null || x.score === undefined ? "" : ` (score ${fmt(x.score, 2)})`);
  const answer = (ev, i, shown) => (ev && ev.samples[i] ? escape(shown(ev.samples[i].answer)) + scored(ev.samples[i]) : "–");
  $("samples").querySelector("tbody").innerHTML =
    `<tr><th>prompt</th><th>base model</th><th>adapter${adapter ? ` (step ${adapter.step})` : ""}</th></tr>` +
    prompts.map((p, i) => `<tr><td>${escape(printable(p))}</td><td>${answer(base, i, baseAnswer)}</td>` +
      `<td>${answer(adapter, i, printable)}</td></tr>`).join("");
}

function onProgress(ev, series) {
  const { evals, rewards, evalRewards } = series;
  if (ev.loss !== null) state.points.push({ x: ev.step, y: ev.loss });
  if (ev.eval_loss !== null && !evals.some((e) => e.x === ev.step)) evals.push({ x: ev.step, y: ev.eval_loss });
  if (ev.reinforcement) rewards.push({ x: ev.step, y: ev.reinforcement.reward });
  const evalReward = ev.eval_reward ?? null;
  if (evalReward !== null && !evalRewards.some((e) => e.x === ev.step)) evalRewards.push({ x: ev.step, y: evalReward });
  $("figures").innerHTML = `step ${ev.step}/${ev.steps} · loss ${fmt(ev.loss)} · eval ${fmt(ev.eval_loss)} · ` +
    `lr ${ev.lr === null ? "–" : ev.lr.toExponential(2)} · ${fmt(ev.tokens_per_s, 0)} tok/s · ` +
    `ETA ${fmt(ev.eta_s, 0)} s · peak ${fmt(ev.peak_mib, 0)} MiB` + rewardFigures(ev);
  const sets = state.chart.data.datasets;
  sets[0].data = state.points;
  sets[1].data = movingAverage(state.points);
  sets[2].data = evals;
  sets[3].data = rewards;
  sets[4].data = evalRewards;
  state.chart.options.scales.reward.display = rewards.length > 0;
  state.chart.update("none");
}

export async function select(ctx, jobId) {
  const { config, js } = ctx;
  if (state.follow) await state.follow.close().catch(() => {});
  state.selected = jobId;
  state.points = [];
  state.samples = {};
  $("job-title").textContent = `job ${jobId}`;
  $("job-state").textContent = "";
  $("figures").textContent = "";
  $("samples").querySelector("tbody").innerHTML = "";
  newChart();
  const series = { evals: [], rewards: [], evalRewards: [] };
  // replay the job's events from the stream's start, then follow live
  const consumer = await js.consumers.get(config.stream, {
    filter_subjects: [sub(config.subjects.job_events, { job: jobId })], deliver_policy: DeliverPolicy.All,
  });
  const messages = await consumer.consume();
  if (state.selected !== jobId) return messages.close(); // another was chosen meanwhile
  state.follow = messages;
  (async () => {
    for await (const m of messages) {
      const ev = JSON.parse(dec.decode(m.data));
      if (ev.type === "progress") onProgress(ev, series);
      else if (ev.type === "state") $("job-state").textContent = stateLine(ev);
      else if (ev.type === "preparing") $("figures").textContent = printable(ev.message); // before the first step
      else if (ev.type === "samples") {
        state.samples[ev.model] = ev; // the base model's (once) and the adapter's latest
        showSamples();
      }
    }
  })();
}
