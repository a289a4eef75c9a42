"""Growing a trained run: new parts (position embeddings, pooled text, self-attention, side hints) added to a
trained model so that it still computes what it did, with everything else carried over by name.

`train.py --grow-from RUN` continues RUN in a new folder this way: the same step, batches and random streams,
so the grown run pairs step for step with the one it came from. `--grow-from` is a research tool (the levers were
measured with it): no recipe grows a run.
"""

from __future__ import annotations

from pathlib import Path

import torch

# Parameters a resumed run may lack in its checkpoint: the parts `grow` can add to a trained model without
# changing what it computes (position embeddings, the pooled text projection and the side hints of
# `--text-variant side-hints` start at zero, a new self-attention's output projection is zeroed).
GROWABLE = (".position.", ".pooled_text_proj.", ".attn1.", ".norm1.", ".side_hint.")


def grow(module: torch.nn.Module, loaded: set[str], prefix: str) -> list[str]:
    """Make the parameters of `module` that the checkpoint lacked (`loaded`: the names it had) start at identity.

    Returns their names. A position embedding is zero from its constructor; a new self-attention's output
    projection is zeroed here, so the block adds nothing until training finds a use for it (as ControlNet's
    zero convolutions do). Any other missing parameter is an error: it would start from random weights.
    """
    new = [n for n, _ in module.named_parameters() if f"{prefix}.{n}" not in loaded]
    wrong = [n for n in new if not any(g in f".{n}" for g in GROWABLE)]
    if wrong:
        raise ValueError(f"the checkpoint lacks {len(wrong)} weights of this model (e.g. {prefix}.{wrong[0]}) that "
                         "cannot start at identity: it was made for another architecture; only position "
                         "embeddings, pooled text, self-attention and side hints can be added to a trained run")
    for name, sub in module.named_modules():
        if name.endswith("attn1") and f"{prefix}.{name}.to_out.0.weight" not in loaded:
            torch.nn.init.zeros_(sub.to_out[0].weight)
            torch.nn.init.zeros_(sub.to_out[0].bias)
    return new


def load_weights(module: torch.nn.Module, tensors: dict, prefix: str, path: Path) -> list[str]:
    """Load `module` from the checkpoint tensors named `prefix.*`, growing the parts it lacks (`grow`); returns
    their names. ValueError for any other missing or unexpected weight: a checkpoint of another model."""
    new = grow(module, set(tensors), prefix)
    missing, unexpected = module.load_state_dict(
        {k[len(prefix) + 1:]: v for k, v in tensors.items() if k.startswith(prefix + ".")}, strict=False)
    if set(missing) - set(new):
        raise ValueError(f"{path} lacks {prefix}.{sorted(set(missing) - set(new))[0]}: it is not a checkpoint of "
                         "this model")
    if unexpected:
        raise ValueError(f"{path} holds weights this model lacks (e.g. {prefix}.{unexpected[0]}): its "
                         "train_config.json does not describe the checkpoint's architecture")
    return new


def remap_moments(optimizer: torch.optim.Optimizer, param_names: list[str], tensors: dict) -> None:
    """Load the checkpoint's optimizer moments into `optimizer`, whose parameters are named `param_names` (in
    `build_optimizer`'s order). The checkpoint's ids are that order without the grown parameters (they are only
    ever added), so the moments are mapped through the names; a grown parameter starts with none."""
    saved_names = [n for n in param_names if n in tensors]
    state = optimizer.state_dict()
    for saved_pid, name in enumerate(saved_names):
        keys = [k for k in tensors if k.startswith(f"opt.{saved_pid}.")]
        if keys:
            state["state"][param_names.index(name)] = {k.split(".", 2)[2]: tensors[k] for k in keys}
    optimizer.load_state_dict(state)
