// Navigation between pages, in its own module so the pages and main.ts both import it and no page
// imports main.ts (which imports every page). main.ts registers its renderer once at start.

export type Cleanup = () => void;

let rerender: () => void = () => {};

/** main.ts: the function that draws the page of the current location. */
export function setRenderer(render: () => void): void {
  rerender = render;
}

/** Show `path`; draws it again when it is already the current location (the hash does not change). */
export function go(path: string): void {
  if (location.hash === `#${path}`) rerender();
  else location.hash = path;
}
