"""Attention in four steps, on one head: 32 token embeddings, Values four wide.

    python scripts/attention_walkthrough.py [--tokens 32] [--dim 16] [--seed 0] [--out outputs/walkthrough]

Prints each step with its shapes, token 0's weights and context vector, checks it against
crossattn.CrossAttention, and saves a figure of the weights and each Value's contribution.
"""

import argparse
import sys
from pathlib import Path

from crossattn.errors import usage_error
from crossattn.walkthrough import describe, figure, walk


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32, help="sequence length (default 32)")
    p.add_argument("--dim", type=int, default=16, help="embedding width (default 16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token", type=int, default=0, help="the query token to explain (default 0)")
    p.add_argument("--out", default="outputs/walkthrough", help="folder for the figure")
    args = p.parse_args(argv)
    try:
        w = walk(args.tokens, args.dim, 4, args.seed)
        if not 0 <= args.token < args.tokens:
            raise ValueError(f"--token must be in [0, {args.tokens - 1}], got {args.token}")
    except ValueError as e:
        return usage_error(e)
    print("\n".join(describe(w, args.token)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    figure(w, out / "four_steps.png", args.token)
    print(f"figure: {out / 'four_steps.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
