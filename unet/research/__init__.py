"""Research tools, not part of what ships: the questions asked of the model while it was being built.

- `levers`: paired runs' full evaluations as one table and learning curves;
- `diagnose`: what sampling settings do to colour and background (first step, grain, the unconditional model);
- `ablation`: train a text-side ablation with an existing run's recipe;
- `text_variants`: not a tool but those ablations' text sides (bidirectional, oracle, side hints), which training
  imports only for a run whose `--text-variant` is not "clip" (scripts/ablation.py, `train.py --grow-from RUN
  --text-variant side-hints`).

Each tool has a `main(argv)`; `scripts/levers.py`, `scripts/diagnose.py` and `scripts/ablation.py` start them.
"""
