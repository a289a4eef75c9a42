// What the run viewer (run.html, crossattn/viewer.py) and the live page (web/, unet/live.py) share: the colour map,
// torch's bilinear upsampling, the normalisations, drawing a word's map and its colour bar, and the ranking of words
// at a pixel. One viewer, two data sources. Inlined into both pages as a classic script (a run page must work from
// file://, where a page cannot import a script module), so it defines one global.
"use strict";
window.CrossattnViewerCore = (() => {
  // Colour map: viridis, 9 anchors, interpolated linearly.
  const VIRIDIS = [[68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
                   [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37]];
  function colour(t) {
    t = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i;
    return VIRIDIS[i].map((c, k) => Math.round(c + f * (VIRIDIS[i + 1][k] - c)));
  }
  const LUT = Array.from({ length: 256 }, (_, i) => colour(i / 255));  // drawing looks colours up here

  // Source indices and weights of bilinear upsampling n -> N with torch's align_corners=False rule.
  function taps(n, N) {
    const i0 = new Int32Array(N), i1 = new Int32Array(N), f = new Float64Array(N);
    for (let k = 0; k < N; k++) {
      const s = Math.max(0, (k + 0.5) * n / N - 0.5);
      i0[k] = Math.floor(s); i1[k] = Math.min(i0[k] + 1, n - 1); f[k] = s - i0[k];
    }
    return [i0, i1, f];
  }

  // Upsample the (h, w) map at src[offset..] to (H, W) bilinearly and add it into `out`.
  function upsampleAdd(src, h, w, offset, out, H, W) {
    const [y0, y1, fy] = taps(h, H), [x0, x1, fx] = taps(w, W);
    for (let y = 0; y < H; y++) {
      const r0 = offset + y0[y] * w, r1 = offset + y1[y] * w, b = fy[y], a = 1 - b;
      for (let x = 0; x < W; x++) {
        const c = fx[x], l = x0[x], r = x1[x];
        out[y * W + x] += a * (src[r0 + l] + c * (src[r0 + r] - src[r0 + l])) +
                          b * (src[r1 + l] + c * (src[r1 + r] - src[r1 + l]));
      }
    }
  }

  // `out`: one array of `pixels` values per word, normalised in place as crossattn.maps.normalize_maps.
  function normalise(out, norm, pixels) {
    if (norm === "minmax") {
      for (const o of out) {
        let lo = Infinity, hi = -Infinity;
        for (const v of o) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
        for (let i = 0; i < o.length; i++) o[i] = (o[i] - lo) / Math.max(hi - lo, 1e-12);
      }
    } else if (norm === "softmax") {
      for (let i = 0; i < pixels; i++) {
        let s = 0;
        for (const o of out) s += o[i];
        for (const o of out) o[i] /= Math.max(s, 1e-12);
      }
    }
    return out;
  }

  function peak(arr) { let m = 0; for (const v of arr) m = Math.max(m, v); return m; }

  function fmt(v) { return v === 0 ? "0" : v >= 0.01 ? v.toFixed(3) : v.toExponential(1); }

  // Draw one word's map (W*H values) on `canvas`, 0..vmax over the colour map.
  function drawMap(canvas, map, W, H, vmax, opacity) {
    canvas.width = W; canvas.height = H;
    canvas.style.opacity = opacity;
    const ctx = canvas.getContext("2d"), img = ctx.createImageData(W, H);
    for (let i = 0; i < H * W; i++) {
      const [r, g, b] = LUT[Math.max(0, Math.min(255, Math.round(255 * map[i] / vmax)))];
      img.data[4 * i] = r; img.data[4 * i + 1] = g; img.data[4 * i + 2] = b; img.data[4 * i + 3] = 255;
    }
    ctx.putImageData(img, 0, 0);
  }

  function drawColourbar(bar, ticks, vmax) {
    const ctx = bar.getContext("2d"), img = ctx.createImageData(256, 1);
    for (let i = 0; i < 256; i++) img.data.set([...LUT[i], 255], 4 * i);
    ctx.putImageData(img, 0, 0);
    ticks.innerHTML = "";
    for (let k = 0; k <= 4; k++) {
      const span = document.createElement("span");
      span.style.left = `${k * 25}%`;
      span.textContent = fmt(vmax * k / 4);
      ticks.appendChild(span);
    }
  }

  // The words ranked by their value at one pixel (`values[k]` for word k) into the <ol> `list`, and what the
  // start, end and padding tokens hold into `rest` (raw shares only). Clicking a word calls pick(k).
  function ranking(list, rest, words, values, selected, norm, pick) {
    list.innerHTML = "";
    const ranked = words.map((w, k) => ({ k, w, v: values[k] })).sort((a, b) => b.v - a.v || a.k - b.k);
    const top = Math.max(ranked[0].v, 1e-12);
    for (const r of ranked) {
      const li = document.createElement("li");
      li.dataset.word = r.w; li.dataset.index = r.k; li.dataset.value = r.v;
      if (r.k === selected) li.className = "selected";
      li.innerHTML = `<span class="word"></span><span><div class="bar" style="width:${100 * r.v / top}%"></div></span>` +
                     `<span class="value">${fmt(r.v)}</span>`;
      li.querySelector(".word").textContent = `${r.k}: ${r.w}`;
      li.onclick = () => pick(r.k);
      list.appendChild(li);
    }
    const total = ranked.reduce((s, r) => s + r.v, 0);
    rest.textContent = norm === "raw"
      ? `The prompt's words hold ${(100 * total).toFixed(1)} % of this pixel's attention; the start, end and ` +
        `padding tokens the other ${(100 * (1 - total)).toFixed(1)} %.` : "";
  }

  return { LUT, taps, upsampleAdd, normalise, peak, fmt, drawMap, drawColourbar, ranking };
})();
