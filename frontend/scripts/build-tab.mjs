// Builds the browser tab (issue 36) into static/build/: the page's and the worker's bundles, and the
// onnxruntime-web files the worker loads at run time from static/build/ort/ (served by the site, no CDN).
//
// Only the wasm build is copied for the default path (`ort.wasm.min.mjs` and its runtime, 14 MB raw and
// about 2.4 MB brotli), never the default bundle that pulls 28 MB; the WebGPU build comes next to it and
// is fetched only by a tab that computes on WebGPU.

import { copyFileSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { brotliCompressSync, constants, gzipSync } from "node:zlib";
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

// Compressed copies next to each file: whitenoise sends the .br (or .gz) one to a browser that accepts it,
// so a first visit downloads about a fifth of the raw bytes. Brotli at quality 9: 2.7 MB where 11 gives
// 2.4 MB, in 2 s rather than 30 on every build.
const BROTLI = { params: { [constants.BROTLI_PARAM_QUALITY]: 9 } };
const served = ["tab-page.js", "tab-worker.js", ...[...ORT_FILES.wasm, ...ORT_FILES.webgpu].map((n) => `ort/${n}`)];
const sizes = {};
for (const path of served) {
  const bytes = readFileSync(join(out, path));
  const br = brotliCompressSync(bytes, BROTLI);
  writeFileSync(join(out, `${path}.br`), br);
  writeFileSync(join(out, `${path}.gz`), gzipSync(bytes, { level: 9 }));
  sizes[path] = [bytes.length, br.length];
}

// What a first visit downloads: the page's script, the worker, onnxruntime-web's wasm build.
const firstVisit = ["tab-page.js", "tab-worker.js", ...ORT_FILES.wasm.map((n) => `ort/${n}`)].map((p) => sizes[p]);
const total = (i) => (firstVisit.reduce((sum, s) => sum + s[i], 0) / 1e6).toFixed(2);
console.log(`tab: a first visit downloads ${total(1)} MB brotli (${total(0)} MB raw): page, worker, onnxruntime-web wasm`);
