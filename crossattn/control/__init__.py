"""Control sampling through the attention maps: re-weight words, replay a source prompt's attention
(prompt-to-prompt edits), attend-and-excite.

A `Controller` (controller.py) runs any of the recipes, one small class each on `base.Recipe`, and
attaches like `AttentionStore` (crossattn.hooks): on our `CrossAttention` layers through their
`controller` hook, on a diffusers `UNet2DConditionModel` as `ControlProcessor`s. The attention layers
hand it their softmax weights (B, heads, N, T) and what it returns weighs the Values; the sampling
loop (`ScenePipeline.__call__(controller=...)`) calls `before_step` and `after_step` around each step.

- `Reweight` (reweight.py; Hertz et al. 2022, the "equalizer"): multiply chosen tokens' weights by a
  factor, in chosen layers and part of the run.
- `Record`, `Edit`, `LocalBlend` (edit.py; prompt-to-prompt): a `Recording` of a source run (attention
  per layer and timestep, latents) is replayed while an edited prompt is sampled from the same noise;
  local blend keeps the source's latent where neither prompt's edited words attend.
- `Excite` (excite.py; Chefer et al. 2023): gradient steps on the latent that raise the weakest
  subject's maximum attention.
- `align_prompts` (align.py) and `word_positions`, `parse_weights` (words.py) choose what to change.

Under classifier-free guidance only the prompt-conditioned half of the batch is changed or recorded,
as in prompt-to-prompt. "Steps" are shares of the run measured by the timestep: progress
`1 - (t + 1) / T` is 0 at pure noise, so a setting means the same at any number of steps and in any
pipeline that calls the U-Net with timesteps.
"""

from .align import Alignment, align_prompts
from .base import Recipe, check_share
from .controller import Controller, ControlProcessor
from .edit import SELF_REPLACE_MAX_QUERIES, Edit, LocalBlend, Record, Recording
from .excite import Excite, gaussian_smooth
from .reweight import MAX_FACTOR, Reweight, check_factor
from .words import parse_weights, word_positions

__all__ = ["MAX_FACTOR", "SELF_REPLACE_MAX_QUERIES", "Alignment", "ControlProcessor", "Controller", "Edit", "Excite",
           "LocalBlend", "Recipe", "Record", "Recording", "Reweight", "align_prompts", "check_factor", "check_share",
           "gaussian_smooth", "parse_weights", "word_positions"]
