"""Starting things: the `ucm-serve` command and `ucm-serve up` / `serve` on one machine, or on Ray (launch/ray/).

cli.py          `ucm-serve` dispatcher: each subcommand lives in the package that owns it
launcher.py     `up` / `serve`: flags, topology, the cluster, supervision
cluster.py      ClusterSpec → store daemon, nodes and router as child processes on fixed addresses
child.py        one child process: start, log tail, wait for a line, stop
supervisor.py   restarts children that exit, with backoff
topology.py     how many prefill/decode nodes this host should run, and why
model_prep.py   `--model` spec → a ready local folder (GGUF converted once, with progress)
ray/            the same cluster as Ray actors: placement, restarts, scale, status
"""
