"""Export a pipeline folder's text encoder and U-Net (with its cross-attention probabilities) to ONNX.

    python scripts/export_onnx.py --out exported            # the shipped model
    python scripts/export_onnx.py --model runs/x/pipeline --out exported

What the folder holds: unet/onnx_export.py. The live page's build (scripts/build_live.py) runs this itself.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..onnx_export import export_onnx, load_exportable
from . import UsageError, add_model_argument, check_out_dir, interrupted, sigterm_as_interrupt, usage_error


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="export_onnx.py", description="Export a pipeline folder's text encoder and "
                                "U-Net to ONNX, the U-Net's cross-attention probabilities as extra outputs.")
    add_model_argument(p)
    p.add_argument("--out", required=True, help="folder to write (refused if it exists, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="write into an existing folder, replacing its files")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    with sigterm_as_interrupt():
        try:
            check_out_dir(args.out)
            if out.exists() and not args.overwrite:
                raise UsageError(f"{out} exists; pass --overwrite to write into it")
            pipe = load_exportable(args.model)
            live = export_onnx(args.model, out, pipe)
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, f"{out} may hold a partial export")
    print(f"{out}: text_encoder.onnx, unet.onnx ({len(live['layers'])} cross-attention layers as attention_0.."
          f"{len(live['layers']) - 1}), scheduler_config.json, tokenizer/, live.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
