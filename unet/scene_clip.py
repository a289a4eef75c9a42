"""A CLIP of our own: trained contrastively on the scenes, then frozen as the U-Net's text side, as Stable
Diffusion freezes OpenAI's CLIP.

The text encoder trained jointly with the U-Net merges words the denoising loss has no use for keeping apart:
"red" and "blue" get the same hidden state after its first layer, so their Keys, and so their maps, cannot
differ (docs/experiments/a-text-side-whose-words-stay-apart.md). A contrastive image-text loss does need them
apart: it must tell "a red circle left of a blue square" from "a blue circle left of a red square" in the
same image. So each image is scored against its caption, the batch's other captions, and hard negatives that
swap its colours, its shapes or its relation (NegCLIP; the "What'sUp" benchmark's relation swaps).

That loss reads only the end token. The cross-attention reads every token, so `token_loss` adds a second score
that reads them all (FILIP, Yao et al. 2021): each word's state is matched to its best image patch, and a
caption's score is the mean over its words. To score "a red circle" high and "a green circle" low on a red
circle, "red" must point at red patches and "green" must not: the words' own states must differ.

The model is transformers' `CLIPModel`: our tokenizer and a `CLIPTextModel` the size of the U-Net's text side,
and a small vision tower on the 32-px scenes. `train.py --clip OUT/text` then trains a U-Net on the frozen
text encoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

from crossattn.errors import check_number

from .data import COLORS, SHAPES, SceneSampler, scenes_to_tensor, to_model_range
from .pipeline import check_seed
from .signals import DeferredSignals

# each word and the word a hard negative puts in its place
OPPOSITES = {"left of": "right of", "right of": "left of", "above": "below", "below": "above",
             "on the left": "on the right", "on the right": "on the left", "on the top": "on the bottom",
             "on the bottom": "on the top"}
NEGATIVE_KINDS = ("relation", "colours", "shapes")
# the longest caption the scenes have (a pair with colours and a two-word relation): one token per word, plus the
# start and end tokens; a shorter max_length would train on captions cut before their colour and shape words
LONGEST_CAPTION = "a yellow triangle right of a green square"
CAPTION_TOKENS = len(LONGEST_CAPTION.split()) + 2
EVAL_STREAM = 2**31  # the evaluation's scenes: a random stream no training step (0, 1, 2 ...) draws


@dataclass
class SceneClipConfig:
    out: str = "runs/scene-clip"
    steps: int = 3000
    batch_size: int = 64
    lr: float = 5e-4
    warmup: int = 100
    weight_decay: float = 0.1
    size: int = 32
    patch_size: int = 4
    text_width: int = 128  # the U-Net's text side: its Keys and Values read this width
    text_layers: int = 3
    vision_width: int = 128
    vision_layers: int = 3
    heads: int = 4
    max_length: int = 32
    seed: int = 0
    eval_scenes: int = 512
    token_loss: float = 0.0  # weight of the word-to-patch score's loss beside the end token's (0: end token only)

    def validate(self) -> None:
        for name in ("steps", "batch_size", "size", "patch_size", "text_width", "text_layers", "vision_width",
                     "vision_layers", "heads", "max_length", "eval_scenes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size < 2:
            raise ValueError(f"batch_size must be >= 2 for a contrastive loss, got {self.batch_size}")
        if self.size % self.patch_size:
            raise ValueError(f"size {self.size} is not a multiple of patch_size {self.patch_size}")
        for name, width in (("text_width", self.text_width), ("vision_width", self.vision_width)):
            if width % self.heads:
                raise ValueError(f"{name} {width} is not a multiple of heads {self.heads}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        check_number("--lr", self.lr, 1e-8, 1.0)  # 0 would not train; above 1 AdamW's steps are larger than weights
        check_number("--weight-decay", self.weight_decay, 0.0, 1.0)
        check_number("--token-loss", self.token_loss, 0.0, 1000.0, " (0 turns it off)")
        check_seed(self.seed)
        if self.max_length < CAPTION_TOKENS:
            raise ValueError(f"--max-length {self.max_length} would cut the scenes' longest captions before their "
                             f"colour and shape words (\"{LONGEST_CAPTION}\" is {CAPTION_TOKENS} tokens with its "
                             f"start and end): give at least {CAPTION_TOKENS}")


def hard_negatives(caption: str, rng: np.random.Generator) -> dict[str, str]:
    """Captions of other scenes that differ from `caption` in one thing, by kind (`NEGATIVE_KINDS`): the opposite
    position word; the two colours swapped (one object: another colour); the two shapes swapped (one object:
    another shape). A kind with no such caption is left out ("a circle and a circle" has none)."""
    words, found = caption.split(), {}
    padded = f" {caption} "  # whole words only: " left of " is not in "a circle on the left"
    for word, opposite in OPPOSITES.items():
        if f" {word} " in padded:
            found["relation"] = padded.replace(f" {word} ", f" {opposite} ", 1).strip()
            break
    for kind, names in (("colours", list(COLORS)), ("shapes", list(SHAPES))):
        at = [i for i, w in enumerate(words) if w in names]
        swapped = list(words)
        if len(at) == 2 and words[at[0]] != words[at[1]]:
            swapped[at[0]], swapped[at[1]] = words[at[1]], words[at[0]]
        elif len(at) == 1:
            swapped[at[0]] = str(rng.choice([n for n in names if n != words[at[0]]]))
        else:
            continue
        found[kind] = " ".join(swapped)
    return found


def new_scene_clip(tokenizer: CLIPTokenizer, cfg: SceneClipConfig) -> CLIPModel:
    """A randomly initialised CLIPModel: our vocabulary, a causal text encoder as the U-Net's, a ViT on the scenes."""
    text = dict(vocab_size=len(tokenizer), hidden_size=cfg.text_width, intermediate_size=4 * cfg.text_width,
                num_hidden_layers=cfg.text_layers, num_attention_heads=cfg.heads,
                max_position_embeddings=cfg.max_length,
                # CLIP's defaults (49406/49407) lie outside a small vocabulary and would pool the wrong token
                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)
    vision = dict(hidden_size=cfg.vision_width, intermediate_size=4 * cfg.vision_width,
                  num_hidden_layers=cfg.vision_layers, num_attention_heads=cfg.heads, image_size=cfg.size,
                  patch_size=cfg.patch_size, num_channels=3)
    return CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=cfg.text_width))


def draw_batch(cfg: SceneClipConfig, step: int, split: str = "train"):
    """The scenes of one step, from the step alone (so a run's batches never depend on what ran before):
    (B, 3, H, W) images in model range, their captions, and each caption's hard negatives."""
    sampler = SceneSampler((cfg.seed, step), cfg.size, cfg.size, split=split)
    scenes = [sampler() for _ in range(cfg.batch_size)]
    captions = [s.caption for s in scenes]
    negatives = [hard_negatives(c, sampler.rng) for c in captions]
    return to_model_range(scenes_to_tensor(scenes)), captions, negatives


def tokenize(tokenizer: CLIPTokenizer, texts: list[str], device):
    """The texts padded to the longest, as both towers' scores read them (input_ids, attention_mask)."""
    return tokenizer(texts, padding=True, truncation=True, max_length=tokenizer.model_max_length,
                     return_tensors="pt").to(device)


def embed_texts(model: CLIPModel, tokenizer: CLIPTokenizer, texts: list[str], device) -> torch.Tensor:
    """(N, projection_dim) unit text embeddings, pooled at each caption's end token as CLIP does."""
    ids = tokenize(tokenizer, texts, device).input_ids
    return F.normalize(model.get_text_features(input_ids=ids).pooler_output, dim=-1)


def embed_images(model: CLIPModel, images: torch.Tensor) -> torch.Tensor:
    """(B, projection_dim) unit image embeddings."""
    return F.normalize(model.get_image_features(pixel_values=images).pooler_output, dim=-1)


def encode(model: CLIPModel, tokenizer: CLIPTokenizer, texts: list[str], images: torch.Tensor):
    """Both towers once: the tokenized texts, and transformers' text and image outputs, whose `pooler_output` is
    the projected embedding and whose `last_hidden_state` holds every token and patch."""
    batch = tokenize(tokenizer, texts, images.device)
    return batch, model.get_text_features(input_ids=batch.input_ids), model.get_image_features(pixel_values=images)


def word_and_patch_features(model: CLIPModel, tokenizer: CLIPTokenizer, batch, text, image):
    """From `encode`'s outputs: unit features of every token (M, T, D), which of them are words (M, T; not the
    start or end token or padding), and unit features of every image patch (B, P, D), each through its tower's
    projection as CLIP's pooled ones."""
    ids = batch.input_ids
    words = batch.attention_mask.bool() & (ids != tokenizer.bos_token_id) & (ids != tokenizer.eos_token_id)
    tokens = model.text_projection(text.last_hidden_state)  # (M, T, D)
    patches = image.last_hidden_state[:, 1:]  # (B, P, width): not the class token
    patches = model.visual_projection(model.vision_model.post_layernorm(patches))  # (B, P, D)
    return F.normalize(tokens, dim=-1), words, F.normalize(patches, dim=-1)


def word_to_patch_scores(tokens: torch.Tensor, words: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
    """(B, M): for each image and text, the mean over the text's words of the word's cosine with its best patch."""
    best = torch.einsum("bpd,mtd->bmtp", patches, tokens).amax(dim=-1)  # (B, M, T)
    words = words.to(best.dtype)
    return (best * words).sum(-1) / words.sum(-1).clamp(min=1)


def contrastive_loss(model: CLIPModel, tokenizer: CLIPTokenizer, images: torch.Tensor, captions: list[str],
                     negatives: list[dict[str, str]], token_loss: float = 0.0) -> torch.Tensor:
    """CLIP's symmetric InfoNCE, with every hard negative as one more caption each image must rank below its own;
    plus, weighted by `token_loss`, the same loss on `word_to_patch_scores`."""
    texts = captions + [n for found in negatives for n in found.values()]
    batch, text_out, image_out = encode(model, tokenizer, texts, images)
    text = F.normalize(text_out.pooler_output, dim=-1)  # (B + N, D)
    image = F.normalize(image_out.pooler_output, dim=-1)  # (B, D)
    scale = model.logit_scale.exp().clamp(max=100)
    loss = info_nce(scale * image @ text.T, captions, texts)
    if token_loss > 0:  # the same forward passes: every token and patch, not only the pooled ones
        features = word_and_patch_features(model, tokenizer, batch, text_out, image_out)
        scores = word_to_patch_scores(*features)  # (B, B + N)
        loss = loss + token_loss * info_nce(scale * scores, captions, texts)
    return loss


def info_nce(image_to_text: torch.Tensor, captions: list[str], texts: list[str]) -> torch.Tensor:
    """Symmetric InfoNCE on (B, B + N) scores of each image against `texts` (its batch's captions, then negatives).

    Captions repeat within a batch ("a circle"), so the target of an image is every column whose caption is its
    own (`caption_targets`), not only its index: a repeat is not a negative."""
    text_to_image = image_to_text[:, :len(captions)].T  # (B, B): each caption against the batch's images
    targets = caption_targets(captions, texts).to(image_to_text.device)
    loss_i = -(F.log_softmax(image_to_text, dim=1) * targets).sum(1).mean()
    targets_t = caption_targets(captions, captions).T.to(image_to_text.device)  # symmetric: rows as columns
    loss_t = -(F.log_softmax(text_to_image, dim=1) * targets_t).sum(1).mean()
    return (loss_i + loss_t) / 2


def caption_targets(captions: list[str], texts: list[str]) -> torch.Tensor:
    """(B, len(texts)): for each image (by its caption), an equal share of 1 over every text that is its caption."""
    same = torch.tensor([[t == c for t in texts] for c in captions], dtype=torch.float32)
    return same / same.sum(1, keepdim=True)


def lr_at(step: int, cfg: SceneClipConfig) -> float:
    """Linear warm-up, then cosine decay to a tenth."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def hard_negative_accuracy(model: CLIPModel, tokenizer: CLIPTokenizer, cfg: SceneClipConfig,
                           split: str = "eval") -> dict:
    """Per kind of hard negative: the share of `cfg.eval_scenes` scenes (held-out colour/shape pairs by default)
    whose image scores its own caption above the negative; 0.5 is chance. Also top-1 retrieval of the caption
    among the scenes' own captions (repeats count as right)."""
    model.eval()
    drawn = SceneSampler((cfg.seed, EVAL_STREAM), cfg.size, cfg.size, split=split)
    scenes = [drawn() for _ in range(cfg.eval_scenes)]
    captions = [s.caption for s in scenes]
    negatives = [hard_negatives(c, drawn.rng) for c in captions]
    device = next(model.parameters()).device
    image = embed_images(model, to_model_range(scenes_to_tensor(scenes)).to(device))
    own = (image * embed_texts(model, tokenizer, captions, device)).sum(-1)  # (N,)
    result = {"scenes": len(scenes), "split": split}
    for kind in NEGATIVE_KINDS:
        held = [i for i, n in enumerate(negatives) if kind in n]
        if held:
            other = (image[held] * embed_texts(model, tokenizer, [negatives[i][kind] for i in held], device)).sum(-1)
            result[kind] = {"accuracy": float((own[held] > other).float().mean()), "scenes": len(held)}
    unique = sorted(set(captions))
    best = (image @ embed_texts(model, tokenizer, unique, device).T).argmax(dim=1)
    result["retrieval_top1"] = float(np.mean([unique[b] == c for b, c in zip(best.tolist(), captions)]))
    return result


def train_scene_clip(cfg: SceneClipConfig, tokenizer: CLIPTokenizer, progress: bool = True,
                     log: list | None = None) -> tuple[CLIPModel, int, int | None]:
    """Train a new scene CLIP for `cfg.steps` steps of fresh scenes. Ctrl-C or SIGTERM ends training after the
    current step, so minutes of training are never thrown away. Returns the model, the steps done and the signal
    that stopped it (None when it ran to the end); `log` (if given) gets one (step, loss, lr) per step."""
    from tqdm.auto import tqdm
    torch.manual_seed(cfg.seed)
    model = new_scene_clip(tokenizer, cfg)
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2 and "embedding" not in n]  # matrices; not embeddings or norms
    rest = [p for n, p in named if all(p is not q for q in decay)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    model.train()
    step = 0
    with DeferredSignals() as held, tqdm(total=cfg.steps, disable=not progress, desc="training scene CLIP") as bar:
        while step < cfg.steps and held.signum is None:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, cfg)
            images, captions, negatives = draw_batch(cfg, step)
            loss = contrastive_loss(model, tokenizer, images, captions, negatives, cfg.token_loss)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"the loss is {loss.item()} at step {step + 1}; lower --lr")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            if log is not None:
                log.append((step, round(loss.item(), 5), lr_at(step - 1, cfg)))
            bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update(1)
        stopped_by, held.signum = held.signum, None  # taken here: the caller saves, then reports it
    model.eval()
    return model, step, stopped_by
