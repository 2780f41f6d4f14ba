"""`ucm-serve up --ray`: the same deployment as `ucm-serve up` (store daemon, prefill and decode nodes, router), its
pieces placed, restarted and scaled by Ray across the hosts of a Ray cluster (docs/deploy.md).

    spec.py        DeploymentSpec, NodeKind, ActorRole: what to deploy (ray-free: the launcher's parser uses it)
    options.py     the `--ray` flags `up` adds, and the spec built from `up`'s arguments (ray-free)
    keys.py        CURVE key material: generated once, each actor gets only the files it needs
    actors.py      NodeActor / StoreActor (each runs our process entry point as its child) and RouterActor
    placement.py   where each actor may run (store on a disk host, nodes spread), the bind host
    controller.py  the named controller actor: deploys, scales (drains), reports, shuts down
    status.py      DeploymentStatus and its table
    deploy.py      the Python API the CLI and the tests use (connect, deploy, find, RayDeployment)
    cli.py         `up --ray`, `ucm-serve scale`, `ucm-serve status`, `ucm-serve down`

Only this package imports ray, and only when a Ray path is taken: Ray is the optional extra `ucm-serve[ray]`.
"""
