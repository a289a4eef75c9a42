"""Training from scratch: diffusion on captioned scenes (v-prediction, zero terminal SNR), with HF accelerate.

The same code runs under plain `python` on a CPU and under `accelerate launch` on many GPUs.
One checkpoint file (`checkpoint.safetensors`) holds everything `--resume` needs -- weights, EMA,
optimizer moments, step and RNG states -- written to a temp file and renamed, with a SHA-256 of its
tensors checked on resume (unet/checkpoint.py), so a crash or Ctrl-C never leaves a half-written
checkpoint and a damaged one is never trained on. Ctrl-C and SIGTERM are held back to the end of
the step, so the checkpoint they save is the one a periodic checkpoint at that step would hold, and
`--resume` from it continues bit for bit as if the run had never stopped.
"""

from __future__ import annotations

import copy
import csv
import json
import multiprocessing
import os
import shutil
import signal
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.profiler import record_function
from tqdm.auto import tqdm

from crossattn.errors import UsageError
from crossattn.text import load_text_encoder, load_tokenizer, new_text_encoder, save_vocabulary

from . import checkpoint
from .data import COLORS, SCENE_WORDS, SceneDataset, SceneSampler, scenes_to_tensor, to_model_range
from .folders import partial_folder, publish, remove_stale_temp_files
from .growth import load_weights, remap_moments
from .model import UNet
from .muon import MuonAdamW, is_muon_matrix
from .pipeline import ScenePipeline, load_pipeline, make_scheduler
from .recipe import (
    colour_pairs,
    cross_attention_weights,
    diffusion_loss,
    grounding_loss,
    key_separation_loss,
    lr_at,
    noise_scheduler,
    pixel_grounding_loss,
    sample_timesteps,
    word_masks,
)
from .recipe_file import dump_recipe
from .scenes64 import Scenes64Sampler
from .signals import DeferredSignals
from .train_config import TrainConfig, without_retired
from .world import COLORS as COLORS_64
from .world import known_words

# What each world's captions are made of (`DataConfig.world`): the tokenizer's vocabulary (one token per word) and
# the colour words whose Keys the key separation term keeps apart
VOCABULARY = {"scenes-32": SCENE_WORDS, "scenes-64": known_words()}
COLOUR_WORDS = {"scenes-32": tuple(COLORS), "scenes-64": tuple(COLORS_64)}

# a run folder's record of what made it, copied into its pipeline: the recipe file as written (runs trained from
# one), the resolved recipe (every field, overrides applied: `--recipe` it to train the run again) and the same
# as JSON (what --resume reads)
RECIPE_FILES = ("recipe.toml", "recipe.resolved.toml", "train_config.json")
RESOLVED_HEADER = ("The resolved recipe of this run: every setting it trained with, the command line's overrides\n"
                   "applied. `python scripts/train.py --recipe THIS_FILE{start} --out NEW_FOLDER` trains it again.")


def resolved_header(cfg: TrainConfig) -> str:
    """The first lines of `cfg`'s resolved recipe: the command that trains the run again. A run started from a
    pipeline's weights (--start-from) is not in the file, as that is a setting of the call; the command names it,
    since the file alone trains the same settings from nothing."""
    if cfg.started_from is None:
        return RESOLVED_HEADER.format(start="")
    return (RESOLVED_HEADER.format(start=f" --start-from {cfg.started_from}")
            + "\nWithout --start-from, these settings train from nothing.")


def is_trained(out: Path, steps: int) -> bool:
    """Whether the run in `out` is done: its checkpoint at step `steps` or past it, and its pipeline written (last,
    and atomically: `Trainer.train`)."""
    ckpt = out / "checkpoint.safetensors"
    if not (out / "pipeline" / "model_index.json").is_file() or not ckpt.is_file():
        return False
    step = checkpoint.read_metadata(ckpt)[0].get("step", "")
    return step.isdigit() and int(step) >= steps


def check_resumable(out: Path, steps: int | None = None, flag: str = "--resume") -> None:
    """A run folder `--resume` (or `flag`: --grow-from, --model) can continue (to `steps`, if given): a readable
    config and an undamaged checkpoint (its recorded SHA-256, finite weights) with its step and weights, not
    already past `steps`."""
    ckpt, config = out / "checkpoint.safetensors", out / "train_config.json"
    if not ckpt.is_file():
        raise FileNotFoundError(f"{flag} {out}: {ckpt} does not exist, so there is no trained run to continue")
    metadata, keys = checkpoint.read_metadata(ckpt)
    step = metadata.get("step")
    if step is None or not step.isdigit():
        raise ValueError(f"{ckpt} does not record its step (metadata 'step'): it was not written by this script")
    missing = [p for p in ("unet", "ema") if not any(k.startswith(p + ".") for k in keys)]
    if missing:
        raise ValueError(f"{ckpt} lacks the weights of {missing}: it cannot be resumed")
    done = steps is not None and is_trained(out, steps)
    if steps is not None and (int(step) > steps or done):
        raise ValueError(f"--resume --steps {steps}: the checkpoint is at step {step} already"
                         f"{' and its pipeline is written' if done else ''}; give --steps above {step} to train on")
    try:
        saved = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{flag} needs {config}, a readable JSON file: {e}") from e
    if not isinstance(saved, dict):
        raise ValueError(f"{config} must hold a JSON object of training settings")
    checkpoint.load(ckpt)  # the hash and finiteness: a damaged checkpoint is refused before any work


def trim_log(path: Path, step: int) -> None:
    """Keep the rows of a run's log up to `step` (the checkpoint a resume starts from): the rows after it were
    logged by steps the resumed run does again, so every step then appears exactly once. loss.csv rows are
    (step, loss, seconds); layout.jsonl lines are JSON objects with a "step"."""
    if not path.exists():
        return
    tmp = path.with_name(f".{path.name}.tmp")
    if path.suffix == ".jsonl":
        lines = [line for line in path.read_text().splitlines() if _json_step(line) is not None
                 and _json_step(line) <= step]
        tmp.write_text("".join(line + "\n" for line in lines))
    else:
        with open(path, newline="") as f:
            rows = [r for r in csv.reader(f) if len(r) == 3 and r[0].isdigit() and int(r[0]) <= step]
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows(rows)
    os.replace(tmp, path)


def _json_step(line: str) -> int | None:
    try:
        step = json.loads(line).get("step")
    except (json.JSONDecodeError, AttributeError):  # a line cut short by a crash, or not an object
        return None
    return step if isinstance(step, int) else None


def resumed_config(cfg: TrainConfig, saved: dict) -> TrainConfig:
    """The config a `--resume` of `cfg` trains with: the run's saved config (train_config.json), with this
    call's folder, length, time limit and data workers; settings older runs do not name get the old recipe's
    values, and those of studies since taken out of the code are dropped or refused (`without_retired`)."""
    saved = without_retired(saved)
    # a resumed run may go longer, continue a copied run folder, or run on another machine
    saved.update(out=cfg.out, steps=cfg.schedule.steps, resume=True, max_minutes=cfg.max_minutes,
                 data_workers=cfg.data_workers)
    # runs from before v-prediction name none of these; they were trained with the old recipe
    for key, old in (("prediction_type", "epsilon"), ("zero_terminal_snr", False), ("lr_schedule", "cosine"),
                     ("ema_decay", 0.995), ("num_samples", 30000), ("lr", 1e-3)):
        saved.setdefault(key, old)
    return TrainConfig.from_flat(**saved)


def build_components(cfg: TrainConfig, folder: Path, tokenizer=None):
    """Tokenizer, text side (`cfg.text.text_variant`'s) and a fresh U-Net for `cfg`: our own vocabulary, written into
    `folder`, unless `cfg.text.clip` or a `tokenizer` (a run's own, as saved) is given."""
    model, text = cfg.model, cfg.text
    if text.clip:
        tokenizer, text_encoder = load_tokenizer(text.clip), load_text_encoder(text.clip)
        text_encoder.requires_grad_(text.trains_text)
    else:
        if tokenizer is None:
            tokenizer = save_vocabulary(VOCABULARY[cfg.data.world], folder / "tokenizer", text.max_length)
        text_encoder = new_text_encoder(tokenizer, text.text_width, text.text_layers, model.heads, 4 * text.text_width)
    unet = UNet(sample_size=model.size, channels=tuple(model.channels), cross_attention=tuple(model.cross_attention),
                self_attention=tuple(model.self_attention), context_dim=text_encoder.config.hidden_size,
                heads=model.heads, position_embedding=model.position_embedding, pooled_text=model.pooled_text)
    if text.text_variant != "clip":  # an ablation: study code (unet/research/), imported only by runs that train one
        from .research.text_variants import text_side
        text_encoder = text_side(text.text_variant, tokenizer, text_encoder, text.side_hint_gain)
    return tokenizer, text_encoder, unet


def build_optimizer(unet, text_encoder, cfg: TrainConfig) -> tuple[list, torch.optim.Optimizer, list[str]]:
    """(trained parameters, the optimizer, the checkpoint name of each optimizer parameter id): AdamW, or with
    `--optimizer muon` Muon on the hidden weight matrices (unet/muon.py); weight decay on the weight matrices only.
    Each group's `lr_scale` times the schedule's rate is its learning rate: 1, or text_lr / lr for a CLIP's text
    encoder (whose groups come last, so a run grown from a frozen one keeps its U-Net's parameter ids)."""
    unet_named = [(f"unet.{n}", p) for n, p in unet.named_parameters()]
    text_named = [(f"text.{n}", p) for n, p in text_encoder.named_parameters() if p.requires_grad]
    # the trained text: a run's own encoder, or an ablation's parts on a frozen CLIP, at --lr; a CLIP at --text-lr
    settings = cfg.optimizer
    parts = ([(unet_named, 1.0), (text_named, cfg.text.text_lr / settings.lr)] if cfg.text.clip and cfg.text.text_lr
             else [(unet_named + text_named, 1.0)])
    groups, names = [], []
    for named, lr_scale in parts:
        # decaying token and position embeddings toward 0 drags rarely seen words and the text encoder drifts
        decay = [(n, p) for n, p in named if p.dim() >= 2 and "embedding" not in n]
        no_decay = [(n, p) for n, p in named if all(p is not q for _, q in decay)]
        kinds = [(decay, settings.weight_decay, False), (no_decay, 0.0, False)]
        if settings.algorithm == "muon":  # the decayed hidden matrices step by Muon
            kinds = [([(n, p) for n, p in decay if is_muon_matrix(n, p)], settings.weight_decay, True),
                     ([(n, p) for n, p in decay if not is_muon_matrix(n, p)], settings.weight_decay, False),
                     (no_decay, 0.0, False)]
        for members, weight_decay, muon in kinds:
            if members:
                groups.append({"params": [p for _, p in members], "weight_decay": weight_decay, "lr_scale": lr_scale}
                              | ({"muon": True} if muon else {}))
                names += [n for n, _ in members]
    optimizer = (MuonAdamW(groups, lr=settings.lr, momentum=settings.muon_momentum,
                           update_rms=settings.muon_update_rms) if settings.algorithm == "muon"
                 else torch.optim.AdamW(groups, lr=settings.lr))
    return [p for g in groups for p in g["params"]], optimizer, names


def text_replaced(text_encoder, tensors: dict) -> bool:
    """Whether the checkpoint `tensors` hold text weights other than `text_encoder`'s: it was saved by a run with
    another text side (its own, trained) than the frozen one this run has."""
    own = text_encoder.state_dict()
    saved = {k[len("text."):]: v for k, v in tensors.items() if k.startswith("text.")}
    return any(k not in own or own[k].shape != v.shape or not torch.equal(own[k], v) for k, v in saved.items())


def start_from_pipeline(cfg: TrainConfig, tokenizer, text_encoder, unet) -> None:
    """Load the U-Net and text encoder weights of the pipeline `cfg.started_from` (a folder, or a shipped model's
    name) into this run's fresh ones: a new round of training on a model whose run folder, and so its optimizer
    moments, are gone. ValueError, one line, for a pipeline this run's settings do not rebuild: another world,
    vocabulary or architecture."""
    source = cfg.started_from
    try:
        pipe = load_pipeline(source, show_progress=False)
    except UsageError as e:
        raise ValueError(f"--start-from {source}: {e}") from e
    world = getattr(pipe, "world", None)
    if not isinstance(pipe, ScenePipeline) or world != cfg.data.world:
        raise ValueError(f"--start-from {source} is {'a model of world ' + world if world else 'not a crossattn model'}"
                         f"; this run trains world {cfg.data.world}: give a model of that world, or its recipe")
    if pipe.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"--start-from {source} reads another vocabulary than this run's: its token ids would "
                         "name other words")
    for part, module, trained in (("U-Net", unet, pipe.unet), ("text encoder", text_encoder, pipe.text_encoder)):
        own, saved = module.state_dict(), trained.state_dict()
        differ = sorted(k for k in own.keys() | saved.keys()
                        if k not in own or k not in saved or own[k].shape != saved[k].shape)
        if differ:
            raise ValueError(f"--start-from {source}: its {part} is not the one this run builds ({differ[0]!r} "
                             f"differs, {len(differ)} tensors in all); train with the settings it was made with "
                             f"(its train_config.json or recipe)")
        module.load_state_dict(saved)


def run_pipeline(folder: Path, scheduler: str = "ddim", ema: bool = True) -> ScenePipeline:
    """The EMA model of a run folder's checkpoint as a pipeline (or, `ema=False`, its last step's own weights),
    whatever its text side: runs of an ablation encoder have no pipeline folder (those are not diffusers parts),
    and a running run's latest checkpoint can be evaluated between snapshots. The folder is only read."""
    check_resumable(folder, flag="--model")
    cfg = resumed_config(TrainConfig(out=str(folder)), json.loads((folder / "train_config.json").read_text()))
    tokenizer = None if cfg.text.clip else load_tokenizer(folder / "tokenizer")  # the run's own vocabulary
    tokenizer, text_encoder, unet = build_components(cfg, folder, tokenizer)
    tensors, _ = checkpoint.load(folder / "checkpoint.safetensors")
    unet_prefix, text_prefix = ("ema", "ema_text") if ema else ("unet", "text")
    text = [(text_prefix, text_encoder)] if cfg.text.text_checkpointed else []  # a frozen CLIP alone is its folder's
    for prefix, module in [(unet_prefix, unet), *text]:
        # a folder --grow-from just made holds its source's checkpoint until its first save: grow it here too
        load_weights(module, tensors, prefix, folder / "checkpoint.safetensors")
        module.requires_grad_(False).eval()
    unet.to(memory_format=torch.channels_last)  # as in training: faster on CPU, and the same sums
    pipe = ScenePipeline(unet=unet, text_encoder=text_encoder, tokenizer=tokenizer,
                         scheduler=make_scheduler(scheduler, noise_scheduler(cfg.diffusion.prediction_type,
                                                                            cfg.diffusion.zero_terminal_snr).config))
    pipe.world = cfg.data.world  # as load_pipeline reads it from a pipeline folder
    return pipe


def training_data(cfg: TrainConfig) -> SceneDataset | None:
    """The dataset folder, `num_samples` scenes drawn once, or None: fresh scenes every batch."""
    if cfg.data.folder:
        return SceneDataset.load(cfg.data.folder)
    if cfg.data.num_samples:
        return SceneDataset.generate(cfg.data.num_samples, cfg.run.seed, cfg.model.size, cfg.model.size)
    return None


def fresh_scenes(seed: int, step: int, batch_size: int, size: int, single_share: float = 0.4,
                 colourless_share: float = 0.2, and_order: str = "any", world: str = "scenes-32") -> list:
    """`batch_size` new scenes (images, captions, masks) of `world`'s training split, drawn from (seed, step): cheap
    (about a millisecond per scene) and never repeated, and a resumed run draws exactly the batches it would have."""
    if world == "scenes-64":
        sampler = Scenes64Sampler(seed=(seed, step), split="train", size=size, p_one_group=single_share,
                                  p_colourless=colourless_share, and_order=and_order)
    else:
        sampler = SceneSampler(seed=(seed, step), height=size, width=size, split="train", p_single=single_share,
                               p_colourless=colourless_share, and_order=and_order)
    return [sampler() for _ in range(batch_size)]


def training_batch(cfg: TrainConfig, tokenizer, step: int, part: slice = slice(None),
                   dataset: SceneDataset | None = None) -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
    """The batch of `step` (this process's `part` of it): images in the model's range, captions (some dropped to
    "") and, with a grounding loss, `word_masks` (else None). Fresh scenes, or `dataset`'s in an order drawn per
    epoch; a function of (seed, step) alone, so a resumed run, or a data worker, draws the same batch."""
    scenes = None
    if dataset is None:
        data = cfg.data
        scenes = fresh_scenes(cfg.run.seed, step, cfg.optimizer.batch_size, cfg.model.size, data.single_share,
                              data.colourless_share, data.and_order, data.world)
        images, captions = scenes_to_tensor(scenes), [s.caption for s in scenes]
    else:
        n = len(dataset)
        per_epoch = max(1, n // cfg.optimizer.batch_size)
        epoch, i = divmod(step, per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.run.seed * 100003 + epoch))
        idx = order[i * cfg.optimizer.batch_size:(i + 1) * cfg.optimizer.batch_size]
        images, captions = dataset.images[idx], [dataset.captions[j] for j in idx.tolist()]
    images, captions = to_model_range(images[part]), captions[part]
    coin = torch.rand(len(captions), generator=torch.Generator().manual_seed(cfg.run.seed + step))
    captions = ["" if drop else c for drop, c in zip((coin < cfg.data.caption_dropout).tolist(), captions)]
    masks = word_masks(scenes[part], captions, tokenizer) if cfg.losses.grounded else None
    return images, captions, masks


def _worker_loop(conn, cfg: TrainConfig, tokenizer, part: slice) -> None:
    """A data worker: draw the batch of each step asked on `conn` and send it back, until asked None or the pipe
    closes (the training process ended or closed it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training loop's to hold and act on
    torch.set_num_threads(1)
    try:
        while (step := conn.recv()) is not None:
            conn.send((step, training_batch(cfg, tokenizer, step, part)))
    except (EOFError, OSError):  # the trainer is gone or closed the pipe while this batch was drawn: nothing to say
        pass


class BatchPrefetcher:
    """The fresh-scene batches of the coming steps, drawn in `workers` processes while the model trains on the
    current one (`training_batch`: the same batches the loop would draw). On a GPU the model's step is short and
    drawing 32 scenes in the loop would leave it idle.

    Each worker has a pipe of its own and draws every `workers`-th step, in order. Not `multiprocessing.Pool`: its
    workers share one queue lock, and a worker killed while it waited for work (a SIGTERM to the whole process
    group) kept that lock for ever, so `Pool.terminate` hung the run after its checkpoint. Here nothing is shared:
    a killed worker's pipe reads as closed, and its batches are drawn in the loop."""

    def __init__(self, cfg: TrainConfig, tokenizer, part: slice, workers: int, wait_s: float = 30.0):
        # spawn, not fork: a forked copy of a process that has run torch's thread pools can hang
        context = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(workers):
            here, there = context.Pipe()
            proc = context.Process(target=_worker_loop, args=(there, cfg, tokenizer, part), daemon=True)
            proc.start()
            there.close()  # the worker's end lives in the worker: its death then reads as a closed pipe here
            self.conns.append(here)
            self.procs.append(proc)
        self.ahead, self.last = 2 * workers, cfg.schedule.steps - 1
        self.wait_s = wait_s  # a batch takes ~50 ms; one that has not come by then is drawn in the loop
        self.started = False  # until the first batch comes, the workers are still importing: the loop draws
        self.asked: set[int] = set()  # steps sent to a worker
        self.ready: dict[int, object] = {}  # batches that came while an earlier step was awaited

    def _conn(self, step: int):
        return self.conns[step % len(self.conns)]

    def get(self, step: int):
        """The batch of `step`, or None if it is not ready while the workers start, did not come within `wait_s`,
        or its worker is gone (killed, say by a signal to the whole process group): the loop then draws it itself,
        and the run goes on to save its checkpoint."""
        self.asked = {s for s in self.asked if s >= step}
        self.ready = {s: batch for s, batch in self.ready.items() if s >= step}
        for s in range(step, min(step + self.ahead, self.last + 1)):
            if s not in self.asked:
                try:
                    self._conn(s).send(s)
                except OSError:  # that worker is gone: the loop draws its steps
                    continue
                self.asked.add(s)
        if step in self.ready:
            return self.ready.pop(step)
        if step not in self.asked:
            return None
        conn, deadline = self._conn(step), time.monotonic() + (self.wait_s if self.started else 0)
        try:
            while conn.poll(max(0.0, deadline - time.monotonic())):
                got, batch = conn.recv()
                if got == step:
                    self.started = True
                    return batch
                if got > step:  # kept for its step; this one will not come from this worker now
                    self.ready[got] = batch
                    break
                # got < step: a batch the loop drew itself when it was late; dropped
        except (EOFError, OSError):  # the worker died: its pipe is closed
            pass
        return None

    def close(self) -> None:
        """End the workers, whatever state they are in; never waits on one."""
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            proc.kill()
            proc.join()


class NonFiniteLoss(ArithmeticError):
    """Training met a loss or gradient that is not finite at `step`; `kept` is the step of the checkpoint on disk
    (None: none was written), which the run did not touch."""

    def __init__(self, step: int, what: str, kept: int | None):
        super().__init__(f"step {step}: {what}")
        self.step, self.what, self.kept = step, what, kept


class TrainerCallback:
    """Something a run does beside training, on the main process only: a measurement it takes or a file it writes
    (transformers' `TrainerCallback`, cut to two events). The checkpoint is not one: `--resume` depends on it."""

    def on_train_begin(self, trainer: Trainer) -> None:
        """Before the first step of this call, at `trainer.step` (0, or the step of the checkpoint it resumed)."""

    def after_step(self, trainer: Trainer, step: int, last: bool) -> None:
        """After step `step` and its checkpoint, if it saved one; `last`: the run stops there (its last step, or
        --max-minutes ran out)."""


class SampleGrid(TrainerCallback):
    """The EMA model's images of `run.sample_prompts` in a row, every `run.sample_every` steps and at the end:
    OUT/samples/step_NNNNNN.png, each from the same noise (seed 0)."""

    def on_train_begin(self, trainer: Trainer) -> None:
        (trainer.out / "samples").mkdir(exist_ok=True)

    def after_step(self, trainer: Trainer, step: int, last: bool) -> None:
        if step % trainer.cfg.run.sample_every == 0 or last:
            self.save(trainer, trainer.out / "samples" / f"step_{step:06d}.png")

    @staticmethod
    def save(trainer: Trainer, path: Path) -> None:
        from PIL import Image
        gen = torch.Generator().manual_seed(0)
        images = trainer.pipeline()(trainer.cfg.run.sample_prompts, generator=gen, show_progress=False).images
        s = images[0].width
        grid = Image.new("RGB", (s * len(images), s))
        for i, im in enumerate(images):
            grid.paste(im, (i * s, 0))
        grid.resize((grid.width * 4, grid.height * 4), Image.NEAREST).save(path)


class PipelineSnapshots(TrainerCallback):
    """The EMA pipeline every `run.snapshot_every` steps (0: never), in OUT/snapshots/step_NNNNNN: the points of
    a scaling curve (scripts/scaling.py). Ablation text sides write none (they are not diffusers parts)."""

    def after_step(self, trainer: Trainer, step: int, last: bool) -> None:
        every = trainer.cfg.run.snapshot_every
        if every and step % every == 0 and trainer.writes_pipeline:
            trainer.save_pipeline(trainer.out / "snapshots" / f"step_{step:06d}")


class Trainer:
    def __init__(self, cfg: TrainConfig, callbacks: Sequence[TrainerCallback] = ()):
        """`callbacks` measure or write beside the run's own snapshots and sample grids, in that order after each
        step (the command line's: the layout log, unet/eval/layout_log.py)."""
        cfg.validate()
        self.cfg = cfg
        self.callbacks = [PipelineSnapshots(), SampleGrid(), *callbacks]
        self.out = Path(cfg.out)
        self.ckpt_path = self.out / "checkpoint.safetensors"
        if self.ckpt_path.exists() and not cfg.resume:
            raise FileExistsError(f"{self.ckpt_path} exists; pass --resume to continue it or choose another --out")
        if cfg.resume:
            check_resumable(self.out, cfg.schedule.steps)
        self.accelerator = Accelerator()
        torch.manual_seed(cfg.run.seed)
        self.out.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(self.out)  # a checkpoint half-written by a run that was killed
        if cfg.resume:
            self.cfg = cfg = resumed_config(cfg, json.loads((self.out / "train_config.json").read_text()))
        elif self.accelerator.is_main_process:
            (self.out / "train_config.json").write_text(json.dumps(cfg.flat(), indent=1))
            (self.out / "recipe.resolved.toml").write_text(dump_recipe(cfg, resolved_header(cfg)))

        self.tokenizer, self.text_encoder, self.unet = build_components(cfg, self.out)
        if cfg.started_from and not cfg.resume:  # a resumed run's checkpoint holds the weights it trained since
            start_from_pipeline(cfg, self.tokenizer, self.text_encoder, self.unet)
        self.unet.to(memory_format=torch.channels_last)  # ~20% faster convolutions on CPU (oneDNN)
        self.ema = copy.deepcopy(self.unet).requires_grad_(False)
        self.ema_text = copy.deepcopy(self.text_encoder).requires_grad_(False)
        self.scheduler = noise_scheduler(cfg.diffusion.prediction_type, cfg.diffusion.zero_terminal_snr)
        self.params, self.optimizer, self.param_names = build_optimizer(self.unet, self.text_encoder, cfg)
        self.dataset = training_data(cfg)
        self.prefetcher: BatchPrefetcher | None = None  # started by train(), for fresh scenes only
        self.step = 0
        self.saved_step: int | None = None  # the step of the checkpoint on disk, once this run wrote or read one
        self.noise_gen = torch.Generator().manual_seed(cfg.run.seed + 1)
        if cfg.resume:
            self._load_checkpoint()
        self.unet, self.text_encoder, self.optimizer = self.accelerator.prepare(
            self.unet, self.text_encoder, self.optimizer)
        self.ema.to(self.accelerator.device)
        self.ema_text.to(self.accelerator.device)
        # each process takes its own slice of the global batch
        self.part = slice(self.accelerator.process_index, None, self.accelerator.num_processes)

    # --- data: the batch at a step is a function of (seed, step), so a resumed run sees the same batches
    def batch(self, step: int) -> tuple[torch.Tensor, list[str], torch.Tensor | None]:
        """Images, captions (some dropped to "") and, with a grounding loss, `word_masks` (else None): drawn ahead
        by the data workers where there are some, else here (`training_batch`)."""
        drawn = self.prefetcher.get(step) if self.prefetcher is not None else None
        return drawn or training_batch(self.cfg, self.tokenizer, step, self.part, self.dataset)

    def loss(self, images: torch.Tensor, captions: list[str], masks: torch.Tensor | None = None) -> torch.Tensor:
        device = self.accelerator.device
        ids = self.tokenizer(captions, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(device)
        noise = torch.randn(images.shape, generator=self.noise_gen).to(device)
        t = sample_timesteps(self.cfg.diffusion, len(images), self.scheduler.config.num_train_timesteps, self.noise_gen)
        images, t = images.to(device), t.to(device)
        watch = nullcontext([]) if masks is None else cross_attention_weights(self.accelerator.unwrap_model(self.unet))
        with self.autocast(), watch as weights:
            with record_function("text encoder"):
                context = self.text_encoder(ids).last_hidden_state  # (B, T, D), one encoding shared by all layers
            with record_function("U-Net"):
                loss = diffusion_loss(self.unet, self.scheduler, images, context, noise, t,
                                      self.cfg.diffusion.prediction_type, self.cfg.diffusion.min_snr_gamma)
        context = context.float()  # the loss terms below sum in float32
        with record_function("attention losses"):
            if self.cfg.losses.key_separation_weight:
                pairs = colour_pairs(captions, self.tokenizer, COLOUR_WORDS[self.cfg.data.world])
                loss = loss + self.cfg.losses.key_separation_weight * key_separation_loss(
                    self.accelerator.unwrap_model(self.unet), context, pairs, self.cfg.losses.key_margin)
            if masks is None:
                return loss
            masks = masks.to(device)
            return (loss + self.cfg.losses.grounding_weight * grounding_loss(weights, masks)
                    + self.cfg.losses.pixel_grounding_weight * pixel_grounding_loss(weights, masks))

    def autocast(self):
        """The forward passes' precision: bfloat16 autocast for `precision` "bf16", else nothing changes."""
        return torch.autocast(self.accelerator.device.type, dtype=torch.bfloat16,
                              enabled=self.cfg.optimizer.precision == "bf16")

    @torch.no_grad()
    def update_ema(self):
        # a short average early (when weights move fast), the full decay once the run has 1000s of steps
        d = min(self.cfg.schedule.ema_decay, (1 + self.step) / (10 + self.step))
        for model, ema in ((self.unet, self.ema), (self.text_encoder, self.ema_text)):
            for p, e in zip(self.accelerator.unwrap_model(model).parameters(), ema.parameters()):
                e.lerp_(p.detach(), 1 - d)

    # --- checkpoints: safetensors only, atomic
    def save_checkpoint(self):
        if not self.accelerator.is_main_process:
            return
        tensors = {}
        for prefix, module in (("unet", self.unet), ("text", self.text_encoder), ("ema", self.ema),
                               ("ema_text", self.ema_text)):
            for k, v in self.accelerator.unwrap_model(module).state_dict().items():
                tensors[f"{prefix}.{k}"] = v.detach().cpu().contiguous()
        opt = self.optimizer.state_dict()
        for pid, state in opt["state"].items():
            for k, v in state.items():
                tensors[f"opt.{pid}.{k}"] = torch.as_tensor(v).cpu().contiguous()
        tensors["rng.noise"] = self.noise_gen.get_state()
        tensors["rng.torch"] = torch.get_rng_state()
        checkpoint.save(tensors, self.ckpt_path, {"step": str(self.step)})
        self.saved_step = self.step

    def _load_checkpoint(self):
        tensors, metadata = checkpoint.load(self.ckpt_path)
        self.step = self.saved_step = int(metadata["step"])
        grown = []
        for prefix, module in self.checkpointed_modules():
            # a config that adds position embeddings, pooled text, self-attention or side hints grows the model
            grown += load_weights(module, tensors, prefix, self.ckpt_path)
        if grown:
            print(f"grown from the model of step {self.step}: {len(grown)} new weight tensors (with the EMA's) "
                  "start at identity")
        if self.cfg.text.clip and text_replaced(self.text_encoder, tensors):
            # grown onto a frozen CLIP from a run that trained its own text side: the Adam moments were that run's
            # parameter order, text included; the U-Net starts afresh on them
            print(f"grown from the model of step {self.step} onto the frozen text side of {self.cfg.text.clip}: the "
                  "U-Net's weights carry over, its optimizer moments start afresh")
        else:
            remap_moments(self.optimizer, self.param_names, tensors)
        self.noise_gen.set_state(tensors["rng.noise"])
        torch.set_rng_state(tensors["rng.torch"])

    def checkpointed_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """What a checkpoint's weights load into, by prefix. A frozen text side (`cfg.text.clip`) is its folder's,
        never the checkpoint's: a run grown onto it holds its source's own text weights until it first saves."""
        text = [("text", self.text_encoder), ("ema_text", self.ema_text)] if self.cfg.text.text_checkpointed else []
        return [("unet", self.unet), ("ema", self.ema), *text]

    def pipeline(self, ema: bool = True) -> ScenePipeline:
        unet = self.ema if ema else self.accelerator.unwrap_model(self.unet)
        text = self.ema_text if ema else self.accelerator.unwrap_model(self.text_encoder)
        return ScenePipeline(unet=unet, text_encoder=text, tokenizer=self.tokenizer,
                             scheduler=make_scheduler("ddim", self.scheduler.config))

    def train(self, progress: bool = True) -> list[float]:
        """Run to `cfg.schedule.steps`; returns the losses of this call.

        Ctrl-C and SIGTERM are held back to the end of the step: the run then saves its checkpoint (the one a
        periodic checkpoint at that step would be) and raises `Interrupted`. The loss log is flushed with
        every checkpoint; a resumed run first drops the rows logged after its checkpoint. A loss or gradient
        that is not finite stops the run before the optimizer step (`NonFiniteLoss`): the weights stay those
        of the step before, and the checkpoint on disk is never replaced by a damaged one.
        """
        cfg = self.cfg
        main = self.accelerator.is_main_process
        if main:
            trim_log(self.out / "loss.csv", self.step)
            for callback in self.callbacks:
                callback.on_train_begin(self)
        # one writer: a second process appending to (or trimming) the same file would log each step twice
        log = open(self.out / "loss.csv" if main else os.devnull, "a", newline="")  # noqa: SIM115 -- closed below
        writer = csv.writer(log)
        losses = []
        bar = tqdm(total=cfg.schedule.steps, initial=self.step,
                   disable=not progress or not main, desc="training")
        t0, seen = time.time(), 0
        def save_checkpoint():
            log.flush()  # rows up to this step are on disk before the checkpoint that covers them
            self.save_checkpoint()

        with DeferredSignals() as held:
            try:
                if cfg.data_workers and self.dataset is None:  # a dataset's batches are an index: nothing to draw
                    self.prefetcher = BatchPrefetcher(cfg, self.tokenizer, self.part, cfg.data_workers)
                while self.step < cfg.schedule.steps:
                    held.raise_pending()  # between steps: nothing of the next one has drawn a random number yet
                    loss = self.train_step()
                    losses.append(loss)
                    seen += cfg.optimizer.batch_size
                    writer.writerow([self.step, f"{loss:.5f}", f"{time.time() - t0:.1f}"])
                    bar.set_postfix(loss=f"{loss:.4f}", img_s=f"{seen / (time.time() - t0):.0f}")
                    bar.update(1)
                    out_of_time = cfg.max_minutes > 0 and time.time() - t0 > 60 * cfg.max_minutes
                    self.after_step(save_checkpoint, out_of_time)
                    if out_of_time:
                        bar.write(f"--max-minutes {cfg.max_minutes} reached at step {self.step}; --resume continues")
                        break
                held.raise_pending()
            except KeyboardInterrupt:
                if self.saved_step != self.step:  # signals are still held: this save is never cut short
                    save_checkpoint()
                raise
            finally:
                if self.prefetcher is not None:
                    self.prefetcher.close()
                    self.prefetcher = None
                bar.close()
                log.close()
        if main:
            plot_loss(self.out / "loss.csv", self.out / "loss_curve.png")
            if self.writes_pipeline:  # last, and atomic: a pipeline on disk means the run is done
                self.save_pipeline(self.out / "pipeline")
        return losses

    @property
    def writes_pipeline(self) -> bool:
        """Whether the run ends in a diffusers pipeline folder (ablation text sides are not diffusers parts)."""
        return self.cfg.text.text_variant == "clip"

    def train_step(self) -> float:
        """One optimizer step on the batch of `self.step`, then the EMA; returns the loss. Its phases are named
        for torch.profiler (`scripts/profile_training.py`); outside a profile the names cost nothing."""
        for g in self.optimizer.param_groups:
            g["lr"] = lr_at(self.step, self.cfg.optimizer, self.cfg.schedule) * g["lr_scale"]
        with record_function("data"):
            batch = self.batch(self.step)
        loss = self.loss(*batch)
        if not torch.isfinite(loss):
            raise NonFiniteLoss(self.step + 1, f"the loss is {loss.item()}", self.saved_step)
        with record_function("backward"):
            self.optimizer.zero_grad(set_to_none=True)
            self.accelerator.backward(loss)
        with record_function("optimizer"):
            norm = self.accelerator.clip_grad_norm_(self.params, self.cfg.optimizer.grad_clip)
            if not torch.isfinite(torch.as_tensor(norm)):
                raise NonFiniteLoss(self.step + 1, f"the gradient norm is {float(norm)}", self.saved_step)
            self.optimizer.step()
        self.step += 1
        with record_function("EMA"):
            self.update_ema()
        return loss.item()

    def after_step(self, save_checkpoint, out_of_time: bool) -> None:
        """What a finished step may write: the checkpoint (every `checkpoint_every` steps, at the end, and when
        time is up), then, on the main process, what each callback writes or measures."""
        step, last = self.step, self.step == self.cfg.schedule.steps or out_of_time
        if step % self.cfg.run.checkpoint_every == 0 or last:
            save_checkpoint()
        if self.accelerator.is_main_process:
            for callback in self.callbacks:
                callback.after_step(self, step, last)

    def save_pipeline(self, folder: Path):
        """The EMA pipeline, plus the words its captions used (so generation can warn about unseen ones), written
        into a partial folder and renamed into place (replacing an older one) only when complete."""
        if self.dataset is not None:
            captions = self.dataset.captions
        elif self.cfg.data.world == "scenes-64":
            sampler = Scenes64Sampler(self.cfg.run.seed, "train")  # descriptions only: no scene is drawn
            captions = [sampler.description().text() for _ in range(2000)]
        else:
            sampler = SceneSampler(self.cfg.run.seed, 8, 8)  # tiny scenes: only their captions are needed
            captions = [sampler().caption for _ in range(2000)]
        words = sorted({w for caption in captions for w in caption.split()})
        folder.parent.mkdir(parents=True, exist_ok=True)
        with partial_folder(folder.parent) as tmp:
            self.pipeline().save_pretrained(tmp)
            # save_pretrained writes tokenizer.json only; 4.x users need these
            vocabulary = Path(self.cfg.text.clip) if self.cfg.text.clip else self.out / "tokenizer"
            for name in ("vocab.json", "merges.txt"):
                if (vocabulary / name).exists():
                    shutil.copy(vocabulary / name, tmp / "tokenizer" / name)
            (tmp / "trained_words.json").write_text(json.dumps(words))
            for name in RECIPE_FILES:  # every pipeline carries the recipe that made it
                if (self.out / name).is_file():
                    shutil.copy(self.out / name, tmp / name)
            publish(tmp, folder, replace=True)


def plot_loss(csv_path: Path, png_path: Path, smooth: int = 50) -> None:
    """The training loss (raw and a running mean) against step, from the run's loss.csv."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    with open(csv_path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    steps = [int(r[0]) for r in rows]
    losses = torch.tensor([float(r[1]) for r in rows])
    k = max(1, min(smooth, len(losses)))
    running = torch.nn.functional.avg_pool1d(losses[None, None], k, stride=1)[0, 0]
    fig = Figure(figsize=(6, 3.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(steps, losses.numpy(), alpha=0.3, lw=0.7, label="loss")
    ax.plot(steps[k - 1:], running.numpy(), lw=1.5, label=f"mean of {k}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("Min-SNR-weighted MSE")
    ax.legend()
    fig.savefig(png_path)
