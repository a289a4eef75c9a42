"""Research tools, not part of what ships: the questions asked of the model while it was being built.

- `levers`: paired runs' full evaluations as one table and learning curves;
- `diagnose`: what sampling settings do to colour and background (first step, grain, the unconditional model);
- `ablation`: train a text-side ablation (unet/text_variants.py) with an existing run's recipe.

Each has a `main(argv)`; `scripts/levers.py`, `scripts/diagnose.py` and `scripts/ablation.py` start them.
"""
