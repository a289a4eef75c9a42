"""Memory rules: refuse a run that cannot fit before it starts, with the size it would need."""

from __future__ import annotations

import math
import os
import re
import resource
from pathlib import Path

import torch

from crossattn.capture import AttentionStore
from crossattn.errors import usage_error

from ..pipeline import ScenePipeline, Settings, default_guidance, default_size, size_multiple


def _meminfo(path: str, key: str) -> int | None:
    """A `key: N kB` line of /proc/meminfo or /proc/self/status, in bytes; None where there is none."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _address_space_left() -> int | None:
    """Bytes this process may still map under its address-space limit (`ulimit -v`); None when unlimited."""
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit == resource.RLIM_INFINITY:
        return None
    return max(0, limit - (_meminfo("/proc/self/status", "VmSize") or 0))


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a run on `device`: free GPU memory, or the machine's available RAM (less, under an
    address-space limit, what that limit leaves this process); None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    free = _meminfo("/proc/meminfo", "MemAvailable")
    if free is None:
        try:
            free = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = None
    left = _address_space_left()
    return left if free is None else free if left is None else min(free, left)


# what running out of memory raises: torch's CPU allocator raises a plain RuntimeError ("can't allocate memory")
MEMORY_ERRORS = (MemoryError, torch.OutOfMemoryError, RuntimeError)


def out_of_memory(e: BaseException, settings: Settings) -> int:
    """Report an allocation that failed despite the estimate in one line (exit code 2); re-raise other errors."""
    message = str(e)
    if not isinstance(e, (MemoryError, torch.OutOfMemoryError)) and "allocate" not in message:
        raise e
    size = f"{settings.height}x{settings.width}" if settings.height and settings.width else "at the model's size"
    wanted = re.search(r"allocate (\d+) bytes", message)
    detail = f" ({int(wanted.group(1)) / 2**30:.1f} GiB at once)" if wanted else ""
    return usage_error(f"ran out of memory while sampling {size}, {settings.num_images} image(s){detail}; "
                       "nothing was written: use a smaller size or fewer images")


def _level(name: str, levels: int) -> int:
    """How many times the U-Net halved the input before the module `name` (ours: down.i / mid_attn / up.j;
    diffusers: down_blocks.i / mid_block / up_blocks.j); 0, the largest, when the name says nothing."""
    found = re.match(r"(down|up)[a-z_]*\.(\d+)\.", name)
    if found:
        index = int(found.group(2))
        return index if found.group(1) == "down" else levels - 1 - index
    return levels - 1 if name.startswith("mid") else 0


def memory_estimate(pipe, settings: Settings) -> int:
    """Rough bytes a run needs beyond the weights, to refuse sizes that cannot fit: the attention weights
    capture makes explicit (scores and softmax of the largest layer at once, 2 images per prompt under
    guidance), the store's running sums (per layer and timestep window), and full-size activations."""
    factor = 1 if isinstance(pipe, ScenePipeline) else size_multiple(pipe)
    height = (settings.height or default_size(pipe)) // factor
    width = (settings.width or default_size(pipe)) // factor
    guidance = default_guidance(pipe) if settings.guidance is None else settings.guidance
    per_pass = settings.num_images * (2 if guidance > 1 else 1)
    windows = min(settings.steps, AttentionStore.for_pipeline(pipe).windows)
    config = pipe.unet.config
    levels = len(getattr(config, "channels", None) or config.block_out_channels)
    biggest = sums = 0
    for name, module in pipe.unet.named_modules():
        heads, cross = vars(module).get("heads"), vars(module).get("is_cross_attention")  # ours and diffusers
        if not isinstance(heads, int) or cross is None or not (cross or settings.self_attention):
            continue  # not attention, or self-attention left to the fused kernel (no weights kept)
        k = _level(name, levels)
        queries = math.ceil(height / 2 ** k) * math.ceil(width / 2 ** k)
        keys = pipe.tokenizer.model_max_length if cross else queries
        one_image = heads * queries * keys * 4  # float32 (heads, N, keys)
        biggest = max(biggest, 2 * per_pass * one_image)
        sums += windows * settings.num_images * one_image
    first = (getattr(config, "channels", None) or config.block_out_channels)[0]
    activations = 8 * per_pass * first * height * width * 4  # a few full-size feature maps alive at once
    return biggest + sums + activations
