// The live page (docs/guides/live.md): tokenizer, text encoder, U-Net and DDIM run here, in the browser.
//
// model/ holds what unet/onnx_export.py exported: text_encoder.onnx, unet.onnx (its extra outputs attention_k are
// each cross-attention layer's softmax, (B, heads, h*w, T)), scheduler_config.json (the sampler's own values:
// nothing about the schedule is typed in here), tokenizer/ and live.json. The maps are made as Python makes
// maps.safetensors (crossattn/maps/plain.py): each word's share = its tokens' attention summed, mean over steps
// and heads, bilinear upsampling (torch's align_corners=False), mean over layers. The drawing, the upsampling and
// the ranking under the mouse are the run viewer's: crossattn/templates/viewer_core.js, inlined into index.html.
import * as ort from "./vendor/ort.wasm.min.mjs";
import { Tokenizer } from "./vendor/tokenizers.min.mjs";
import { makeScheduler, roundHalfEven } from "./ddim.js";
import { promptWarnings } from "./warnings.js";

const $ = (id) => document.getElementById(id);
const CORE = window.CrossattnViewerCore;  // shared with the run viewer
const FORMAT = 1;  // model/live.json's layout (unet/onnx_export.py FORMAT)

async function fetchJSON(path) {
  const response = await fetch(path);
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}

// ---------------------------------------------------------------- the page's noise (seeded; not torch's)

function gaussianNoise(seed, n) {  // mulberry32 + Box-Muller: any seed gives the same noise in every browser
  let s = seed >>> 0;
  const uniform = () => {
    s = (s + 0x6D2B79F5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return (((t ^ (t >>> 14)) >>> 0) + 0.5) / 4294967296;  // in (0, 1): the log below stays finite
  };
  const out = new Float32Array(n);
  for (let i = 0; i < n; i += 2) {
    const r = Math.sqrt(-2 * Math.log(uniform())), a = 2 * Math.PI * uniform();
    out[i] = r * Math.cos(a);
    if (i + 1 < n) out[i + 1] = r * Math.sin(a);
  }
  return out;
}

// ---------------------------------------------------------------- the model

const M = {};  // live.json, scheduler, tokenizer, sessions: filled by load()

async function load() {
  ort.env.wasm.wasmPaths = new URL("vendor/", location.href).href;
  // threads need a cross-origin-isolated page (SharedArrayBuffer), which a plain static server does not give
  ort.env.wasm.numThreads = self.crossOriginIsolated ? Math.min(4, navigator.hardwareConcurrency || 1) : 1;
  const [live, schedulerConfig, tokenizerJSON, tokenizerConfig] = await Promise.all([
    fetchJSON("model/live.json"), fetchJSON("model/scheduler_config.json"),
    fetchJSON("model/tokenizer/tokenizer.json"), fetchJSON("model/tokenizer/tokenizer_config.json")]);
  if (live.format !== FORMAT) throw new Error(`model/live.json has format ${live.format}; this page reads ${FORMAT}: rebuild`);
  const options = { executionProviders: ["wasm"], graphOptimizationLevel: "all" };
  const [text, unet] = await Promise.all([ort.InferenceSession.create("model/text_encoder.onnx", options),
                                          ort.InferenceSession.create("model/unet.onnx", options)]);
  Object.assign(M, { live, schedulerConfig, scheduler: makeScheduler(schedulerConfig),
                     tokenizer: new Tokenizer(tokenizerJSON, tokenizerConfig), text, unet });
}

// The browser compiles WebAssembly quickly first and optimises the functions that run often later: a first image
// takes twice as long as the next (its first ~15 U-Net calls ~100 ms, then ~35 ms, on the 2-core machine of
// docs/guides/live.md). Running the U-Net this often on blank input, in the queue after loading, moves that cost to
// where a person is still typing; a Generate meanwhile waits for it and is no slower than cold.
const WARM_UP_CALLS = 20;
async function warmUp() {
  const S = M.live.sample_size, T = M.live.max_length;
  const context = await encode([M.live.bos_token_id, M.live.eos_token_id]);
  const feeds = { sample: new ort.Tensor("float32", new Float32Array(M.live.channels * S * S), [1, M.live.channels, S, S]),
                  timestep: new ort.Tensor("float32", new Float32Array([0]), [1]),
                  encoder_hidden_states: new ort.Tensor("float32", context, [1, T, M.live.context_dim]) };
  for (let k = 0; k < WARM_UP_CALLS; k++) await M.unet.run(feeds);
}

// The prompt's whitespace words and the token positions each became (positions count the start token), as
// crossattn.text.prompt_words. CLIP's pre-tokenizer never joins across whitespace, so a word's tokens are the
// tokens of the word alone, and the prompt's are the words' in order.
function promptWords(prompt) {
  const texts = prompt.split(/\s+/).filter((w) => w.length > 0);
  const words = [], ids = [M.live.bos_token_id];
  for (const text of texts) {
    const own = M.tokenizer.encode(text, { add_special_tokens: false }).ids;
    words.push({ text, tokens: own.map((_, k) => ids.length + k) });
    ids.push(...own);
  }
  ids.push(M.live.eos_token_id);
  return { words, ids };
}

// Checks as the CLI's (unet/cli/checks.py): errors for what cannot be sampled, warnings for what can.
function checkPrompt(prompt) {
  if (typeof prompt !== "string" || !prompt.trim()) throw new Error('empty prompt: give some words, e.g. "a red circle"');
  const { words, ids } = promptWords(prompt);
  if (ids.length > M.live.max_length) {
    let used = 1;
    const cut = words.filter((w) => (used += w.tokens.length) > M.live.max_length - 1).map((w) => w.text);
    throw new Error(`prompt is longer than the tokenizer's ${M.live.max_length} tokens; these words would be dropped: ` +
                    `${cut.join(" ")} (shorten it)`);
  }
  const warnings = promptWarnings(prompt, words.map((w) => w.text), M.live);
  return { words, ids, warnings };
}

async function encode(ids) {  // ids padded to max_length with the pad token -> (1, T, D) Float32Array
  const T = M.live.max_length, padded = new BigInt64Array(T).fill(BigInt(M.live.pad_token_id));
  ids.forEach((id, k) => { padded[k] = BigInt(id); });
  const out = await M.text.run({ input_ids: new ort.Tensor("int64", padded, [1, T]) });
  return out.last_hidden_state.data;
}

function stdev(values, start, n) {  // torch's .std(): unbiased
  let mean = 0;
  for (let i = 0; i < n; i++) mean += values[start + i];
  mean /= n;
  let s = 0;
  for (let i = 0; i < n; i++) s += (values[start + i] - mean) ** 2;
  return Math.sqrt(s / (n - 1));
}

// Each layer's word shares at this step, for the prompt-conditioned batch entry (the last one): per layer a
// Float32Array (heads, words, h*w), a word's tokens summed (crossattn.viewer.word_shares).
function wordShares(outputs, words, batch) {
  const T = M.live.max_length;
  return M.live.layers.map((layer) => {
    const probs = outputs[layer.output].data, n = layer.h * layer.w, perImage = layer.heads * n * T;
    const out = new Float32Array(layer.heads * words.length * n);
    for (let h = 0; h < layer.heads; h++) {
      for (let q = 0; q < n; q++) {
        const row = (batch - 1) * perImage + (h * n + q) * T;
        words.forEach((w, k) => {
          let s = 0;
          for (const t of w.tokens) s += probs[row + t];
          out[(h * words.length + k) * n + q] = s;
        });
      }
    }
    return out;
  });
}

// One sampling at a time: the model's runtime runs one call of a model at a time, and a second Generate (a click
// while a script's generate() runs) waits for the first instead of failing.
let queue = Promise.resolve();
function sample(options) {
  const run = queue.then(() => sampleNow(options));
  queue = run.catch(() => {});
  return run;
}

// Sample one image. Returns what the API returns and what the page shows: per step the x0 estimate and word shares.
async function sampleNow({ prompt, seed = 0, steps = 25, guidance = null, noise = null, onStep = null }) {
  const { words, ids, warnings } = checkPrompt(prompt);
  const S = M.live.sample_size, C = M.live.channels, size = C * S * S;
  if (guidance === null || guidance === undefined) guidance = M.live.guidance_scale;
  if (!Number.isFinite(guidance)) throw new Error(`guidance must be a finite number (<= 1 turns guidance off), got ${guidance}`);
  if (noise !== null && noise !== undefined) {
    noise = Float32Array.from(noise);
    if (noise.length !== size) throw new Error(`noise must hold ${C}×${S}×${S} = ${size} numbers, got ${noise.length}`);
  } else {
    if (!(Number.isInteger(seed) && seed >= 0 && seed < 2 ** 32)) throw new Error(`seed must be an integer from 0 to 2**32 - 1, got ${seed}`);
    noise = gaussianNoise(seed, size);
  }
  const timesteps = M.scheduler.timesteps(steps);
  const t0 = performance.now();
  const guided = guidance > 1, D = M.live.context_dim, T = M.live.max_length;
  const cond = await encode(ids);
  let both = null;  // (2, T, D): [uncond, cond], as ScenePipeline.__call__
  if (guided) {
    both = new Float32Array(2 * T * D);
    both.set(await encode([M.live.bos_token_id, M.live.eos_token_id]), 0);  // the empty prompt
    both.set(cond, T * D);
  }
  let x = noise.map((v) => v * M.scheduler.initNoiseSigma);
  const x0s = [], shares = [];
  for (const t of timesteps) {
    const guideNow = guided && M.live.guidance_min_t <= t && (M.live.guidance_max_t === null || t <= M.live.guidance_max_t);
    const batch = guideNow ? 2 : 1;
    const input = new Float32Array(batch * size);
    for (let b = 0; b < batch; b++) input.set(x, b * size);
    const outputs = await M.unet.run({
      sample: new ort.Tensor("float32", input, [batch, C, S, S]),
      timestep: new ort.Tensor("float32", new Float32Array(batch).fill(t), [batch]),
      encoder_hidden_states: new ort.Tensor("float32", guideNow ? both : cond, [batch, T, D]),
    });
    let pred = outputs.prediction.data;
    if (guideNow) {  // uncond + scale * (cond - uncond), then the optional rescale (Lin et al. 2024, 3.4)
      const guidedPred = new Float32Array(size);
      for (let i = 0; i < size; i++) guidedPred[i] = pred[i] + guidance * (pred[size + i] - pred[i]);
      const r = M.live.guidance_rescale;
      if (r > 0) {
        const factor = stdev(pred, size, size) / stdev(guidedPred, 0, size);
        for (let i = 0; i < size; i++) guidedPred[i] = r * guidedPred[i] * factor + (1 - r) * guidedPred[i];
      }
      pred = guidedPred;
    } else {
      pred = pred.subarray(0, size);
    }
    shares.push(wordShares(outputs, words, batch));
    const { prev, x0 } = M.scheduler.step(pred, t, x, steps);
    x0s.push(x0);
    x = prev;
    if (onStep) await onStep(x0s.length, timesteps.length, x0);
  }
  const ms = performance.now() - t0;
  return { words, ids, warnings, timesteps, x0s, shares, final: x, ms, prompt, seed, steps, guidance };
}

// ---------------------------------------------------------------- maps (as crossattn/maps/plain.py)

// Word maps at image size: one Float64Array (H*W) per word, raw shares, averaged over the chosen steps
// (indices), layers (indices) and heads ("all" or one index, clamped to the layer's heads).
function wordMaps(run, { stepIndices, layerIndices, head = "all" }) {
  const S = M.live.sample_size, NW = run.words.length;
  const out = run.words.map(() => new Float64Array(S * S));
  for (const l of layerIndices) {
    const layer = M.live.layers[l], n = layer.h * layer.w;
    const heads = head === "all" ? [...Array(layer.heads).keys()] : [Math.min(+head, layer.heads - 1)];
    const acc = new Float64Array(NW * n);
    for (const s of stepIndices) {
      const block = run.shares[s][l];
      for (const h of heads) for (let i = 0; i < NW * n; i++) acc[i] += block[h * NW * n + i];
    }
    const scale = 1 / (stepIndices.length * heads.length);
    for (let i = 0; i < acc.length; i++) acc[i] *= scale;
    for (let k = 0; k < NW; k++) CORE.upsampleAdd(acc, layer.h, layer.w, k * n, out[k], S, S);
  }
  for (const o of out) for (let i = 0; i < o.length; i++) o[i] = Math.max(0, o[i]) / layerIndices.length;
  return out;
}

function toRGBA(x) {  // (C, H, W) in [-1, 1] -> RGBA bytes (H, W, 4), as (x / 2 + 0.5).clamp(0, 1) then to_uint8
  const S = M.live.sample_size, n = S * S, C = M.live.channels, out = new Uint8ClampedArray(4 * n);
  for (let i = 0; i < n; i++) {
    for (let c = 0; c < 3; c++) {
      const v = Math.min(1, Math.max(0, x[(C === 1 ? 0 : c) * n + i] / 2 + 0.5));
      out[4 * i + c] = roundHalfEven(v * 255);
    }
    out[4 * i + 3] = 255;
  }
  return out;
}

// ---------------------------------------------------------------- the API

async function generate(options = {}) {
  await ready;
  const run = await sample(options);
  const all = [...run.x0s.keys()], layers = [...M.live.layers.keys()];
  return {
    image: toRGBA(run.final),
    words: run.words.map((w) => w.text),
    maps: wordMaps(run, { stepIndices: all, layerIndices: layers }).map((m) => Float32Array.from(m)),
    warnings: run.warnings, tokens: run.words.map((w) => w.tokens), ids: run.ids, timesteps: run.timesteps,
    ms: run.ms, run,
  };
}

// ---------------------------------------------------------------- the page (the run viewer's drawing)

const state = { run: null, step: 0, when: "all", layer: "all", head: "all", norm: "raw", scale: "word",
                opacity: 0.7, word: 0, pixel: null };
let maps = null;

function computeMaps() {
  const run = state.run;
  const stepIndices = state.when === "all" ? [...run.x0s.keys()] : [state.step];
  const layerIndices = state.layer === "all" ? [...M.live.layers.keys()] : [+state.layer];
  return CORE.normalise(wordMaps(run, { stepIndices, layerIndices, head: state.head }), state.norm,
                        M.live.sample_size ** 2);
}

function drawPixels(canvas, rgba) {
  const S = M.live.sample_size;
  canvas.width = S; canvas.height = S;
  const ctx = canvas.getContext("2d"), img = ctx.createImageData(S, S);
  img.data.set(rgba);
  ctx.putImageData(img, 0, 0);
}

function drawImage() {
  drawPixels($("image"), toRGBA(state.run.x0s[state.step]));
  const t = state.run.timesteps[state.step];
  $("step-label").textContent = `step ${state.step + 1} of ${state.run.timesteps.length} (t = ${t}): ` +
    (state.step === state.run.timesteps.length - 1 ? "the image" : "the model's guess of the clean image (x0)");
}

function drawMap() {
  const S = M.live.sample_size, map = maps[state.word];
  const top = state.norm === "minmax" ? 1 :
    (state.scale === "all" ? Math.max(...maps.map(CORE.peak)) : CORE.peak(map)) || 1;
  CORE.drawMap($("map"), map, S, S, top, state.opacity);
  CORE.drawColourbar($("colorbar"), $("ticks"), top);
}

function showPixel() {
  const S = M.live.sample_size;
  if (!state.pixel) { $("ranking").innerHTML = ""; $("rest").textContent = ""; return; }
  const [x, y] = state.pixel, i = y * S + x;
  $("pixel").textContent = `(x ${x}, y ${y})`;
  const marker = $("marker"), s = $("stage").clientWidth / S;
  Object.assign(marker.style, { display: "block", left: `${x * s - 1}px`, top: `${y * s - 1}px`, width: `${s}px`, height: `${s}px` });
  CORE.ranking($("ranking"), $("rest"), state.run.words.map((w) => w.text), maps.map((m) => m[i]), state.word,
               state.norm, (k) => { state.word = k; update(false); });
}

function update(recompute = true) {
  if (!state.run) return;
  if (recompute) maps = computeMaps();
  document.querySelectorAll("#words button").forEach((b, k) => b.classList.toggle("selected", k === state.word));
  drawImage();
  drawMap();
  showPixel();
  const what = { raw: "each pixel's share of attention that went to the word",
                 minmax: "each map rescaled to [0, 1] on its own (for looking, not for comparing words)",
                 softmax: "at each pixel, the words' shares renormalised to sum to 1 over the prompt's words" };
  $("explain").textContent = `Map: ${what[state.norm]}; ${state.layer === "all" ? "mean of all layers" :
    "one layer"}, ${state.head === "all" ? "all heads" : "head " + state.head}, ${state.when === "all" ?
    "mean of all steps" : `step ${state.step + 1}`}, upsampled bilinearly to ${M.live.sample_size}².`;
}

function option(select, value, text) {
  const o = document.createElement("option");
  o.value = value; o.textContent = text; select.appendChild(o);
}

function fillHeads() {
  const layers = state.layer === "all" ? M.live.layers : [M.live.layers[+state.layer]];
  const n = Math.min(...layers.map((l) => l.heads)), sel = $("head-select");
  sel.innerHTML = "";
  option(sel, "all", "mean of heads");
  for (let h = 0; h < n; h++) option(sel, h, `head ${h}`);
  if (state.head !== "all" && +state.head >= n) state.head = "all";
  sel.value = state.head;
}

function show(run) {
  state.run = run; state.step = run.x0s.length - 1;
  state.word = Math.max(0, run.words.findIndex((w) => !["a", "an", "the"].includes(w.text.toLowerCase())));
  $("words").innerHTML = "";
  run.words.forEach((w, k) => {
    const b = document.createElement("button");
    b.textContent = w.text; b.dataset.index = k;
    b.onclick = () => { state.word = k; update(false); };
    $("words").appendChild(b);
  });
  Object.assign($("step"), { max: run.x0s.length - 1, value: state.step });
  $("settings").innerHTML = "";
  const rows = [["prompt", run.prompt], ["seed", run.seed], ["steps", run.steps], ["guidance", run.guidance],
    ["model", M.live.model], ["words (token positions)", run.words.map((w) => `${w.text} [${w.tokens.join(", ")}]`).join(" · ")],
    ["layers", M.live.layers.map((l) => `${l.name}: ${l.h}×${l.w}, ${l.heads} heads`).join("; ")],
    ["sampling (ms)", run.ms.toFixed(0)]];
  for (const [k, v] of rows) {
    const tr = document.createElement("tr");
    tr.innerHTML = "<td></td><td></td>";
    tr.children[0].textContent = k; tr.children[1].textContent = v;
    $("settings").appendChild(tr);
  }
  update();
}

function showMessage(id, text) { $(id).textContent = text; $(id).style.display = text ? "block" : "none"; }

async function onGenerate(event) {
  event.preventDefault();
  showMessage("error", "");
  $("generate").disabled = true;
  try {
    const seed = Number($("seed").value), steps = Number($("steps").value), guidance = Number($("guidance").value);
    const run = await sample({ prompt: $("prompt").value, seed, steps, guidance, onStep: async (k, n, x0) => {
      $("status").textContent = `step ${k} of ${n}…`;
      drawPixels($("image"), toRGBA(x0));  // the image forming: this step's guess of the clean image
      await new Promise((r) => setTimeout(r, 0));  // let the page paint it
    } });
    showMessage("warning", run.warnings.map((w) => `warning: ${w}`).join("\n"));
    $("status").textContent = `${run.steps} steps in ${(run.ms / 1000).toFixed(2)} s`;
    show(run);
  } catch (e) {
    showMessage("error", `error: ${e.message}`);
    $("status").textContent = "";
  } finally {
    $("generate").disabled = false;
  }
}

function setupPage() {
  const S = M.live.sample_size, scale = Math.max(1, Math.floor(512 / S));
  Object.assign($("stage").style, { width: `${S * scale}px`, height: `${S * scale}px` });
  $("guidance").value = M.live.guidance_scale;
  $("summary").textContent = `model ${M.live.model} · ${S}×${S} · ${M.live.layers.length} cross-attention layers · ` +
    `DDIM (${M.schedulerConfig.prediction_type}, ${M.schedulerConfig.timestep_spacing} spacing) · runs in this tab ` +
    `with ONNX Runtime Web (${ort.env.wasm.numThreads} thread${ort.env.wasm.numThreads === 1 ? "" : "s"})`;
  option($("layer-select"), "all", "all layers (mean)");
  M.live.layers.forEach((l, k) => option($("layer-select"), k, `${l.name} (${l.h}×${l.w}, ${l.heads} heads)`));
  fillHeads();
  $("form").onsubmit = onGenerate;
  $("step").oninput = (e) => { state.step = +e.target.value; update(state.when === "step"); };
  $("when-select").onchange = (e) => { state.when = e.target.value; update(); };
  $("layer-select").onchange = (e) => { state.layer = e.target.value; fillHeads(); update(); };
  $("head-select").onchange = (e) => { state.head = e.target.value; update(); };
  $("norm-select").onchange = (e) => { state.norm = e.target.value; update(); };
  $("scale-select").onchange = (e) => { state.scale = e.target.value; update(false); };
  $("opacity").oninput = (e) => { state.opacity = e.target.value / 100; $("map").style.opacity = state.opacity; };
  $("stage").onmousemove = (e) => {
    if (!state.run) return;
    const r = $("stage").getBoundingClientRect();
    const x = Math.min(S - 1, Math.floor((e.clientX - r.left) / r.width * S));
    const y = Math.min(S - 1, Math.floor((e.clientY - r.top) / r.height * S));
    if (!state.pixel || state.pixel[0] !== x || state.pixel[1] !== y) { state.pixel = [x, y]; showPixel(); }
  };
  $("generate").disabled = false;
}

const timings = {};  // ms since navigation: when the model was loaded and when the runtime was warm
const ready = load().then(setupPage).then(() => { timings.ready_ms = performance.now(); });
ready.catch((e) => { showMessage("error", `error: could not load the model: ${e.message}`); });
const warm = ready.then(() => {
  const done = queue.then(warmUp).then(() => { timings.warm_ms = performance.now(); });
  queue = done.catch(() => {});
  return done;
});

// For tests, scripts and the console: generate() resolves to {image, words, maps, ...} (docs/guides/live.md);
// `ready` resolves once the model is loaded, `warm` once the runtime is warmed up (generate() waits for it);
// `state` and `maps()` are what the page shows.
window.crossattn = { generate, ready, warm, timings, state, maps: () => maps, show: (result) => show(result.run) };
