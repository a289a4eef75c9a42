"""unet: the image model, its synthetic data, the sampling pipeline and training; `unet.eval` measures
it and `unet.cli` holds the commands.

The pipeline's `model_index.json` names `unet.model.UNet`; importing it here lets
`ScenePipeline.from_pretrained(folder)` find it.
"""

from .model import UNet
from .pipeline import PRETRAINED, ScenePipeline, load_pipeline, make_scheduler

__all__ = ["PRETRAINED", "ScenePipeline", "UNet", "load_pipeline", "make_scheduler"]
