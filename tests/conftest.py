"""Session-wide test setup.

Without CUDA, Triton kernels run under Triton's interpreter. The setting is read once, when triton is
first used in the process, so it must be in place before any test module imports torch code that
touches triton — hence here, before collection, rather than in the Triton test module.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
