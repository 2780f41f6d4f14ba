"""Token ids → text deltas for one choice, with stop strings (which the router, not the nodes, applies).

The implementation is the engine's torch-free `engine/incremental_decode.py` (one detokenizer for both): linear
in the output's length, never a broken UTF-8 character in a delta, the whole text equal to decoding all the
output ids at once. The router primes it with no prompt tokens: a choice's text is its output ids' own decode
(what the router's clients and tests compare against), and `include_stop_str_in_output` comes from the body.
"""

from __future__ import annotations

from engine.incremental_decode import Delta, TextDecoder
from engine.incremental_decode import IncrementalDecoder as IncrementalDetokenizer

__all__ = ["Delta", "IncrementalDetokenizer", "TextDecoder"]
