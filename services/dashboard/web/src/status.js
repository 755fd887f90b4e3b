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
