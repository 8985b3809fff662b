import { defineConfig } from "vite";

// The gateway serves dist/ at "/" (index.html) and "/assets/*" (hashed, cached for good).
// `npm run dev` proxies the API to a running stack (make run) on :8000.
export default defineConfig({
  base: "/",
  build: { outDir: "dist", assetsDir: "assets", sourcemap: false, target: "es2022" },
  server: {
    proxy: {
      "/api": { target: "http://127.0.0.1:8000", ws: true, changeOrigin: false },
    },
  },
});
