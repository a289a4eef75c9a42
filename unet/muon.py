"""Muon for the weight matrices, AdamW for everything else, in one optimizer.

Muon (Keller Jordan, 2024) keeps a momentum of each weight matrix's gradient and steps along that momentum made
orthogonal: the same update with every singular value near 1, so no direction of the matrix is starved while a few
large ones take the whole step. In modded-nanogpt it needed about 1/1.5 of AdamW's tokens for the same loss.

`torch.optim.Muon` takes 2-D weights only. A U-Net's matrices are mostly convolutions, (out, in, kh, kw), so here
each is orthogonalised as the (out, in * kh * kw) matrix it multiplies with, as airbench does. Embeddings, norms,
biases and the layers that read or write pixels stay with AdamW (modded-nanogpt keeps its embedding and head on
Adam as well). One optimizer, so a checkpoint stores its moments like AdamW's: by parameter id.

The step length of a Muon matrix is scaled to the RMS AdamW's update has, 0.2 * sqrt(max(out, in)) (Moonshot's
"match_rms_adamw", `torch.optim.Muon`'s adjust_lr_fn): the recipe's lr and weight decay mean the same for both.
`update_rms` is that 0.2: a larger one steps the matrices faster while the rest keeps AdamW's rate.
"""

from __future__ import annotations

import math

import torch

# Newton-Schulz quintic coefficients of torch.optim.Muon and KellerJordan/Muon: steepest at 0, so 5 steps suffice
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def orthogonalise(matrix: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """About U V^T of matrix = U S V^T (singular values land in roughly [0.5, 1.5], which trains as well)."""
    a, b, c = NS_COEFFICIENTS
    x = matrix.T if matrix.shape[0] > matrix.shape[1] else matrix  # (short, long): the Gram matrix is the small one
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T  # (short, short)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if matrix.shape[0] > matrix.shape[1] else x


def is_muon_matrix(name: str, param: torch.Tensor) -> bool:
    """A hidden weight matrix: 2-D or a convolution, not an embedding table and not the U-Net's pixel layers."""
    return param.dim() >= 2 and "embedding" not in name and not name.startswith(("unet.conv_in.", "unet.conv_out."))


class MuonAdamW(torch.optim.Optimizer):
    """Param groups with `muon=True` step by Muon (momentum, nesterov), the others by AdamW (betas, eps). Both decay
    their weights decoupled, by lr * weight_decay, as torch's AdamW does."""

    def __init__(self, groups: list[dict], lr: float, momentum: float = 0.95, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, ns_steps: int = 5, update_rms: float = 0.2):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon's momentum must be in [0, 1), got {momentum}")
        super().__init__(groups, dict(lr=lr, momentum=momentum, betas=betas, eps=eps, weight_decay=weight_decay,
                                      ns_steps=ns_steps, update_rms=update_rms, muon=False))

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:  # a checkpoint saved before update_rms existed stepped with 0.2
            group.setdefault("update_rms", 0.2)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, weight_decay = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                p.mul_(1 - lr * weight_decay)
                if group["muon"]:
                    grad = p.grad.reshape(len(p), -1)  # (out, in * kh * kw)
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(grad)
                    buf = state["momentum_buffer"]
                    buf.lerp_(grad, 1 - group["momentum"])
                    update = orthogonalise(grad.lerp(buf, group["momentum"]), group["ns_steps"])  # nesterov
                    p.add_(update.view_as(p), alpha=-lr * group["update_rms"] * math.sqrt(max(grad.shape)))
                else:
                    if not state:
                        state["step"] = torch.tensor(0.0)
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    beta1, beta2 = group["betas"]
                    state["step"] += 1
                    step = state["step"].item()
                    state["exp_avg"].lerp_(p.grad, 1 - beta1)
                    state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                    denom = (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1 ** step))
        return loss
