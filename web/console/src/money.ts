// Money is always shown with its currency: at least two decimals, and the ledger's further digits only
// where they are not zero ("5.00 USD", "0.000702 USD"). Never a bare "0.00".
export function money(amount: string | number | null | undefined, currency: string): string {
  const text = String(amount ?? "0");
  const n = Number(text);
  if (!Number.isFinite(n)) return `${text} ${currency}`;
  // Decimal strings from the API keep their digits; numbers computed here are rounded to micro-units.
  const fixed = typeof amount === "number" ? n.toFixed(6) : text.includes("e") || text.includes("E") ? n.toFixed(6) : text;
  const [whole, frac = ""] = (fixed.startsWith("-") ? fixed.slice(1) : fixed).split(".");
  const trimmed = frac.replace(/0+$/, "");
  const sign = fixed.startsWith("-") && n !== 0 ? "-" : "";
  return `${sign}${whole.replace(/^0+(?=\d)/, "") || "0"}.${trimmed.padEnd(2, "0")} ${currency}`;
}

/** Totals per currency, e.g. "5.00 USD + 3.10 EUR"; `none` when there is nothing. */
// eslint-disable-next-line @typescript-eslint/no-explicit-any
export function totals(rows: ReadonlyArray<Record<string, any>>, none: string): string {
  const by = new Map<string, number>();
  for (const r of rows) by.set(String(r.currency), (by.get(String(r.currency)) ?? 0) + Number(r.amount));
  return by.size ? [...by].map(([c, v]) => money(v, c)).join(" + ") : none;
}
