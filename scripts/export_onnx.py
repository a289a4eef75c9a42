"""Export a pipeline folder to ONNX (text encoder; U-Net with its attention): `python scripts/export_onnx.py --help`.

The code is unet/cli/export_onnx.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.export_onnx"))
