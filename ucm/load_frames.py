"""A load reply's frames (one per block hit and layer, in order) copied into the caller's buffers."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import zmq

log = logging.getLogger("ucm.client")


def copy_frames(
    frames: Sequence[zmq.Frame], hits: Sequence[int], layers: Sequence[int], views: Sequence[Sequence[memoryview]]
) -> set[int]:
    """Copy frame (hit i, layer j) into views[i][j]; returns the blocks whose frame did not fit their buffer
    (failed, never half-counted as loaded). The caller checked len(frames) == len(hits) * len(layers)."""
    assert len(frames) == len(hits) * len(layers), f"{len(frames)} frames for {len(hits)} x {len(layers)}"
    failed: set[int] = set()
    frame_iter = iter(frames)
    for i in hits:
        for j in range(len(layers)):
            buf = next(frame_iter).buffer
            if len(buf) != len(views[i][j]):
                log.warning(
                    "load: block %d layer %d has %d bytes, dst holds %d", i, layers[j], len(buf), len(views[i][j])
                )
                failed.add(i)
            else:  # numpy releases the GIL while copying
                np.copyto(np.frombuffer(views[i][j], np.uint8), np.frombuffer(buf, np.uint8))
    return failed
