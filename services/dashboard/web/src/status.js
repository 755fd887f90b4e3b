// The status line: connected, and what does not answer now. A source that answers again clears its problem, so a
// request that timed out once on a busy machine does not stay on the page.
import { $ } from "./text.js";

const problems = new Map();
let connected = "connecting…";

export function setConnected(text) {
  connected = text;
  render();
}

export function problem(source, message) {
  if (message) problems.set(source, message);
  else problems.delete(source);
  render();
}

function render() {
  const el = $("status");
  el.textContent = [connected, ...problems.values()].join(" · ");
  el.className = problems.size ? "problems" : "";
}

// run `fn` now and again `every` ms after each run ends (never two at once, however slow the answers)
export function poll(every, fn) {
  const tick = async () => {
    try {
      await fn();
    } finally {
      setTimeout(tick, every);
    }
  };
  return tick();
}

// a request over NATS whose failure becomes the source's problem (cleared by its next answer); null on failure
export async function ask(nc, source, subject, body, what, timeout = 5000) {
  try {
    const reply = await nc.request(subject, new TextEncoder().encode(JSON.stringify(body ?? {})), { timeout });
    const data = reply.json();
    if (data && data.type === "error") throw new Error(data.error || JSON.stringify(data));
    problem(source, null);
    return data;
  } catch (e) {
    problem(source, `${what}: ${e.message}`);
    return null;
  }
}

// what the NATS server refuses this page (its user's permissions lack a subject it sends to or reads) stays on the
// status line: a missing grant otherwise shows only as a panel that never fills. A consumer's name is left out (an
// ordered consumer is made again, with a new name, after each refusal), so one refusal is said once.
const CONSUMER_NAME = /^(\$JS\.API\.CONSUMER\.(?:MSG\.NEXT|INFO|DELETE)\.[^.]+)\.[^.]+$/;

export async function watchRefusals(nc) {
  for await (const s of nc.status()) {
    const e = s.type === "error" ? s.error : null;
    if (!e || e.name !== "PermissionViolationError") continue;
    const subject = String(e.subject).replace(CONSUMER_NAME, "$1.<consumer>");
    problem(`refused ${e.operation} ${subject}`, `the NATS server refused this page's ${e.operation} on ${subject}: ` +
      "the dashboard user's permissions lack it (`jetlora permissions` writes them)");
  }
}
