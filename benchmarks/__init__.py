"""Benchmarks: scripts, not tests. Run each as a module from the repository root, e.g.

    .venv/bin/python -m benchmarks.kernels [--quick]

Modules, not `python benchmarks/<x>.py`: a script's own folder comes first on sys.path, where
benchmarks/kernels.py would shadow the `ucm_kernels` package.
"""
