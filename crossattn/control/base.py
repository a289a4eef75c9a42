"""What every control recipe is: a small object the `Controller` asks at each attention call and
around each scheduler step, as prompt-to-prompt's `AttentionControl` subclasses are."""

from __future__ import annotations

import torch


def check_share(name: str, value: float) -> None:
    """Raise ValueError unless `value` is a share of the run in [0, 1]."""
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a share of the run in [0, 1], got {value!r}")


class Recipe:
    """One way to control a run. Every method has a do-nothing default; a recipe overrides what it uses.

    `ctl` is the `Controller` calling: it knows the layer being run, the timestep (`ctl.key(name)`), and
    whether attend-and-excite's own forward passes are running (`ctl.hiding`).
    """

    def start(self) -> None:
        """A new sampling run begins: forget what the last one gathered."""

    def weights(self, ctl, name: str, cross: bool, progress: float, own: torch.Tensor,
                new: torch.Tensor) -> torch.Tensor:
        """The prompt half's weights (B, heads, N, T) of layer `name`, as the model computed them (`own`)
        and as the recipes before this one left them (`new`) -> the weights to pass on."""
        return new

    def before_step(self, ctl, pipe, t, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """The latent (B, C, H, W) before the model sees it at timestep `t` -> the latent to use."""
        return x

    def after_step(self, ctl, pipe, t, x: torch.Tensor) -> torch.Tensor:
        """The latent after the scheduler step at timestep `t` -> the latent to keep."""
        return x
