import { FitAddon } from "@xterm/addon-fit";
import { Terminal } from "@xterm/xterm";
import { get, token, wsUrl } from "../api";
import type { Obj } from "../context";
import { h } from "../dom";
import type { Cleanup } from "../nav";

const CLOSE_REASONS: Record<number, string> = {
  4401: "not signed in",
  4403: "you may not open a terminal on this allocation",
  4404: "allocation not found",
  4409: "the allocation is not active",
  4502: "the allocation's SSH endpoint is unreachable",
};

export async function terminalPage(main: HTMLElement, [id]: string[]): Promise<Cleanup> {
  const alloc = await get<Obj>(`/api/allocations/allocations/${id}`);
  const status = h("p", { role: "status", id: "terminal-status", "aria-live": "polite" }, "Connecting…");
  const box = h("div", { class: "terminal", id: "terminal", "aria-label": `Terminal on ${alloc.name}` });
  main.append(
    h("div", { class: "title-row" }, h("h1", null, `Terminal · ${alloc.name}`), h("a", { class: "button secondary", href: `#/allocations/${id}` }, "Back to allocation")),
    status,
    box,
  );
  const term = new Terminal({ cursorBlink: true, convertEol: false, fontSize: 14, screenReaderMode: true, scrollback: 2000 });
  const fit = new FitAddon();
  term.loadAddon(fit);
  term.open(box);
  fit.fit();
  const url = wsUrl(
    `/api/allocations/allocations/${id}/terminal?access_token=${encodeURIComponent(await token())}&cols=${term.cols}&rows=${term.rows}`,
  );
  const ws = new WebSocket(url);
  ws.binaryType = "arraybuffer";
  ws.onopen = () => {
    status.textContent = "Connected.";
    status.dataset.state = "open";
    term.focus();
  };
  ws.onmessage = (ev) => {
    if (typeof ev.data === "string") term.write(ev.data);
    else term.write(new Uint8Array(ev.data as ArrayBuffer));
  };
  ws.onclose = (ev) => {
    status.textContent = `Disconnected${ev.code ? ` (${CLOSE_REASONS[ev.code] ?? `code ${ev.code}`})` : ""}.`;
    status.dataset.state = "closed";
  };
  const input = term.onData((data) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "input", data }));
  });
  const resize = term.onResize(({ cols, rows }) => {
    if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ type: "resize", cols, rows }));
  });
  const onWindow = () => fit.fit();
  window.addEventListener("resize", onWindow);
  return () => {
    window.removeEventListener("resize", onWindow);
    input.dispose();
    resize.dispose();
    ws.close();
    term.dispose();
  };
}
