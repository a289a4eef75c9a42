"""Speed and memory, measured side by side in one run: ratios, not absolute claims.

Each comparison alternates the two contenders inside every repeat (after warm-up), so a noisy
machine slows both alike; we report medians and the spread (min-max) of the ratio.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from torch.utils.flop_counter import FlopCounterMode

from crossattn import CrossAttention
from crossattn.capture import AttentionStore


@dataclass
class Timing:
    median_ratio: float
    min_ratio: float
    max_ratio: float
    ours_ms: float
    theirs_ms: float

    def row(self) -> dict:
        return {k: round(v, 4) for k, v in vars(self).items()}


def timed_pair(ours, theirs, repeats: int, warmup: int = 2) -> Timing:
    """Median of per-repeat time ratios ours/theirs, alternating which runs first."""
    for _ in range(warmup):
        ours(), theirs()
    ratios, t_ours, t_theirs = [], [], []
    for i in range(repeats):
        order = (ours, theirs) if i % 2 == 0 else (theirs, ours)
        times = {}
        for fn in order:
            start = time.perf_counter()
            fn()
            times[fn] = time.perf_counter() - start
        t_ours.append(times[ours])
        t_theirs.append(times[theirs])
        ratios.append(times[ours] / times[theirs])
    return Timing(statistics.median(ratios), min(ratios), max(ratios), 1e3 * statistics.median(t_ours),
                  1e3 * statistics.median(t_theirs))


BLOCK_SIZES = {
    # name: (batch, queries h, w, query dim, heads, tokens, context dim)
    "ours_default": (8, 16, 16, 128, 4, 32, 64),
    "sd_largest": (1, 64, 64, 320, 8, 77, 768),
}


def block_benchmark(name: str, repeats: int, backward: bool = False) -> dict:
    B, h, w, dim, heads, T, ctx_dim = BLOCK_SIZES[name]
    torch.manual_seed(0)
    ours = CrossAttention(dim, ctx_dim, heads=heads, head_dim=dim // heads)
    theirs = Attention(query_dim=dim, cross_attention_dim=ctx_dim, heads=heads, dim_head=dim // heads)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(B, h * w, dim, requires_grad=backward)
    ctx = torch.randn(B, T, ctx_dim)

    def run(fn):
        def call():
            with torch.set_grad_enabled(backward):
                out = fn()
                out = out[0] if isinstance(out, tuple) else out
                if backward:
                    out.sum().backward()
        return call

    result = {}
    theirs.set_processor(AttnProcessor2_0())
    result["fused"] = timed_pair(run(lambda: ours(x, ctx)), run(lambda: theirs(x, encoder_hidden_states=ctx)),
                                   repeats).row()
    theirs.set_processor(AttnProcessor())  # diffusers' explicit path, which materialises the weights too
    result["weights"] = timed_pair(run(lambda: ours(x, ctx, need_weights=True)),
                                     run(lambda: theirs(x, encoder_hidden_states=ctx)), repeats).row()
    return result


# Sampling is timed guided (two model passes per step), the setting the speed targets are stated in
# (docs/guides/benchmarks.md).
BENCHMARK_GUIDANCE = 4.0


def sample(pipe, prompts, steps, seed=0):
    return pipe(prompts, num_inference_steps=steps, guidance_scale=BENCHMARK_GUIDANCE,
                generator=torch.Generator().manual_seed(seed), output_type="pt", show_progress=False).images


def capture_overhead(pipe, prompts, steps, repeats) -> dict:
    store = AttentionStore.for_pipeline(pipe)

    def with_store():
        store.reset()
        with store.attach(pipe.unet):
            sample(pipe, prompts, steps)

    return timed_pair(with_store, lambda: sample(pipe, prompts, steps), repeats).row()


def capture_bytes(pipe, step_counts) -> dict:
    """Store size after n steps, next to what keeping every step's weights would take."""
    out = {}
    for steps in step_counts:
        store = AttentionStore.for_pipeline(pipe)
        with store.attach(pipe.unet):
            sample(pipe, ["a red circle left of a blue square"], steps)
        per_step = store.nbytes() / len(store.recorded_windows())  # one window holds one step's size
        out[str(steps)] = {"store_bytes": store.nbytes(), "every_step_bytes": int(per_step * steps)}
    return out


def unet_flops(pipe) -> float:
    """FLOPs of one U-Net forward for one image (no guidance duplication)."""
    size = pipe.unet.config.sample_size
    x = torch.randn(1, pipe.unet.config.in_channels, size, size, device=pipe.device)
    ctx = pipe.encode_prompt(["a red circle"])
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        pipe.unet(x, torch.tensor([500]), encoder_hidden_states=ctx)
    return float(counter.get_total_flops())


def matmul_peak(n: int = 1024, repeats: int = 10) -> float:
    """This machine's fp32 matmul GFLOP/s (best of repeats)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = max(best, 2 * n ** 3 / (time.perf_counter() - start) / 1e9)
    return best


def throughput(pipe, steps, batch_sizes, repeats) -> dict:
    out = {}
    for bs in batch_sizes:
        prompts = ["a red circle left of a blue square"] * bs
        sample(pipe, prompts, 2)  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            sample(pipe, prompts, steps)
            times.append(time.perf_counter() - start)
        out[str(bs)] = {"images_per_s": bs / statistics.median(times), "seconds": statistics.median(times),
                        "min_s": min(times), "max_s": max(times)}
    return out


def training_step(pipe, batch_size):
    """A closure running one optimisation step (forward, backward, AdamW at lr 0, so the model is unchanged)
    of the pipeline's U-Net and text encoder on a batch of `batch_size`."""
    from unet.recipe import noise_scheduler
    unet, text = pipe.unet, pipe.text_encoder
    params = [p for p in list(unet.parameters()) + list(text.parameters())]
    opt = torch.optim.AdamW(params, lr=0.0)
    sched = noise_scheduler()
    size = unet.config.sample_size
    ids = pipe.tokenizer(["a red circle left of a blue square"] * batch_size, padding="max_length",
                         max_length=pipe.tokenizer.model_max_length, return_tensors="pt").input_ids

    def step():
        was = [p.requires_grad for p in params]
        for p in params:
            p.requires_grad_(True)
        unet.train()
        text.train()
        x = torch.randn(batch_size, 3, size, size)
        t = torch.randint(0, sched.config.num_train_timesteps, (batch_size,))
        noise = torch.randn_like(x)
        pred = unet(sched.add_noise(x, noise, t), t, encoder_hidden_states=text(ids).last_hidden_state)
        loss = torch.nn.functional.mse_loss(pred, sched.get_velocity(x, noise, t))
        opt.zero_grad()
        loss.backward()
        opt.step()
        for p, w in zip(params, was):
            p.requires_grad_(w)
        unet.eval()
        text.eval()

    return step


def training_throughput(pipe, batch_size, repeats) -> float:
    """Images/s of one optimisation step of U-Net and text encoder."""
    step = training_step(pipe, batch_size)
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return batch_size / statistics.median(times)


def previous_architecture(pipe):
    """The architecture shipped before v-prediction (widths 32/64/128, a 64-wide 2-layer text encoder), freshly
    initialised: speed does not depend on the weights, so it stands in for the old model side by side."""
    import tempfile
    from pathlib import Path

    from unet.pipeline import ScenePipeline
    from unet.train import TrainConfig, build_components
    cfg = TrainConfig.from_flat(channels=(32, 64, 128), text_width=64, text_layers=2)
    tokenizer, text, unet = build_components(cfg, Path(tempfile.mkdtemp(prefix="previous_")))
    return ScenePipeline(unet=unet.eval(), text_encoder=text.eval(), tokenizer=tokenizer, scheduler=pipe.scheduler)


def recipe_speed(pipe, steps: int, repeats: int, batch_size: int = 32) -> dict:
    """A scenes-32 model against the previous architecture (of that world), side by side: training step and
    sampling 8 images; and, for any model, DPM-Solver++ at 10 steps against DDIM at `steps`, and its own guidance
    against guidance 4."""
    from unet.pipeline import default_guidance, make_scheduler
    prompts = ["a red circle left of a blue square"] * 8
    result = {}
    if getattr(pipe, "world", None) == "scenes-32":  # the previous architecture is a 32-px model of that world
        before = previous_architecture(pipe)
        train = timed_pair(training_step(pipe, batch_size), training_step(before, batch_size), max(3, repeats // 2))
        sampling = timed_pair(lambda: sample(pipe, prompts, steps), lambda: sample(before, prompts, steps), repeats)
        result["training"] = {**train.row(), "images_per_s_now": batch_size / train.ours_ms * 1e3,
                              "images_per_s_before": batch_size / train.theirs_ms * 1e3,
                              "speedup": 1 / train.median_ratio}
        result["sampling_8"] = {**sampling.row(), "seconds_now": sampling.ours_ms / 1e3,
                                "seconds_before": sampling.theirs_ms / 1e3}
    ddim = pipe.scheduler
    dpm = make_scheduler("dpm", ddim.config)

    def with_dpm():
        pipe.scheduler = dpm
        try:
            sample(pipe, prompts, 10)
        finally:
            pipe.scheduler = ddim

    fewer = timed_pair(with_dpm, lambda: sample(pipe, prompts, steps), repeats)

    def own_guidance():  # the model's default scale (1 for the shipped model: no unconditional half)
        pipe(prompts, num_inference_steps=steps, generator=torch.Generator().manual_seed(0), output_type="pt",
             show_progress=False)

    own = timed_pair(own_guidance, lambda: sample(pipe, prompts, steps), repeats)
    return result | {"dpm10_vs_ddim": {**fewer.row(), "seconds_dpm10": fewer.ours_ms / 1e3},
                     "own_guidance_vs_4": {**own.row(), "seconds_own": own.ours_ms / 1e3,
                                           "guidance": float(default_guidance(pipe))}}


def run_benchmark(pipe, quick: bool = False, log=print) -> dict:
    repeats = 3 if quick else 9
    steps = 5 if quick else 25
    result = {"settings": {"quick": quick, "repeats": repeats, "sampling_steps": steps,
                           "threads": torch.get_num_threads()}}
    log("block: ours vs diffusers Attention ...")
    block = {}
    for name in BLOCK_SIZES:
        if quick and name == "sd_largest":
            continue
        block[name] = {"forward": block_benchmark(name, repeats),
                       "forward_backward": block_benchmark(name, max(3, repeats // 2), backward=True)}
    result["block"] = block
    main_size = "sd_largest" if "sd_largest" in block else "ours_default"
    result["block_vs_diffusers_fused"] = {n: b["forward"]["fused"]["median_ratio"] for n, b in block.items()}
    result["block_vs_diffusers_weights"] = {n: b["forward"]["weights"]["median_ratio"] for n, b in block.items()}
    result["block_main_size"] = main_size
    log("capture overhead ...")
    overhead = capture_overhead(pipe, ["a red circle left of a blue square"] * 8, steps, repeats)
    result["capture_overhead"] = overhead["median_ratio"]
    result["capture_overhead_detail"] = overhead
    log("capture memory vs steps ...")
    result["capture_bytes_by_steps"] = capture_bytes(pipe, (3, 6, 12) if quick else (10, 50, 200))
    log("sampling throughput ...")
    sampling = throughput(pipe, steps, (1, 8), max(2, repeats // 3))
    result["sampling"] = sampling
    result["sampling_images_per_s"] = {bs: v["images_per_s"] for bs, v in sampling.items()}
    log("training throughput ...")
    result["training_images_per_s"] = training_throughput(pipe, 8 if quick else 32, max(2, repeats // 3))
    log("the model against the previous architecture (scenes-32 models), fewer steps, its own guidance ...")
    result["recipe"] = recipe_speed(pipe, steps, max(2, repeats // 3), batch_size=8 if quick else 32)
    log("FLOPs and matmul peak ...")
    flops = unet_flops(pipe)
    peak = matmul_peak()
    achieved = flops * 2 * steps * 8 / sampling["8"]["seconds"] / 1e9  # guidance doubles the batch
    result["unet_gflop_per_image_forward"] = flops / 1e9
    result["matmul_peak_gflops"] = peak
    result["sampling_gflops"] = achieved
    result["fraction_of_matmul_peak"] = achieved / peak
    return result
