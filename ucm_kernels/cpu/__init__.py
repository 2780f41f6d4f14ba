"""The native CPU kernels (paged attention, write_kv, the fused elementwise ops): C sources built into one
library on first use (`native.py`), called through ctypes."""
