// diffusers' DDIMScheduler (eta = 0) for the live page, built from an exported scheduler_config.json: every
// value of the schedule comes from the config, none is typed in here. Float32 where diffusers keeps float32
// tensors (betas, their cumulative product). tests/test_live_page.py runs it in node against diffusers.

function betaSchedule(cfg) {
  const T = cfg.num_train_timesteps;
  if (cfg.trained_betas) return Float32Array.from(cfg.trained_betas);
  const betas = new Float32Array(T);
  if (cfg.beta_schedule === "linear" || cfg.beta_schedule === "scaled_linear") {
    const scaled = cfg.beta_schedule === "scaled_linear";
    const lo = scaled ? Math.sqrt(cfg.beta_start) : cfg.beta_start, hi = scaled ? Math.sqrt(cfg.beta_end) : cfg.beta_end;
    for (let i = 0; i < T; i++) {
      const b = T === 1 ? lo : lo + (hi - lo) * i / (T - 1);
      betas[i] = scaled ? Math.fround(b) ** 2 : b;
    }
  } else if (cfg.beta_schedule === "squaredcos_cap_v2") {  // diffusers' betas_for_alpha_bar, cosine, max_beta 0.999
    const alphaBar = (t) => Math.cos((t + 0.008) / 1.008 * Math.PI / 2) ** 2;
    for (let i = 0; i < T; i++) betas[i] = Math.min(1 - alphaBar((i + 1) / T) / alphaBar(i / T), 0.999);
  } else {
    throw new Error(`beta_schedule ${cfg.beta_schedule} is not supported by the page`);
  }
  return betas;
}

function cumprod(values) {  // float32 running product, as torch.cumprod on a float32 tensor
  const out = new Float32Array(values.length);
  let p = 1;
  for (let i = 0; i < values.length; i++) { p = Math.fround(p * values[i]); out[i] = p; }
  return out;
}

function rescaleZeroTerminalSnr(betas) {  // Lin et al. 2024, Algorithm 1, as diffusers' rescale_zero_terminal_snr
  const alphasCumprod = cumprod(betas.map((b) => 1 - b));
  const sqrtBar = alphasCumprod.map(Math.sqrt);
  const first = sqrtBar[0], last = sqrtBar[sqrtBar.length - 1];
  const bar = sqrtBar.map((s) => ((s - last) * (first / (first - last))) ** 2);
  const out = new Float32Array(betas.length);
  out[0] = 1 - bar[0];
  for (let i = 1; i < bar.length; i++) out[i] = 1 - bar[i] / bar[i - 1];
  return out;
}

export function makeScheduler(cfg) {
  if (cfg._class_name !== "DDIMScheduler") throw new Error(`the page samples with DDIM; the export says ${cfg._class_name}`);
  if (cfg.thresholding) throw new Error("dynamic thresholding is not supported by the page");
  let betas = betaSchedule(cfg);
  if (cfg.rescale_betas_zero_snr) betas = rescaleZeroTerminalSnr(betas);
  const alphasCumprod = cumprod(betas.map((b) => 1 - b));
  const finalAlphaCumprod = cfg.set_alpha_to_one ? 1 : alphasCumprod[0];
  const T = cfg.num_train_timesteps;

  function timesteps(steps) {  // DDIMScheduler.set_timesteps
    if (!(Number.isInteger(steps) && steps >= 1 && steps <= T)) throw new Error(`steps must be an integer from 1 to ${T}, got ${steps}`);
    const out = [];
    if (cfg.timestep_spacing === "linspace") {
      // np.linspace(0, T - 1, steps).round()[::-1]: i * step, the last exactly T - 1, rounded half to even
      const stepSize = steps === 1 ? 0 : (T - 1) / (steps - 1);
      for (let i = steps - 1; i >= 0; i--) out.push(i === steps - 1 && steps > 1 ? T - 1 : roundHalfEven(i * stepSize));
    } else if (cfg.timestep_spacing === "leading") {
      const ratio = Math.floor(T / steps);
      for (let i = steps - 1; i >= 0; i--) out.push(i * ratio + cfg.steps_offset);
    } else if (cfg.timestep_spacing === "trailing") {
      const ratio = T / steps;  // np.round(np.arange(T, 0, -ratio)) - 1; numpy rounds half to even
      for (let i = 0; i < steps; i++) out.push(roundHalfEven(T - i * ratio) - 1);
    } else {
      throw new Error(`timestep_spacing ${cfg.timestep_spacing} is not supported by the page`);
    }
    return out;
  }

  // One DDIM step: model output `pred` at timestep t for sample x (Float32Arrays) -> {prev, x0}.
  function step(pred, t, x, steps) {
    const prevT = t - Math.floor(T / steps);
    const a = alphasCumprod[t], aPrev = prevT >= 0 ? alphasCumprod[prevT] : finalAlphaCumprod, b = 1 - a;
    const sa = Math.sqrt(a), sb = Math.sqrt(b), saPrev = Math.sqrt(aPrev), dirScale = Math.sqrt(1 - aPrev);
    const clip = cfg.clip_sample ? cfg.clip_sample_range : Infinity;
    const prev = new Float32Array(x.length), x0 = new Float32Array(x.length);
    for (let i = 0; i < x.length; i++) {
      let orig, eps;
      if (cfg.prediction_type === "epsilon") { orig = (x[i] - sb * pred[i]) / sa; eps = pred[i]; }
      else if (cfg.prediction_type === "v_prediction") { orig = sa * x[i] - sb * pred[i]; eps = sa * pred[i] + sb * x[i]; }
      else if (cfg.prediction_type === "sample") { orig = pred[i]; eps = (x[i] - sa * orig) / sb; }
      else throw new Error(`prediction_type ${cfg.prediction_type} is not supported by the page`);
      orig = Math.min(clip, Math.max(-clip, orig));  // clip_sample; epsilon is not re-derived (diffusers' default)
      x0[i] = orig;
      prev[i] = saPrev * orig + dirScale * eps;
    }
    return { prev, x0 };
  }
  return { timesteps, step, initNoiseSigma: 1, numTrainTimesteps: T };
}

export function roundHalfEven(v) {
  const r = Math.round(v);
  return Math.abs(v % 1) === 0.5 && r % 2 !== 0 ? r - 1 : r;
}
