"""What every command shares: one `UsageError` and `usage_error`, interrupts, partial folders, and the
checks at the door (settings, prompt, output folder, memory; the seed rule is the pipeline's). Each
command is a module here with a `main(argv)`; `scripts/*.py` are one-line front ends over them."""

from crossattn.errors import UsageError, shorten, usage_error

from ..folders import (
    PARTIAL,
    check_out_dir,
    claim_folder,
    partial_folder,
    publish,
    publish_files,
    remove_stale_partials,
)
from ..pipeline import MAX_SEED, check_seed
from ..signals import Interrupted, interrupted, sigterm_as_interrupt
from .checks import add_model_argument, check_guidance, check_model_settings, check_prompt, check_settings
from .memory import available_memory, memory_estimate

__all__ = ["MAX_SEED", "PARTIAL", "Interrupted", "UsageError", "add_model_argument", "available_memory",
           "check_guidance", "check_model_settings", "check_out_dir", "check_prompt", "check_seed", "check_settings",
           "claim_folder", "interrupted", "memory_estimate", "partial_folder", "publish", "publish_files",
           "remove_stale_partials", "shorten", "sigterm_as_interrupt", "usage_error"]
