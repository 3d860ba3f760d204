// Builds the browser tab (issue 36) into static/build/: the page's and the worker's bundles, and the
// onnxruntime-web files the worker loads at run time from static/build/ort/ (served by the site, no CDN).
//
// Only the wasm build is copied for the default path (`ort.wasm.min.mjs` and its runtime, 14 MB raw and
// about 2.4 MB brotli), never the default bundle that pulls 28 MB; the WebGPU build comes next to it and
// is fetched only by a tab that computes on WebGPU.

import { copyFileSync, mkdirSync, statSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { build } from "esbuild";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const out = join(root, "static", "build");
const ortDist = join(root, "node_modules", "onnxruntime-web", "dist");

export const ORT_FILES = {
  wasm: ["ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm"],
  webgpu: ["ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm"],
};

await build({
  entryPoints: { "tab-page": join(root, "src/tab/page.js"), "tab-worker": join(root, "src/tab/worker.js") },
  bundle: true,
  minify: true,
  format: "esm", // the worker is a module worker: it imports onnxruntime-web's module from ort/ at run time
  target: "es2022",
  outdir: out,
  logLevel: "warning",
});

mkdirSync(join(out, "ort"), { recursive: true });
for (const name of [...ORT_FILES.wasm, ...ORT_FILES.webgpu]) copyFileSync(join(ortDist, name), join(out, "ort", name));

const size = (path) => statSync(join(out, path)).size;
const firstVisit = ["tab-page.js", "tab-worker.js", ...ORT_FILES.wasm.map((n) => `ort/${n}`)].reduce((sum, p) => sum + size(p), 0);
console.log(`tab: a first visit downloads ${(firstVisit / 1e6).toFixed(2)} MB uncompressed (page, worker, onnxruntime-web wasm)`);
