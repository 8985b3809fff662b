// Charts (Chart.js, tree-shaken to the parts used here: bar and line charts on category and linear
// scales). Each chart is a <figure> holding the canvas (an image with a label for assistive technology)
// and the numbers it draws as a table (in a <details>), and the same numbers as JSON in `data-values`:
// what a reader, a screen reader and the browser tests read are the numbers behind the picture.
import {
  BarController,
  BarElement,
  CategoryScale,
  Chart,
  type ChartConfiguration,
  Filler,
  Legend,
  LinearScale,
  LineController,
  LineElement,
  PointElement,
  Tooltip,
} from "chart.js";
import { h } from "./dom";

Chart.register(BarController, BarElement, CategoryScale, LinearScale, LineController, LineElement, PointElement, Filler, Legend, Tooltip);
Chart.defaults.animation = false; // pictures of numbers, drawn at once (and screenshots show the final state)
Chart.defaults.font.family = "system-ui, sans-serif";

export const PALETTE = ["#2563eb", "#d97706", "#059669", "#7c3aed", "#dc2626", "#0891b2", "#4d7c0f", "#be185d"];

export interface Series {
  label: string;
  values: Array<number | null>;
  kind?: "bar" | "line";
  color?: string;
  dashed?: boolean;
  stack?: string;
  fill?: boolean;
}

export interface ChartSpec {
  id: string; // data-chart and the figure's id
  title: string;
  labels: string[];
  series: Series[];
  unit: string; // the y axis: "USD", "GPU-hours", "GPUs"
  stacked?: boolean;
  format?: (v: number) => string; // how the data table writes a value
}

/** A figure with the chart, its data table and `data-values` ({labels, series: {label: values}}). */
export function chart(spec: ChartSpec): { figure: HTMLElement; destroy: () => void } {
  const canvas = h("canvas", { role: "img", "aria-label": `${spec.title} (chart; the numbers are in the table below it)` });
  const fmt = spec.format ?? ((v: number) => String(v));
  const values = { labels: spec.labels, unit: spec.unit, series: Object.fromEntries(spec.series.map((s) => [s.label, s.values])) };
  const table = h(
    "table",
    { class: "chart-data" },
    h("caption", null, `${spec.title}: the numbers`),
    h("thead", null, h("tr", null, h("th", { scope: "col" }, ""), spec.series.map((s) => h("th", { scope: "col" }, s.label)))),
    h(
      "tbody",
      null,
      spec.labels.map((label, i) =>
        h("tr", null, h("th", { scope: "row" }, label), spec.series.map((s) => h("td", { "data-series": s.label }, s.values[i] == null ? "—" : fmt(s.values[i] as number)))),
      ),
    ),
  );
  const figure = h(
    "figure",
    { class: "chart", id: spec.id, "data-chart": spec.id, "data-values": JSON.stringify(values) },
    h("figcaption", null, spec.title),
    h("div", { class: "chart-box" }, canvas),
    h("details", null, h("summary", null, "Numbers"), h("div", { class: "table-wrap" }, table)),
  );
  const config: ChartConfiguration = {
    type: "bar",
    data: {
      labels: spec.labels,
      datasets: spec.series.map((s, i) => {
        const color = s.color ?? PALETTE[i % PALETTE.length];
        return {
          type: s.kind ?? "bar",
          label: s.label,
          data: s.values,
          backgroundColor: s.kind === "line" ? `${color}33` : color,
          borderColor: color,
          borderWidth: s.kind === "line" ? 2 : 0,
          borderDash: s.dashed ? [6, 4] : undefined,
          pointRadius: s.kind === "line" ? 2 : undefined,
          fill: s.fill ?? false,
          stack: s.stack,
          spanGaps: true,
          order: s.kind === "line" ? 0 : 1,
        };
      }) as ChartConfiguration["data"]["datasets"],
    },
    options: {
      responsive: true,
      maintainAspectRatio: false,
      interaction: { mode: "index", intersect: false },
      plugins: {
        legend: { position: "bottom" },
        tooltip: { callbacks: { label: (c) => `${c.dataset.label}: ${fmt(Number(c.parsed.y))}` } },
      },
      scales: {
        x: { stacked: spec.stacked ?? false, ticks: { autoSkip: true, maxRotation: 0 } },
        y: { stacked: spec.stacked ?? false, beginAtZero: true, title: { display: true, text: spec.unit } },
      },
    },
  };
  const instance = new Chart(canvas, config);
  return { figure, destroy: () => instance.destroy() };
}
