"""The machine a bench's figures come from, as its JSON names it: the GPU's name, else the CPU and its cores."""

from __future__ import annotations

import os
import platform


def machine() -> str:
    try:
        # deferred: the CLI imports every bench module to build its parser (`tailspec --help` loads no torch)
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:
        pass

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
