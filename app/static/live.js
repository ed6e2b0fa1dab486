// The live page: subscribes to one view over /ws (or server-sent events) and keeps its rows in
// a table. Protocols: docs/api.md, "Websocket /ws" and "Server-sent events". No framework, no
// build step.

const SUB = "live"; // the page's one subscription id
const RETRYABLE = new Set(["unavailable"]); // other errors need the user to change something
const FATAL_CLOSE = new Set([4401, 4403, 1008, 1009]); // bad token, wrong scope, bad message
const MAX_BACKOFF_MS = 30000;

const $ = (id) => document.getElementById(id);
const ui = {
  form: $("subscribe-form"),
  token: $("token"),
  loadViews: $("load-views"),
  view: $("view"),
  viewHint: $("view-hint"),
  filter: $("filter"),
  protocol: $("protocol"),
  subscribe: $("subscribe"),
  stop: $("stop"),
  state: $("state"),
  position: $("position"),
  heartbeat: $("heartbeat"),
  error: $("error"),
  caption: $("caption"),
  head: document.querySelector("#rows thead tr"),
  body: document.querySelector("#rows tbody"),
};

let views = new Map(); // name -> {name, key, filterable, columns} from GET /views
let session = null; // the current subscription; a new one makes the old one's events moot

// -- views ------------------------------------------------------------------------------------

async function loadViews() {
  hideError();
  const token = ui.token.value.trim();
  if (!token) {
    showError("Paste a token to list the views.");
    return;
  }
  let response, body;
  try {
    response = await fetch("/views", { headers: { Authorization: `Bearer ${token}` } });
    body = await response.json();
  } catch (e) {
    showError(`Could not load the views: ${e.message}`);
    return;
  }
  if (!response.ok) {
    showError(describe(body?.error) ?? `GET /views answered ${response.status}`);
    return;
  }
  views = new Map(body.views.map((v) => [v.name, v]));
  const chosen = ui.view.value;
  ui.view.replaceChildren(
    ...[...views.keys()].map((name) => new Option(name, name, false, name === chosen)),
  );
  ui.view.disabled = ui.subscribe.disabled = views.size === 0;
  showHint();
}

function showHint() {
  const v = views.get(ui.view.value);
  ui.viewHint.textContent = v ? `key: ${v.key.join(", ")}; filterable: ${filterable(v)}` : "";
}

function filterable(view) {
  return [...new Set([...view.key, ...view.filterable])].join(", ");
}

function parseFilter(text) {
  text = text.trim();
  if (!text) return {};
  const at = text.indexOf("=");
  if (at < 1) throw new Error("Write the filter as column=value.");
  return { [text.slice(0, at).trim()]: text.slice(at + 1) };
}

// -- the subscription -------------------------------------------------------------------------

function start(view, filter) {
  stop();
  const s = { view, filter, token: ui.token.value.trim(), position: null, attempts: 0 };
  s.protocol = ui.protocol.value;
  s.socket = s.timer = null;
  s.live = true;
  session = s;
  ui.stop.disabled = false;
  ui.position.textContent = ui.heartbeat.textContent = "–";
  renderHeader(view);
  clearRows(s);
  connect(s);
}

function stop() {
  const s = session;
  if (!s) return;
  s.live = false;
  session = null;
  clearTimeout(s.timer);
  s.socket?.close(1000); // (an EventSource's close takes no code)
  ui.stop.disabled = true;
  setState("Stopped.");
}

function connect(s) {
  if (s.protocol === "sse") return connectEvents(s);
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  const socket = new WebSocket(`${scheme}//${location.host}/ws`);
  s.socket = socket;
  setState(s.position ? `Reconnecting from ${s.position}…` : "Connecting…");
  socket.onopen = () => {
    // The token goes in the first message, never in the URL (which servers log).
    socket.send(JSON.stringify({ op: "auth", token: s.token }));
    const subscribe = { op: "subscribe", id: SUB, view: s.view.name, filter: s.filter };
    socket.send(JSON.stringify({ ...subscribe, since: s.position }));
  };
  socket.onmessage = (event) => {
    if (session === s && s.socket === socket) handle(s, JSON.parse(event.data));
  };
  socket.onclose = (event) => {
    if (session === s && s.socket === socket && s.live) retry(s, event);
  };
}

// Server-sent events: an EventSource cannot send headers, so the token goes in the URL (the
// API's access log is off by default). The browser reconnects by itself with Last-Event-ID
// (every snapshot and change carries its position as its id) after the stream ends.
const EVENTS = ["snapshot", "change", "resync", "lagging"];
const RESUMED_BY_BROWSER = new Set(["too_slow", "unavailable"]);

function connectEvents(s) {
  const params = new URLSearchParams({ ...s.filter, token: s.token });
  if (s.position) params.set("since", s.position);
  const url = `/views/${encodeURIComponent(s.view.name)}/events?${params}`;
  const source = new EventSource(url);
  s.socket = source;
  setState(s.position ? `Reconnecting from ${s.position}…` : "Connecting…");
  const mine = () => session === s && s.socket === source;
  source.onopen = () => {
    if (mine()) handle(s, { type: "subscribed" });
  };
  for (const type of EVENTS) {
    source.addEventListener(type, (event) => {
      if (mine()) handle(s, { ...JSON.parse(event.data), type });
    });
  }
  source.addEventListener("error", (event) => {
    if (!mine()) return;
    if (event.data) {
      // The server's own error: the stream ends after it.
      const m = JSON.parse(event.data);
      showError(describe(m));
      if (!RESUMED_BY_BROWSER.has(m.code)) {
        s.live = false;
        source.close();
        ui.stop.disabled = true;
        setState("Stopped after an error.");
      }
    } else if (source.readyState === EventSource.CLOSED) {
      refused(s, url); // an EventSource does not say why: ask once more to read the error
    } else {
      setState(`Disconnected; the browser reconnects from ${s.position ?? "the start"}…`);
    }
  });
}

async function refused(s, url) {
  const abort = new AbortController();
  let error = null;
  try {
    const response = await fetch(url, { signal: abort.signal });
    if (!response.ok) error = (await response.json())?.error ?? null;
  } catch {
    // unreachable: retried below
  } finally {
    abort.abort();
  }
  if (session !== s) return;
  if (error && !RESUMED_BY_BROWSER.has(error.code) && error.code !== "too_many_requests") {
    showError(describe(error));
    s.live = false;
    ui.stop.disabled = true;
    setState("Stopped after an error.");
    return;
  }
  retry(s, { code: error?.code ?? "unreachable" });
}

function retry(s, event) {
  if (FATAL_CLOSE.has(event.code)) {
    s.live = false;
    ui.stop.disabled = true;
    setState(`Closed by the server (code ${event.code}).`);
    return;
  }
  // Exponential backoff with jitter, so a restarted server is not hit by every page at once.
  const delay = Math.min(MAX_BACKOFF_MS, 500 * 2 ** s.attempts) * (0.5 + Math.random() / 2);
  s.attempts += 1;
  setState(`Disconnected (code ${event.code}); reconnecting in ${(delay / 1000).toFixed(1)} s…`);
  s.timer = setTimeout(() => connect(s), delay);
}

function handle(s, m) {
  switch (m.type) {
    case "subscribed":
      setState(
        s.position ? `Live (resumed after ${s.position}).` : "Subscribed; waiting for the snapshot…",
      );
      break;
    case "snapshot":
      clearRows(s);
      for (const row of m.rows) upsert(s, keyOf(s.view, row), row);
      healthy(s, m.position);
      setState("Live.");
      break;
    case "change":
      if (m.op === "delete") remove(s, keyOf(s.view, m.key));
      else upsert(s, keyOf(s.view, m.key), m.row);
      healthy(s, m.position);
      break;
    case "resync":
      // Our position can no longer be served (or the view was rebuilt): a new snapshot follows.
      s.position = null;
      clearRows(s);
      setState("Resync: waiting for a new snapshot…");
      break;
    case "lagging":
      setState(`Lagging: ${m.behind} messages behind.`);
      break;
    case "heartbeat":
      s.attempts = 0;
      ui.heartbeat.dateTime = new Date().toISOString();
      ui.heartbeat.textContent = new Date().toLocaleTimeString();
      break;
    case "error":
      showError(describe(m));
      if (RETRYABLE.has(m.code)) {
        s.socket.close(); // onclose reconnects with backoff
      } else {
        s.live = false;
        s.socket.close(1000);
        ui.stop.disabled = true;
        setState("Stopped after an error.");
      }
      break;
  }
}

function healthy(s, position) {
  s.attempts = 0;
  s.position = position;
  ui.position.textContent = position;
  hideError();
}

// -- the table --------------------------------------------------------------------------------

// A row's key as the REST API writes it: key column values joined with "," (GET /views/<v>/<key>).
function keyOf(view, values) {
  return view.key.map((c) => String(values[c])).join(",");
}

function renderHeader(view) {
  ui.head.replaceChildren(
    ...view.columns.map((c) => {
      const th = document.createElement("th");
      th.scope = "col";
      th.textContent = c;
      return th;
    }),
  );
}

function clearRows(s) {
  s.rows = new Map(); // key -> <tr>
  ui.body.replaceChildren();
  caption(s);
}

function upsert(s, key, row) {
  let tr = s.rows.get(key);
  if (!tr) {
    tr = document.createElement("tr");
    tr.dataset.key = key;
    ui.body.append(tr);
    s.rows.set(key, tr);
  }
  tr.replaceChildren(
    ...s.view.columns.map((c) => {
      const td = document.createElement("td");
      td.dataset.column = c;
      td.textContent = show(row[c]);
      return td;
    }),
  );
  caption(s);
}

function remove(s, key) {
  s.rows.get(key)?.remove();
  s.rows.delete(key);
  caption(s);
}

function show(value) {
  if (value === null || value === undefined) return "";
  return typeof value === "object" ? JSON.stringify(value) : String(value);
}

function caption(s) {
  const filter = Object.entries(s.filter).map(([c, v]) => ` where ${c} = ${v}`).join("");
  const n = s.rows.size;
  ui.caption.textContent = `${s.view.name}${filter}: ${n} ${n === 1 ? "row" : "rows"}`;
}

// -- status -----------------------------------------------------------------------------------

function setState(text) {
  ui.state.textContent = text;
}

function describe(error) {
  return error ? `${error.code}: ${error.message}` : null;
}

function showError(text) {
  ui.error.textContent = text;
  ui.error.hidden = false;
}

function hideError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

// -- wiring -----------------------------------------------------------------------------------

ui.loadViews.addEventListener("click", loadViews);
ui.token.addEventListener("change", loadViews);
ui.view.addEventListener("change", showHint);
ui.stop.addEventListener("click", stop);
ui.form.addEventListener("submit", (event) => {
  event.preventDefault();
  hideError();
  const view = views.get(ui.view.value);
  if (!view) return showError("Load the views and pick one first.");
  try {
    start(view, parseFilter(ui.filter.value));
  } catch (e) {
    showError(e.message);
  }
});

// A token in the fragment (/live#token=…) never reaches the server; drop it from the address
// bar and the history once read.
const fragment = new URLSearchParams(location.hash.slice(1));
if (fragment.has("token")) {
  ui.token.value = fragment.get("token");
  history.replaceState(null, "", location.pathname + location.search);
  loadViews();
}
