"""The project's on-disk cache root, in the lowest layer so every layer may import it.

`ucm_kernels/` (which imports nothing of ours) caches its compiled library here and `engine.model_source`
(torch-free, used by the launcher) its converted models; both import this stdlib-only module (platformdirs
aside), so the rule lives once.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_DIR_ENV = "UCM_CACHE_DIR"


def cache_dir() -> Path:
    """Root of ucm-serve's on-disk cache (`UCM_CACHE_DIR` overrides the platform's user cache dir)."""
    override = os.environ.get(CACHE_DIR_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("ucm-serve"))
