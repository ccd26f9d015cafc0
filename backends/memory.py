"""How much memory a new allocation may take, so that a size that cannot fit is refused in one line before
the allocation is tried (an oversized llama.cpp context spent a minute in the kernel before failing)."""

from __future__ import annotations

import os


def host_available_bytes() -> int | None:
    """Host memory free for new allocations (bytes): ``MemAvailable`` of ``/proc/meminfo``, else the free
    physical pages (``sysconf``); None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def available_bytes(device) -> int | None:
    """Memory free for new tensors on ``device`` (a ``torch.device``; bytes): CUDA's free memory, else
    :func:`host_available_bytes`."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes()
