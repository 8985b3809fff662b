// The npm registry reachable here serves only some of rollup's per-platform optional packages, so
// `npm install` leaves the others out of package-lock.json and `npm ci` then refuses the lock as out of
// sync. This adds the missing ones as optional, platform-restricted entries (exactly what a lock written
// elsewhere holds, less the integrity): `npm ci` skips them on this platform. Run after `npm install`.
import { readFileSync, writeFileSync } from "node:fs";

const lock = JSON.parse(readFileSync("package-lock.json", "utf8"));
const pkgs = lock.packages;
const rollup = pkgs["node_modules/rollup"];
const platform = (name) => {
  const part = name.replace("@rollup/rollup-", "");
  const [os] = part.split("-");
  const cpuPart = part.split("-")[1];
  const cpu = { "arm": "arm", "arm64": "arm64", "x64": "x64", "ia32": "ia32", "loong64": "loong64", "ppc64": "ppc64", "riscv64": "riscv64", "s390x": "s390x" }[cpuPart] ?? cpuPart;
  const libc = part.includes("musl") ? ["musl"] : part.startsWith("linux") ? ["glibc"] : undefined;
  return { os: [os === "win32" ? "win32" : os], cpu: [cpu], libc };
};
let added = 0;
for (const [name, version] of Object.entries(rollup.optionalDependencies ?? {})) {
  const key = `node_modules/${name}`;
  if (pkgs[key]) continue;
  const { os, cpu, libc } = platform(name);
  pkgs[key] = { version, cpu, dev: true, license: "MIT", optional: true, os, ...(libc ? { libc } : {}) };
  added += 1;
}
lock.packages = Object.fromEntries(Object.entries(pkgs).sort(([a], [b]) => (a === "" ? -1 : b === "" ? 1 : a.localeCompare(b))));
writeFileSync("package-lock.json", JSON.stringify(lock, null, 2) + "\n");
console.log(`added ${added} optional platform entries`);
