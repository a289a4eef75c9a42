"""The settings of a training run, grouped by what they configure: one small dataclass per recipe section.

    cfg = TrainConfig.from_flat(lr=1e-3, channels=(32, 64, 128))   # flat names: flags, train_config.json, tests
    cfg.optimizer.lr, cfg.model.channels                            # nested: what the training code reads
    cfg.flat()["lr"]                                                # and back

Each group (`ModelConfig`, `TextConfig`, ...) holds the fields of one section of a recipe file
(unet/recipe_file.py reads its sections from `GROUPS`) and checks them itself (`check`); `TrainConfig` holds one of
each plus the settings of one call (its folder, --resume, a time limit, data workers, what it was grown from), and
its `validate` adds the checks that span groups. A field's flat name is its recipe key and its flag (`--lr`); two
fields are named otherwise inside their group, where the section's name would repeat: [optimizer] optimizer is
`OptimizerConfig.algorithm` and [data] data is `DataConfig.folder` (`field(metadata={"flat": ...})`).

Run folders keep their settings flat (train_config.json, the same keys as ever), so every run and pipeline folder
written before these groups existed still resumes and loads. Two studies' settings that never served a shipped model
have left the code (`RETIRED`); a folder that names them at the values that changed nothing loads as before.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path

from .data import check_and_order
from .pipeline import WORLDS, check_seed
from .recipe import LR_SCHEDULES, TIMESTEP_SAMPLING
from .world import CAPTION_TOKENS, IMAGE_SIZE, LONGEST_CAPTION

# Training derives torch seeds from its seed (seed + step, seed * 100003 + epoch), and torch's must fit in
# 64 bits: 32-bit seeds keep them in range for any run length (sampling takes all 64 bits: pipeline.MAX_SEED).
TRAIN_MAX_SEED = 2 ** 32 - 1
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "muon")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_positive(name: str, value) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")


def check_non_negative(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{_flag(name)} must be a finite number >= 0, got {value}")


def check_one_of(name: str, value: str, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, accepted))}, got {value!r}")


@dataclass
class ModelConfig:
    """The U-Net: [model]."""
    size: int = 32
    channels: tuple = (32, 64, 128)
    cross_attention: tuple = (False, True, True)
    self_attention: tuple = (False, False, True)
    heads: int = 4
    position_embedding: bool = False  # 2D position embedding on the image tokens of every SpatialTransformer
    pooled_text: bool = False  # the prompt's summary vector (last token's hidden state) joins the timestep's

    def check(self) -> None:
        check_positive("size", self.size)
        multiple = 2 ** (len(self.channels) - 1)
        if self.size % multiple:
            raise ValueError(f"--size must be a multiple of {multiple} for {len(self.channels)} levels of --channels, "
                             f"got {self.size}")
        if any(c <= 0 or c % 8 for c in self.channels):
            raise ValueError(f"--channels must be positive multiples of 8 (group norm in 8 groups), "
                             f"got {list(self.channels)}")


@dataclass
class TextConfig:
    """The text side: the run's own CLIP text encoder, or a frozen CLIP folder's: [text]."""
    text_width: int = 64
    text_layers: int = 2
    max_length: int = 32
    clip: str | None = None  # a local CLIP folder (tokenizer + text encoder), kept frozen unless text_lr > 0
    # with clip: > 0 trains that CLIP's text encoder with the U-Net, at this peak rate (same warm-up and schedule),
    # so a text side pretrained to keep its words apart can still learn which colour goes with which shape
    text_lr: float = 0.0
    # The text-side studies' settings, not a recipe's: "clip" is what ships; "bidirectional", "oracle" and
    # "side-hints" are ablations (unet/research/text_variants.py) trained by scripts/ablation.py and --grow-from
    text_variant: str = "clip"
    side_hint_gain: float = 1.0  # side-hints: the table's output is gain x its weights, so it learns gain x faster

    def check(self) -> None:
        if self.text_variant != "clip":  # the ablations' names live with their code, which only a study imports
            from .research.text_variants import TEXT_VARIANTS
            check_one_of("text_variant", self.text_variant, TEXT_VARIANTS)
        if self.clip is not None and not Path(self.clip).is_dir():
            raise FileNotFoundError(f"CLIP folder {self.clip} does not exist")
        if not (math.isfinite(self.text_lr) and self.text_lr >= 0):
            raise ValueError(f"--text-lr must be a finite number >= 0 (0: the CLIP stays frozen), got {self.text_lr}")
        if self.text_lr and self.clip is None:
            raise ValueError(f"--text-lr {self.text_lr} applies only with --clip: a run's own text encoder learns "
                             "at --lr with the U-Net")
        if self.text_lr and self.text_variant != "clip":
            raise ValueError(f"--text-lr {self.text_lr} trains the CLIP's own encoder; --text-variant "
                             f"{self.text_variant} is an ablation on a frozen one")
        if not (math.isfinite(self.side_hint_gain) and self.side_hint_gain > 0):
            raise ValueError(f"--side-hint-gain must be a finite number > 0 (at 0 the side hints never change "
                             f"anything), got {self.side_hint_gain}")

    @property
    def trains_text(self) -> bool:
        """Whether training changes the text encoder: its own always, a CLIP's only at a text_lr above 0."""
        return self.clip is None or self.text_lr > 0

    @property
    def text_checkpointed(self) -> bool:
        """Whether the text side's weights come from the checkpoint: all but a frozen CLIP alone, which is its
        folder's (an ablation's parts on a frozen CLIP, such as the side-hint table, train and are saved)."""
        return self.trains_text or self.text_variant != "clip"


@dataclass
class DataConfig:
    """What the model is shown: [data]."""
    # the synthetic world the scenes come from (`WORLDS`): "scenes-32" (unet/data.py: 4 colours, 3 shapes, one or two
    # objects) or "scenes-64" (unet/scenes64.py: 8 colours, 6 shapes, 2 sizes, counts 1-4; fresh scenes only)
    world: str = "scenes-32"
    single_share: float = 0.4  # share of one-object scenes; the rest are pairs, 4 in 5 of them with a relation
    # (scenes-64: the share of captions naming one group, `Scenes64Sampler`'s p_one_group)
    # share of pairs of two different shapes captioned without colours ("a circle and a square"); the only pairs
    # where shape words alone tell the two objects apart (same-shape pairs always name their colours)
    # (scenes-64: the share of groups written without their colour word, p_colourless)
    colourless_share: float = 0.2
    and_order: str = "any"  # or "reading": "a circle and a square" puts the circle first as read (unet.data.AND_ORDERS)
    caption_dropout: float = 0.1  # empty captions teach the unconditional model for guidance
    num_samples: int = 0  # > 0: draw this many scenes once and repeat them; 0: fresh scenes every batch
    folder: str | None = field(default=None, metadata={"flat": "data"})  # a folder from `--make-data` (--data)

    def check(self) -> None:
        check_one_of("world", self.world, WORLDS)
        if self.num_samples < 0:
            raise ValueError(f"num_samples must be >= 0 (0: fresh scenes every batch), got {self.num_samples}")
        if self.folder is not None and not Path(self.folder).is_dir():
            raise FileNotFoundError(f"data folder {self.folder} does not exist")
        if not 0 <= self.single_share <= 1:
            raise ValueError(f"single_share must be in [0, 1], got {self.single_share}")
        if not 0 <= self.colourless_share <= 1:
            raise ValueError(f"colourless_share must be in [0, 1], got {self.colourless_share}")
        check_and_order(self.and_order)
        if not 0 <= self.caption_dropout < 1:
            raise ValueError(f"caption_dropout must be in [0, 1), got {self.caption_dropout}")

    @property
    def fresh(self) -> bool:
        """Whether every batch draws new scenes (no dataset folder, no fixed set): only those come with masks."""
        return self.folder is None and not self.num_samples


@dataclass
class DiffusionConfig:
    """How images are noised and the loss weighted: [diffusion]."""
    prediction_type: str = "v_prediction"  # or "epsilon"; an epsilon model cannot predict x0 at zero SNR
    zero_terminal_snr: bool = True  # rescale the schedule so t = T is pure noise, as sampling assumes
    min_snr_gamma: float = 5.0  # weight min(snr + 1, gamma) / (snr + 1) for v, min(snr, gamma) / snr for eps; 0: none
    # Which t each training image is noised to (`sample_timesteps`). Layout is decided only at the noisiest steps
    # (below t ~ 900 the noisy image already shows where each object is), which uniform t visits 10 % of the time.
    timestep_sampling: str = "uniform"  # or "layout-share"
    layout_share: float = 0.5  # layout-share: this share of t is drawn from the top `layout_fraction` of the schedule
    layout_fraction: float = 0.1  # the top tenth of 1000 steps: t in [900, 999]

    def check(self) -> None:
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {self.prediction_type!r}")
        if self.zero_terminal_snr and self.prediction_type == "epsilon":
            raise ValueError("zero_terminal_snr needs prediction_type 'v_prediction': noise cannot be predicted "
                             "from pure noise")
        check_non_negative("min_snr_gamma", self.min_snr_gamma)
        check_one_of("timestep_sampling", self.timestep_sampling, TIMESTEP_SAMPLING)
        for name in ("layout_share", "layout_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{_flag(name)} must be in (0, 1], got {getattr(self, name)}")


@dataclass
class LossConfig:
    """The attention terms added to the diffusion loss, each off at weight 0: [losses]."""
    # > 0: add this times the grounding loss (recipe.grounding_loss, TokenCompose's): each word that names an object
    # attends to that object's pixels in the drawn scene's masks (fresh scenes only: a dataset folder keeps none)
    grounding_weight: float = 0.0
    # > 0: add this times the pixel loss (recipe.pixel_grounding_loss, TokenCompose's): each pixel reads the words of
    # its own object and no other object's (fresh scenes only, like the token loss above)
    pixel_grounding_weight: float = 0.0
    # > 0: add this times recipe.key_separation_loss: in every cross-attention layer, a caption's two different colour
    # words are pushed apart where their Keys' cosine is above key_margin (the evaluation's target is 0.5)
    key_separation_weight: float = 0.0
    key_margin: float = 0.3

    def check(self) -> None:
        for name in ("grounding_weight", "pixel_grounding_weight", "key_separation_weight"):
            weight = getattr(self, name)
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"{_flag(name)} must be a finite number >= 0 (0: none), got {weight}")
        if not -1 <= self.key_margin < 1:
            raise ValueError(f"--key-margin is a cosine in [-1, 1), got {self.key_margin}")

    @property
    def grounded(self) -> tuple[str, ...]:
        """The terms on that train on the drawn scenes' object masks (the key term needs none)."""
        return tuple(name for name in ("grounding_weight", "pixel_grounding_weight") if getattr(self, name))


@dataclass
class OptimizerConfig:
    """The optimizer and its batch: [optimizer]."""
    batch_size: int = 32
    lr: float = 6e-4
    warmup: int = 100
    weight_decay: float = 0.01  # on weight matrices only: never on embeddings, norms or biases
    grad_clip: float = 1.0
    # "bf16": the forward passes under bfloat16 autocast; weights, gradients, optimizer, EMA and every loss term stay
    # float32. Faster on CPUs with bf16 instructions (0.78x the step on a 2-core AMD EPYC) and on GPUs
    precision: str = "fp32"
    # "adamw", or "muon": Muon on the hidden weight matrices, AdamW on the rest (unet/muon.py) (--optimizer)
    algorithm: str = field(default="adamw", metadata={"flat": "optimizer"})
    muon_momentum: float = 0.95
    # the RMS of a Muon matrix's update per unit of lr: 0.2 is AdamW's, so lr means the same on both (unet/muon.py)
    muon_update_rms: float = 0.2

    def check(self) -> None:
        check_positive("batch_size", self.batch_size)
        check_one_of("optimizer", self.algorithm, OPTIMIZERS)
        if not 0.0 <= self.muon_momentum < 1.0:
            raise ValueError(f"muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.muon_update_rms <= 0:
            raise ValueError(f"muon_update_rms must be > 0 (0.2 matches AdamW's update), got {self.muon_update_rms}")
        check_one_of("precision", self.precision, PRECISIONS)
        for name in ("lr", "weight_decay", "grad_clip"):
            check_non_negative(name, getattr(self, name))
        if self.lr == 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")


@dataclass
class ScheduleConfig:
    """How long the run is, the learning rate's course over it and the EMA: [schedule]."""
    steps: int = 3500
    lr_schedule: str = "constant"  # "constant" after warm-up (a resumed or extended run has no restart), "cosine"
    # (to min_lr at `steps`) or "cooldown" (constant, then linearly to min_lr over decay_steps from decay_start)
    min_lr: float = 1e-4  # end of the cosine and cooldown schedules
    decay_start: int = 0  # cooldown only: the step the decay begins at
    decay_steps: int = 0  # cooldown only: its length; then min_lr. Fixed in steps, so extending the run keeps it
    ema_decay: float = 0.999  # reached after a warm-up of (1 + step) / (10 + step)

    def check(self) -> None:
        check_positive("steps", self.steps)
        check_one_of("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if self.lr_schedule != "cooldown" and (self.decay_start or self.decay_steps):
            raise ValueError(f"--decay-start and --decay-steps apply only with --lr-schedule cooldown, not "
                             f"{self.lr_schedule}")
        for name in ("min_lr", "ema_decay"):
            check_non_negative(name, getattr(self, name))
        if self.ema_decay >= 1:
            raise ValueError(f"--ema-decay {self.ema_decay}: an EMA needs --ema-decay < 1 (at 1 it never moves)")


@dataclass
class RunConfig:
    """What the run writes while it trains, and its seed: [run]."""
    seed: int = 0
    sample_every: int = 500
    checkpoint_every: int = 250
    snapshot_every: int = 0  # > 0: keep the EMA pipeline every so many steps in OUT/snapshots (for scaling curves)
    layout_every: int = 0  # > 0: log the EMA model's layout response and paired test to OUT/layout.jsonl (seconds)
    layout_seeds: int = 1  # seeds per prompt of that paired test
    sample_prompts: list = field(default_factory=lambda: [
        "a red circle", "a blue square", "a green triangle", "a yellow circle on the left",
        "a red circle left of a blue square", "a green square above a yellow triangle",
        "a blue triangle and a red square", "a yellow square below a green circle"])

    def check(self) -> None:
        for name in ("checkpoint_every", "sample_every", "layout_seeds"):
            check_positive(name, getattr(self, name))
        for name in ("snapshot_every", "layout_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0: none), got {getattr(self, name)}")
        check_seed(self.seed, top=TRAIN_MAX_SEED)


# the sections of a recipe file, each the group of TrainConfig of the same name
GROUPS = {"model": ModelConfig, "text": TextConfig, "data": DataConfig, "diffusion": DiffusionConfig,
          "losses": LossConfig, "optimizer": OptimizerConfig, "schedule": ScheduleConfig, "run": RunConfig}


def flat_names(group) -> dict[str, str]:
    """{flat name (recipe key, flag, train_config.json key): field name} of a group's fields."""
    return {f.metadata.get("flat", f.name): f.name for f in dataclasses.fields(group)}


@dataclass
class TrainConfig:
    """Every setting of a training run: one group per recipe section, and the settings of one call. The defaults
    are the plain setting, no lesson on: a base for tests and studies, not a recipe. The models this project ships
    are made by recipe files (recipes/*.toml, read by unet/recipe_file.py)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    text: TextConfig = field(default_factory=TextConfig)
    data: DataConfig = field(default_factory=DataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    losses: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    run: RunConfig = field(default_factory=RunConfig)
    # settings of one call, never of a model: never in a recipe, and a --resume takes them from its command line
    out: str = "runs/train"
    resume: bool = False
    max_minutes: float = 0.0  # stop cleanly (checkpoint + pipeline) after this much wall time; 0 = no limit
    # > 0: draw the fresh scenes of the coming steps in this many worker processes while the model trains (the same
    # batches: each is a function of seed and step). On a GPU, drawing scenes in the loop leaves it idle; on a
    # 2-core CPU the workers would only take the training's core.
    data_workers: int = 0
    grown_from: str | None = None  # "RUN@STEP": the trained run this one continues with added parts (`grow`)
    # a trained pipeline (a folder or a shipped model's name) whose U-Net and text encoder this run starts from, at
    # step 0, with fresh optimizer moments and its own schedule: a second round on a model whose run folder is gone
    started_from: str | None = None

    @classmethod
    def from_flat(cls, **values) -> TrainConfig:
        """The config of flat settings (`lr=1e-3`, `optimizer="muon"`, `out=...`), the names of the flags, the
        recipe keys and train_config.json; the rest keep their defaults. TypeError naming an unknown one."""
        groups = {}
        for section, group in GROUPS.items():
            names = flat_names(group)
            groups[section] = group(**{names[key]: values.pop(key) for key in list(values) if key in names})
        unknown = sorted(set(values) - set(CALL_ONLY))
        if unknown:
            raise TypeError(f"unknown training setting{'s' * (len(unknown) > 1)} {', '.join(unknown)}")
        return cls(**groups, **values)

    def flat(self) -> dict:
        """Every setting by its flat name, groups in recipe order, then the call's: `from_flat` reads it back."""
        values = {}
        for section, group in GROUPS.items():
            part = getattr(self, section)
            values |= {key: getattr(part, name) for key, name in flat_names(group).items()}
        return values | {name: getattr(self, name) for name in CALL_ONLY}

    def replace(self, **changes) -> TrainConfig:
        """A copy with the flat settings `changes` changed (`dataclasses.replace` with flat names)."""
        return TrainConfig.from_flat(**{**self.flat(), **changes})

    def validate(self) -> None:
        """Raise (ValueError, FileNotFoundError, UsageError for the seed) naming the first bad setting: each group's
        own, then what a world can take, then the settings that depend on each other across groups."""
        for section in GROUPS:
            getattr(self, section).check()
        if self.data_workers < 0:
            raise ValueError(f"data_workers must be >= 0 (0: in the training loop), got {self.data_workers}")
        check_non_negative("max_minutes", self.max_minutes)
        self.check_world()  # before the checks it would explain: a scenes-64 run has no --num-samples to give
        for name in self.losses.grounded:
            if not self.data.fresh:
                raise ValueError(f"{_flag(name)} needs fresh scenes (no --data, --num-samples 0): the object masks "
                                 "it trains on are drawn with each batch, and a dataset folder keeps none")
        if self.schedule.lr_schedule == "cooldown" and not (self.schedule.decay_start >= self.optimizer.warmup
                                                             and self.schedule.decay_steps > 0):
            raise ValueError(f"--lr-schedule cooldown needs --decay-start at or after the warm-up "
                             f"({self.optimizer.warmup}) and --decay-steps > 0, got {self.schedule.decay_start} and "
                             f"{self.schedule.decay_steps}")
        if self.schedule.lr_schedule != "constant" and self.schedule.min_lr > self.optimizer.lr:
            raise ValueError(f"--min-lr {self.schedule.min_lr} is above --lr {self.optimizer.lr}: a decay must go "
                             "down")
        if self.text.clip is None and self.text.text_width % self.model.heads:
            raise ValueError(f"--text-width {self.text.text_width} must be a multiple of --heads {self.model.heads}")
        if 0 < self.data.num_samples < self.optimizer.batch_size:
            raise ValueError(f"--num-samples {self.data.num_samples} is smaller than --batch-size "
                             f"{self.optimizer.batch_size}: every batch would be short")

    def check_world(self) -> None:
        """ValueError for a setting a scenes-64 run cannot take. scenes-64's sampler has knobs for single_share,
        colourless_share and and_order; its other shares (positions, unsized groups, "one" for "a") keep
        `Scenes64Sampler`'s defaults. What only scenes-32 has is refused: a dataset folder or a fixed set of scenes,
        a frozen CLIP or an ablation text side (their vocabularies are scenes-32's) and the layout log (scenes-32's
        prompts and detector)."""
        if self.data.world != "scenes-64":
            return
        fresh = "a scenes-64 run draws fresh scenes every batch"
        own_text = "a scenes-64 run trains its own CLIP text encoder on the world's vocabulary"
        only_32 = (("--data", self.data.folder is not None, fresh), ("--num-samples", self.data.num_samples > 0, fresh),
                   ("--clip", self.text.clip is not None, own_text),
                   (f"--text-variant {self.text.text_variant}", self.text.text_variant != "clip", own_text),
                   ("--layout-every", self.run.layout_every > 0, "the layout log samples scenes-32's prompts"))
        for flag, given, why in only_32:
            if given:
                raise ValueError(f"{flag} is for world scenes-32 only: {why}")
        if self.text.max_length < CAPTION_TOKENS:
            raise ValueError(f"max_length {self.text.max_length} would cut the longest captions of world scenes-64 "
                             f"(\"{LONGEST_CAPTION}\" is {CAPTION_TOKENS} tokens with its start and end): give at "
                             f"least {CAPTION_TOKENS}")
        if self.model.size < 16:
            raise ValueError(f"size {self.model.size} is too small for world scenes-64: four big objects fit from "
                             f"16 px (its detector needs {IMAGE_SIZE})")


# the settings of one call (TrainConfig's fields that are not a group), never in a recipe
CALL_ONLY = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in GROUPS)


# The settings of two studies that did not ship, taken out of the code after commit RETIRED_AFTER (which still has
# them); their pages say what each measured. Run folders written before name them in train_config.json.
RETIRED_AFTER = "18e1cfd"
OVERLAP_LOSS = ("the overlap loss", "docs/experiments/why-the-second-object-goes-missing.md")
LOGIT_NORMAL = ("logit-normal timestep sampling", "docs/experiments/training-where-layout-is-decided.md")
RETIRED = {"overlap_weight": (0.0, OVERLAP_LOSS), "logit_mean": (1.0, LOGIT_NORMAL),
           "logit_std": (1.0, LOGIT_NORMAL)}  # {flat name: (the value at which it changed nothing, its study)}


def without_retired(saved: dict) -> dict:
    """A run folder's flat settings (train_config.json) without the `RETIRED` ones, each at the value at which it
    changed nothing: the run loads and resumes as before. A run that trained with a retired setting (any other
    value, or timestep_sampling "logit-normal") needs the code of RETIRED_AFTER: ValueError naming the setting,
    that commit and what to do."""
    used = [(f"{name} {value}", RETIRED[name][1]) for name, value in saved.items()
            if name in RETIRED and value != RETIRED[name][0]]
    if saved.get("timestep_sampling") == "logit-normal":
        used.insert(0, ("timestep_sampling logit-normal", LOGIT_NORMAL))
    if used:
        setting, (what, study) = used[0]
        raise ValueError(f"{setting}: this run trained with {what}, a study's code taken out after commit "
                         f"{RETIRED_AFTER} ({study}); resume or load it in a checkout of that commit "
                         f"(git worktree add ../crossattn-{RETIRED_AFTER} {RETIRED_AFTER})")
    return {name: value for name, value in saved.items() if name not in RETIRED}
