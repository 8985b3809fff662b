// A tiny DOM builder: h("button", { onclick, class: "primary" }, "Save").
export type Child = Node | string | number | null | undefined | false | Child[];
type Attrs = Record<string, unknown>;

export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  attrs?: Attrs | null,
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs ?? {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value as EventListener);
    } else if (key === "value" && "value" in el) {
      (el as HTMLInputElement).value = String(value);
    } else if (key === "checked" && "checked" in el) {
      (el as HTMLInputElement).checked = Boolean(value);
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(el: Node, children: Child[]): void {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

export function clear(el: Element, ...children: Child[]): void {
  el.replaceChildren();
  append(el, children);
}

export function when(iso: string | null | undefined): string {
  if (!iso) return "—";
  const d = new Date(iso);
  return d.toLocaleString(undefined, { dateStyle: "short", timeStyle: "medium" });
}

export function badge(status: string): HTMLElement {
  return h("span", { class: `badge s-${status}`, "data-status": status }, status.replace(/_/g, " "));
}

let ids = 0;
export function uid(prefix = "f"): string {
  ids += 1;
  return `${prefix}-${ids}`;
}

/** A labelled form field; `control` gets the id the label points at. */
export function field(label: string, control: HTMLElement, help?: string): HTMLElement {
  const id = control.id || uid();
  control.id = id;
  const helpId = help ? `${id}-help` : undefined;
  if (helpId) control.setAttribute("aria-describedby", helpId);
  return h("div", { class: "field" }, h("label", { for: id }, label), control, help ? h("p", { class: "help", id: helpId }, help) : null);
}

export function table(headers: string[], rows: Child[][], caption?: string): HTMLElement {
  if (rows.length === 0) return h("p", { class: "empty" }, "Nothing here yet.");
  return h(
    "div",
    { class: "table-wrap" },
    h(
      "table",
      null,
      caption ? h("caption", null, caption) : null,
      h("thead", null, h("tr", null, headers.map((t) => h("th", { scope: "col" }, t)))),
      h("tbody", null, rows.map((r) => h("tr", null, r.map((c) => h("td", null, c))))),
    ),
  );
}
