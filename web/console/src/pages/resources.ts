import { del, describe, get, post } from "../api";
import type { Context, Obj } from "../context";
import { badge, clear, field, h, table } from "../dom";

const A = "/api/allocations";

export async function keysAndVolumes(main: HTMLElement, _p: string[], ctx: Context): Promise<void> {
  const keysBox = h("section", { "aria-labelledby": "h-keys" });
  const volBox = h("section", { "aria-labelledby": "h-vols" });
  main.append(h("h1", null, "SSH keys and volumes"), keysBox, volBox);

  const loadKeys = async () => {
    const keys = await get<Obj[]>(`${A}/ssh-keys`);
    const name = h("input", { required: true, maxlength: 100, value: "laptop" });
    const key = h("textarea", { required: true, rows: 3, placeholder: "ssh-ed25519 AAAA… you@laptop" });
    const err = h("p", { class: "error", role: "alert", hidden: true });
    clear(
      keysBox,
      h("h2", { id: "h-keys" }, "Your SSH keys"),
      table(
        ["Name", "Fingerprint", ""],
        keys.map((k) => [k.name, h("code", null, k.fingerprint), h("button", { type: "button", class: "secondary", onclick: async () => { await del(`${A}/ssh-keys/${k.key_id}`); await loadKeys(); } }, "Delete")]),
      ),
      h(
        "form",
        {
          class: "card",
          onsubmit: async (e: Event) => {
            e.preventDefault();
            try {
              await post(`${A}/ssh-keys`, { name: name.value, public_key: key.value.trim() });
              await loadKeys();
            } catch (ex) {
              err.textContent = describe(ex);
              err.hidden = false;
            }
          },
        },
        h("h3", null, "Add a key"),
        field("Key name", name),
        field("Public key", key),
        err,
        h("button", { type: "submit", class: "primary" }, "Add key"),
      ),
    );
  };

  const loadVolumes = async () => {
    if (!ctx.project) {
      clear(volBox, h("h2", { id: "h-vols" }, "Volumes"), h("p", { class: "empty" }, "No project selected."));
      return;
    }
    const pid = ctx.project.project_id;
    const vols = await get<Obj[]>(`${A}/projects/${pid}/volumes`);
    const name = h("input", { required: true, maxlength: 100, value: "data" });
    const size = h("input", { type: "number", min: 1, value: 100, required: true });
    const persist = h("input", { type: "checkbox", checked: true });
    const mode = h("select", null, h("option", { value: "single_writer" }, "single writer"), h("option", { value: "multi_attach" }, "multi attach"));
    const err = h("p", { class: "error", role: "alert", hidden: true });
    clear(
      volBox,
      h("h2", { id: "h-vols" }, `Volumes of ${ctx.project.name}`),
      table(
        ["Name", "Size", "Mode", "Status", "After release", "Attached to", ""],
        vols.map((v) => [
          v.name,
          `${v.size_gb} GB`,
          v.access_mode,
          badge(v.status),
          v.after_release,
          (v.attachments ?? []).map((a: Obj) => h("a", { href: `#/allocations/${a.allocation_id}` }, a.mount_path)),
          v.status !== "deleted" && !(v.attachments ?? []).length
            ? h("button", { type: "button", class: "secondary", onclick: async () => { await del(`${A}/volumes/${v.volume_id}`).catch((ex) => alertLater(err, ex)); await loadVolumes(); } }, "Delete")
            : "",
        ]),
      ),
      h(
        "form",
        {
          class: "card",
          onsubmit: async (e: Event) => {
            e.preventDefault();
            try {
              await post(`${A}/projects/${pid}/volumes`, { name: name.value, size_gb: Number(size.value), persist: persist.checked, access_mode: mode.value });
              await loadVolumes();
            } catch (ex) {
              err.textContent = describe(ex);
              err.hidden = false;
            }
          },
        },
        h("h3", null, "Create a volume"),
        field("Volume name", name),
        field("Size (GB)", size),
        field("Access mode", mode),
        h("label", { class: "inline" }, persist, " Keep the data after the allocation is released"),
        err,
        h("button", { type: "submit", class: "primary" }, "Create volume"),
      ),
    );
  };
  await Promise.all([loadKeys(), loadVolumes()]);
}

function alertLater(box: HTMLElement, ex: unknown): null {
  box.textContent = describe(ex);
  box.hidden = false;
  return null;
}
