"""The native CPU attention kernel: C source built on first use (`native.py`), called through ctypes."""
