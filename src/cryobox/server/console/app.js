// cryobox's web console: one module, no framework, no build step.
//
// The API key lives in this tab's session storage and goes out as a header on every call
// (no cookie: no other site can make the browser act for the user). Every string that
// comes from the server (a guest's file names and logs, labels, command output) enters
// the page through textContent, never as markup.

const KEY = "cryobox.key";
const main = document.getElementById("main");
const nav = document.getElementById("nav");
const statusLine = document.getElementById("status");
let leave = () => {}; // what the shown view must stop (timers, sockets) when another replaces it
const listeners = new Set(); // views that follow the tenant's events

const key = () => sessionStorage.getItem(KEY) || "";

/** An element: el("td", {class: "x", onclick: f}, "text", child...). Text is text. */
function el(tag, attrs = {}, ...children) {
  const node = tag === "svg" || attrs.svg
    ? document.createElementNS("http://www.w3.org/2000/svg", tag)
    : document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "svg" || value === undefined || value === null || value === false) continue;
    if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const svg = (tag, attrs = {}, ...children) => el(tag, {...attrs, svg: true}, ...children);

function say(text, bad = false) {
  statusLine.textContent = text;
  statusLine.style.color = bad ? "#f97066" : "";
}

/** A call of cryobox's API with the key; the answer's JSON (or text, or the Response). */
async function api(method, path, body, {raw = false} = {}) {
  const headers = {Authorization: `Bearer ${key()}`};
  let payload = body;
  if (body !== undefined && !(body instanceof Blob)) {
    headers["Content-Type"] = "application/json";
    payload = JSON.stringify(body);
  }
  const answer = await fetch(path, {method, headers, body: payload});
  if (answer.status === 401) {
    signOut("The API key is not valid.");
    throw new Error("the API key is not valid");
  }
  if (!answer.ok) {
    let message = `${answer.status} ${answer.statusText}`;
    try {
      const found = await answer.json();
      message = typeof found.detail === "string" ? found.detail : JSON.stringify(found.detail);
    } catch { /* not JSON: the status says it */ }
    throw new Error(message);
  }
  if (raw) return answer;
  if (answer.status === 204) return null;
  const type = answer.headers.get("content-type") || "";
  return type.includes("json") ? answer.json() : answer.text();
}

/** Run an action, saying what it does and how it ended. */
async function act(what, call) {
  say(`${what}...`);
  try {
    const result = await call();
    say(`${what}: done`);
    return result;
  } catch (error) {
    say(`${what}: ${error.message}`, true);
    return undefined;
  }
}

const ago = (seconds) => {
  const s = Math.max(0, Date.now() / 1000 - seconds);
  if (s < 60) return `${Math.round(s)} s`;
  if (s < 3600) return `${Math.round(s / 60)} min`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
  return `${(s / 86400).toFixed(1)} d`;
};
const when = (seconds) => new Date(seconds * 1000).toLocaleString();
const bytes = (n) => n >= 1 << 30 ? `${(n / (1 << 30)).toFixed(1)} GiB`
  : n >= 1 << 20 ? `${(n / (1 << 20)).toFixed(1)} MiB` : `${Math.round(n / 1024)} KiB`;
const dollars = (n) => n === 0 ? "$0" : n < 0.01 ? `$${n.toPrecision(2)}` : `$${n.toFixed(n < 1 ? 4 : 2)}`;

// ---------------------------------------------------------------- signing in and out

function signOut(message = "") {
  sessionStorage.removeItem(KEY);
  location.hash = "";
  showSignIn(message);
}

function showSignIn(message = "") {
  leave();
  nav.hidden = true;
  main.replaceChildren(document.getElementById("sign-in").content.cloneNode(true));
  const form = main.querySelector("form");
  const error = form.querySelector(".error");
  if (message) { error.textContent = message; error.hidden = false; }
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY, form.elements.key.value.trim());
    try {
      await api("GET", "/sandboxes");
    } catch (failure) {
      error.textContent = failure.message;
      error.hidden = false;
      return;
    }
    location.hash = "#/sandboxes";
    route();
  });
}

// ---------------------------------------------------------------- the tenant's events

let events = null;

/** Follow /events (a fetch stream: an EventSource cannot send the key), forever. */
async function follow() {
  if (events) return;
  events = new AbortController();
  const signal = events.signal;
  while (!signal.aborted && key()) {
    try {
      const answer = await fetch("/events", {headers: {Authorization: `Bearer ${key()}`}, signal});
      if (!answer.ok) throw new Error(String(answer.status));
      const reader = answer.body.getReader();
      const decoder = new TextDecoder();
      let pending = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        pending += decoder.decode(value, {stream: true});
        let end;
        while ((end = pending.indexOf("\n\n")) >= 0) {
          const block = pending.slice(0, end);
          pending = pending.slice(end + 2);
          const data = block.split("\n").find((line) => line.startsWith("data: "));
          if (data) {
            const event = JSON.parse(data.slice(6));
            for (const listener of listeners) listener(event);
          }
        }
      }
    } catch { /* the server went away or we left: try again shortly */ }
    await new Promise((done) => setTimeout(done, 2000));
  }
}

/** Call ``load`` now, again on each event (at most every 300 ms), until the view is left. */
function live(load) {
  let timer = null;
  const listener = () => {
    clearTimeout(timer);
    timer = setTimeout(load, 300);
  };
  listeners.add(listener);
  load();
  return () => { listeners.delete(listener); clearTimeout(timer); };
}

// ---------------------------------------------------------------- sandboxes

function costOf(line, prices) {
  if (!line) return 0;
  return line.vcpu_seconds / 3600 * prices.vcpu_hour + line.gib_seconds / 3600 * prices.gib_hour
    + line.stored_gb_months * prices.gb_month;
}

function sandboxActions(info, reload) {
  const call = (what, method, path, body) => el("button", {
    type: "button", "data-action": what, onclick: async () => {
      await act(`${what} ${info.id}`, () => api(method, `/sandboxes/${info.id}${path}`, body));
      reload();
    },
  }, what);
  const running = info.state === "running";
  return [
    running && call("pause", "POST", "/pause"),
    info.state === "paused" && call("resume", "POST", "/resume"),
    running && call("checkpoint", "POST", "/checkpoints", {}),
    running && call("fork", "POST", "/forks", {count: 1}),
    call("kill", "DELETE", ""),
  ];
}

function showSandboxes() {
  const table = el("table", {id: "sandboxes"});
  const create = el("button", {class: "primary", type: "button", id: "create", onclick: async () => {
    create.disabled = true;
    const made = await act("creating a sandbox", () => api("POST", "/sandboxes", {template: template.value || "default"}));
    create.disabled = false;
    if (made) load();
  }}, "New sandbox");
  const template = el("input", {id: "template", placeholder: "template (default)", size: 18});
  const showAll = el("input", {type: "checkbox", id: "all", onchange: () => load()});
  main.replaceChildren(
    el("div", {class: "toolbar"}, create, template, el("label", {}, showAll, " killed and dead too")),
    table,
  );
  async function load() {
    const [list, usage] = await Promise.all([
      api("GET", `/sandboxes?all=${showAll.checked}`),
      api("GET", "/usage").catch(() => ({sandboxes: [], prices: {vcpu_hour: 0, gib_hour: 0, gb_month: 0}})),
    ]);
    const lines = new Map(usage.sandboxes.map((line) => [line.id, line]));
    list.sort((a, b) => b.created_at - a.created_at);
    table.replaceChildren(
      el("tr", {}, ...["Sandbox", "State", "From", "Age", "Host", "Shape", "Cost so far", "Labels", ""].map((h) => el("th", {}, h))),
      ...list.map((info) => el("tr", {"data-id": info.id},
        el("td", {}, el("a", {href: `#/sandbox/${info.id}`}, info.id)),
        el("td", {}, el("span", {class: `state ${info.state}`}, info.state)),
        el("td", {}, info.forked_from ? `fork of ${info.forked_from}` : info.origin || info.template),
        el("td", {}, ago(info.created_at)),
        el("td", {}, info.host || "-"),
        el("td", {}, `${info.cpus} vCPU, ${info.memory_mib} MiB`),
        el("td", {}, dollars(costOf(lines.get(info.id), usage.prices))),
        el("td", {}, Object.entries(info.metadata || {}).map(([k, v]) => el("span", {class: "label"}, `${k}=${v}`))),
        el("td", {class: "actions"}, sandboxActions(info, load)),
      )),
    );
  }
  leave = live(() => load().catch((error) => say(error.message, true)));
}

// ---------------------------------------------------------------- one sandbox

function openTerminal(id, box) {
  const terminal = new Terminal({fontSize: 13, convertEol: false, cursorBlink: true});
  const fit = new FitAddon.FitAddon();
  terminal.loadAddon(fit);
  terminal.open(box);
  fit.fit();
  const scheme = location.protocol === "https:" ? "wss" : "ws";
  const socket = new WebSocket(`${scheme}://${location.host}/sandboxes/${id}/terminal`);
  socket.binaryType = "arraybuffer";
  socket.onopen = () => socket.send(JSON.stringify({key: key(), cols: terminal.cols, rows: terminal.rows}));
  socket.onmessage = (message) => {
    if (typeof message.data === "string") {
      const end = JSON.parse(message.data);
      terminal.write(`\r\n[exited with ${end.exit}]\r\n`);
    } else {
      terminal.write(new Uint8Array(message.data));
    }
  };
  socket.onclose = (event) => {
    if (event.code >= 4000) terminal.write(`\r\n[${event.reason}]\r\n`);
  };
  terminal.onData((data) => socket.readyState === 1 && socket.send(JSON.stringify({input: data})));
  terminal.onResize(({cols, rows}) => socket.readyState === 1 && socket.send(JSON.stringify({resize: [cols, rows]})));
  const refit = () => fit.fit();
  window.addEventListener("resize", refit);
  return () => { window.removeEventListener("resize", refit); socket.close(); terminal.dispose(); };
}

function fileBrowser(id) {
  const path = el("input", {id: "path", value: "/root", size: 30});
  const list = el("ul", {id: "files"});
  const upload = el("input", {type: "file", id: "upload", onchange: async () => {
    for (const file of upload.files) {
      const target = `${path.value.replace(/\/$/, "")}/${file.name}`;
      await act(`uploading ${file.name}`, () => api("PUT", `/sandboxes/${id}/files?path=${encodeURIComponent(target)}`, file));
    }
    upload.value = "";
    show();
  }});
  async function download(entry) {
    const answer = await api("GET", `/sandboxes/${id}/files?path=${encodeURIComponent(entry.path)}`, undefined, {raw: true});
    const link = el("a", {href: URL.createObjectURL(await answer.blob()), download: entry.name});
    link.click();
    URL.revokeObjectURL(link.href);
  }
  async function show() {
    let entries;
    try {
      entries = await api("GET", `/sandboxes/${id}/files/list?path=${encodeURIComponent(path.value)}`);
    } catch (error) {
      list.replaceChildren(el("li", {class: "error"}, error.message));
      return;
    }
    entries.sort((a, b) => (b.type === "dir") - (a.type === "dir") || a.name.localeCompare(b.name));
    const up = path.value.replace(/\/[^/]*\/?$/, "") || "/";
    list.replaceChildren(
      path.value !== "/" ? el("li", {}, el("a", {onclick: () => { path.value = up; show(); }}, "..")) : null,
      ...entries.map((entry) => el("li", {class: "entry"},
        el("a", {onclick: () => {
          if (entry.type === "dir") { path.value = entry.path; show(); } else download(entry);
        }}, entry.type === "dir" ? `${entry.name}/` : entry.name),
        entry.type === "dir" ? "" : `  ${bytes(entry.size)}`)),
    );
  }
  path.addEventListener("change", show);
  show();
  return el("div", {class: "card files"}, el("h3", {}, "Files"),
    el("div", {class: "toolbar"}, path, el("button", {type: "button", onclick: show}, "Go"), upload), list);
}

function showSandbox(id) {
  const info = el("div", {class: "card", id: "info"});
  const logs = el("pre", {class: "logs", id: "logs"});
  const box = el("div", {id: "terminal"});
  let closeTerminal = () => {};
  main.replaceChildren(info, el("div", {class: "grid"},
    el("div", {class: "card"}, el("h3", {}, "Terminal"), box),
    el("div", {class: "card"}, el("h3", {}, "Logs"), logs)), fileBrowser(id));
  let terminalFor = "";
  async function load() {
    const found = await api("GET", `/sandboxes/${id}`);
    const ports = Object.entries(found.ports || {}).map(([guest, host]) =>
      el("a", {href: `${location.protocol}//${location.hostname}:${host}/`, target: "_blank", rel: "noopener"}, `${guest} -> ${host}`));
    info.replaceChildren(
      el("h2", {}, found.id, " ", el("span", {class: `state ${found.state}`}, found.state)),
      el("p", {}, `from ${found.forked_from ? `a fork of ${found.forked_from}` : found.origin || found.template}`,
        ` · ${found.cpus} vCPU, ${found.memory_mib} MiB, ${found.disk_gib} GiB · created ${when(found.created_at)}`,
        found.host ? ` · on host ${found.host}` : ""),
      el("p", {}, "ports: ", ports.length ? ports.flatMap((p) => [p, " "]) : "none"),
      el("div", {class: "actions"}, sandboxActions(found, load)),
    );
    if (found.state === "running" && terminalFor !== found.state) {
      terminalFor = found.state;
      closeTerminal = openTerminal(id, box);
    }
  }
  async function tail() {
    const atEnd = logs.scrollTop + logs.clientHeight >= logs.scrollHeight - 4;
    logs.textContent = await api("GET", `/sandboxes/${id}/logs`);
    if (atEnd) logs.scrollTop = logs.scrollHeight;
  }
  const stopLive = live(() => load().catch((error) => say(error.message, true)));
  const timer = setInterval(() => tail().catch(() => {}), 2000);
  tail().catch(() => {});
  leave = () => { stopLive(); clearInterval(timer); closeTerminal(); };
}

// ---------------------------------------------------------------- history

const NODE_W = 168, NODE_H = 40, GAP_X = 18, GAP_Y = 34;

/** Positions of a forest: each leaf its own column, a parent centred over its children,
 * a level per generation (a tidy tree, laid out once per load). */
export function layout(nodes) {
  const byId = new Map(nodes.map((node) => [node.id, node]));
  const children = new Map();
  const roots = [];
  for (const node of nodes) {
    const parent = byId.has(node.parent) ? node.parent : byId.has(node.forked_from) ? node.forked_from : null;
    if (parent && parent !== node.id) {
      if (!children.has(parent)) children.set(parent, []);
      children.get(parent).push(node);
    } else {
      roots.push(node);
    }
  }
  const at = new Map();
  let column = 0;
  const seen = new Set();
  const place = (node, depth) => {
    if (seen.has(node.id)) return;
    seen.add(node.id);
    const below = (children.get(node.id) || []).filter((child) => !seen.has(child.id));
    below.forEach((child) => place(child, depth + 1));
    const xs = below.map((child) => at.get(child.id)?.x).filter((x) => x !== undefined);
    const x = xs.length ? (Math.min(...xs) + Math.max(...xs)) / 2 : column++ * (NODE_W + GAP_X);
    at.set(node.id, {x, y: depth * (NODE_H + GAP_Y)});
  };
  roots.forEach((root) => place(root, 0));
  return {at, children};
}

function showHistory() {
  const area = el("div", {class: "card", id: "history"});
  main.replaceChildren(el("p", {}, "Sandboxes (blue) and what they came from: click a snapshot or checkpoint to start a sandbox from it or roll its sandbox back to it; a sandbox to open or fork it."), area);
  let menu = null;
  const closeMenu = () => { menu?.remove(); menu = null; };
  document.addEventListener("click", closeMenu);
  async function load() {
    const [nodes, snapshots, sandboxes] = await Promise.all([
      api("GET", "/lineage"), api("GET", "/snapshots"), api("GET", "/sandboxes"),
    ]);
    const saved = new Map(snapshots.map((snap) => [snap.id, snap]));
    const states = new Map(sandboxes.map((info) => [info.id, info.state]));
    const {at} = layout(nodes);
    let width = 0, height = 0;
    for (const {x, y} of at.values()) { width = Math.max(width, x + NODE_W); height = Math.max(height, y + NODE_H); }
    const picture = svg("svg", {class: "lineage", width: width + 20, height: height + 20, viewBox: `-10 -10 ${width + 20} ${height + 20}`});
    for (const node of nodes) {
      const to = at.get(node.id);
      for (const [from, kind] of [[node.parent, "edge"], [node.forked_from, "edge fork"]]) {
        const start = from && at.get(from);
        if (!start || (kind === "edge fork" && from === node.parent)) continue;
        const x1 = start.x + NODE_W / 2, y1 = start.y + NODE_H, x2 = to.x + NODE_W / 2, y2 = to.y;
        picture.append(svg("path", {class: kind, d: `M${x1},${y1} C${x1},${(y1 + y2) / 2} ${x2},${(y1 + y2) / 2} ${x2},${y2}`}));
      }
    }
    for (const node of nodes) {
      const {x, y} = at.get(node.id);
      const snap = saved.get(node.id);
      const meta = node.kind === "sandbox" ? node.state
        : snap ? `${new Date(snap.created_at * 1000).toLocaleTimeString()} · ${bytes(snap.stored_bytes || snap.size_bytes)}` : node.state;
      const group = svg("g", {
        class: `node ${node.kind}${snap?.automatic ? " automatic" : ""}`, transform: `translate(${x},${y})`,
        "data-id": node.id, "data-kind": node.kind, tabindex: 0,
        onclick: (event) => { event.stopPropagation(); closeMenu(); menu = nodeMenu(node, snap, states, event, load); },
      }, svg("rect", {width: NODE_W, height: NODE_H}),
      svg("text", {x: 8, y: 16}, node.kind === "sandbox" ? node.id : (node.label || node.id).slice(0, 26)),
      svg("text", {x: 8, y: 31, class: "meta"}, node.kind === "sandbox" && node.label ? `${meta} · ${node.label}`.slice(0, 30) : meta));
      picture.append(group);
    }
    area.replaceChildren(picture);
  }
  const stopLive = live(() => load().catch((error) => say(error.message, true)));
  leave = () => { stopLive(); closeMenu(); document.removeEventListener("click", closeMenu); };
}

function nodeMenu(node, snap, states, event, reload) {
  const item = (text, call) => el("button", {type: "button", onclick: async (click) => {
    click.stopPropagation();
    box.remove();
    const result = await act(text, call);
    if (result !== undefined) reload();
  }}, text);
  const box = el("div", {class: "menu", id: "node-menu", style: `left:${event.clientX}px;top:${event.clientY}px`, onclick: (e) => e.stopPropagation()});
  if (node.kind === "sandbox") {
    box.append(el("strong", {}, node.id));
    box.append(el("button", {type: "button", onclick: () => { location.hash = `#/sandbox/${node.id}`; }}, "Open"));
    if (states.get(node.id) === "running") {
      box.append(item("Fork it", () => api("POST", `/sandboxes/${node.id}/forks`, {count: 1})));
      box.append(item("Checkpoint it", () => api("POST", `/sandboxes/${node.id}/checkpoints`, {})));
    }
  } else {
    box.append(el("strong", {}, node.label || node.id));
    box.append(item("Start a sandbox from it", () => api("POST", "/sandboxes", {template: "default", from_snapshot: node.id})));
    const source = snap?.source_sandbox;
    if (snap?.purpose === "checkpoint" && states.get(source) === "running") {
      box.append(item(`Roll ${source} back to it`, () => api("POST", `/sandboxes/${source}/rollback`, {checkpoint: node.id}).then(() => true)));
    }
  }
  document.body.append(box);
  return box;
}

// ---------------------------------------------------------------- usage

function bars(days, value, title, kind) {
  const width = 640, height = 160, top = Math.max(...days.map(value), 1e-9);
  const step = width / Math.max(days.length, 1);
  return svg("svg", {class: "chart", width, height: height + 30},
    svg("text", {x: 0, y: 12}, `${title} (max ${dollars(top)})`),
    ...days.flatMap((day, i) => {
      const h = value(day) / top * (height - 20);
      return [svg("rect", {class: kind, x: i * step + 2, y: height - h, width: Math.max(step - 4, 2), height: h},
        svg("title", {}, `${day.day}: ${dollars(value(day))}`)),
      i % 5 === 4 || i === days.length - 1 ? svg("text", {x: i * step + 2, y: height + 14}, day.day.slice(5)) : null];
    }));
}

/** The last ``count`` UTC days, oldest first, each with what ``found`` says of it (or 0). */
function lastDays(found, count) {
  const byDay = new Map(found.map((day) => [day.day, day]));
  const zero = {vcpu_seconds: 0, gib_seconds: 0, stored_gb_months: 0, cost_usd: {compute: 0, storage: 0, total: 0}};
  return Array.from({length: count}, (_, i) => {
    const day = new Date(Date.now() - (count - 1 - i) * 86400000).toISOString().slice(0, 10);
    return byDay.get(day) || {...zero, day};
  });
}

async function showUsage() {
  leave = () => {};
  const [daily, total] = await Promise.all([api("GET", "/usage/days?days=30"), api("GET", "/usage")]);
  const prices = daily.prices;
  daily.days = lastDays(daily.days, 30);
  main.replaceChildren(
    el("div", {class: "card", id: "usage"},
      el("h2", {}, `So far: ${dollars(total.cost_usd.total)}`),
      el("p", {}, `compute ${dollars(total.cost_usd.compute)} (${(total.vcpu_seconds / 3600).toFixed(2)} vCPU-h, ${(total.gib_seconds / 3600).toFixed(2)} GiB-h) · saved state ${dollars(total.cost_usd.storage)} (${total.stored_gb_months.toFixed(4)} GB-months, ${bytes(total.stored_bytes)} held now)`),
      el("p", {}, `Prices: ${dollars(prices.vcpu_hour)} per vCPU-hour, ${dollars(prices.gib_hour)} per GiB-hour of RAM, ${dollars(prices.gb_month)} per GB-month of saved state (CRYOBOX_PRICE_* on the server).`)),
    el("div", {class: "card"}, bars(daily.days, (d) => d.cost_usd.compute, "Compute per day", "compute")),
    el("div", {class: "card"}, bars(daily.days, (d) => d.cost_usd.storage, "Saved state per day", "storage")),
  );
}

// ---------------------------------------------------------------- routing

function route() {
  leave();
  leave = () => {};
  if (!key()) return showSignIn();
  nav.hidden = false;
  follow();
  const [, view, id] = location.hash.split("/");
  for (const link of nav.querySelectorAll("a")) {
    link.classList.toggle("active", link.getAttribute("href") === `#/${view === "sandbox" ? "sandboxes" : view || "sandboxes"}`);
  }
  if (view === "sandbox" && id) return showSandbox(decodeURIComponent(id));
  if (view === "history") return showHistory();
  if (view === "usage") return showUsage().catch((error) => say(error.message, true));
  return showSandboxes();
}

document.getElementById("sign-out").addEventListener("click", () => {
  events?.abort();
  events = null;
  signOut();
});
window.addEventListener("hashchange", route);
route();
