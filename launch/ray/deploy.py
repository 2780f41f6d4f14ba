"""The Python API behind `ucm-serve up --ray`, `scale`, `status` and `down` (the tests call it too).

connect(address)          join a Ray cluster ("auto": the running one) or start a local one (None)
deploy(spec) -> handle    create the named controller and the deployment; returns when every node registered
find(name) -> handle      the running deployment of that name (from any driver of the cluster)
"""

from __future__ import annotations

import os
from typing import Any

import ray

from launch.ray.controller import Controller
from launch.ray.keys import KeyBundle
from launch.ray.spec import DEFAULT_NAME, NAMESPACE, STORE_RESOURCE, DeploymentSpec, NodeKind
from launch.ray.status import DeploymentStatus

# A local Ray started for `up --ray` (no address): small, no dashboard. The store's custom resource is declared on
# it (this machine holds the store's disk).
_LOCAL_OBJECT_STORE_BYTES = 200 * 1024 * 1024


def connect(address: str | None, log_to_driver: bool = True) -> None:
    """Join the Ray cluster at `address` ("auto": the one running on this machine), or start a local one (None)."""
    if ray.is_initialized():
        return
    if address is None:
        # Enough CPUs for the default deployment on any machine: `up` runs the same processes on small hosts too.
        cpus = max(os.cpu_count() or 1, 3)
        ray.init(
            num_cpus=cpus,
            resources={STORE_RESOURCE: 1},
            include_dashboard=False,
            object_store_memory=_LOCAL_OBJECT_STORE_BYTES,
            log_to_driver=log_to_driver,
        )
    else:
        ray.init(address=address, log_to_driver=log_to_driver)


class RayDeployment:
    """A handle on a running deployment (its controller actor)."""

    def __init__(self, controller: Any, name: str) -> None:
        self.controller = controller
        self.name = name

    def status(self) -> DeploymentStatus:
        return ray.get(self.controller.status.remote())

    def scale(self, kind: NodeKind, delta: int, timeout_s: float = 600.0) -> list[str]:
        """Add (delta > 0) or drain and remove (delta < 0) nodes of `kind`; the node ids added or removed."""
        return ray.get(self.controller.scale.remote(kind, delta, timeout_s))

    def alive(self) -> bool:
        """False once the controller is gone (`ucm-serve down`, or killed)."""
        try:
            ray.get_actor(self.name, namespace=NAMESPACE)
        except ValueError:
            return False
        return True

    def handles(self) -> dict[str, Any]:
        return ray.get(self.controller.handles.remote())

    def shutdown(self) -> None:
        """Stop every actor in order; whatever does not stop in time dies with the controller (owned actors)."""
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            ray.get(self.controller.shutdown.remote(), timeout=120)
        except (RayActorError, GetTimeoutError):
            pass
        finally:
            ray.kill(self.controller, no_restart=True)


def find(name: str = DEFAULT_NAME) -> RayDeployment:
    """ValueError if no deployment of that name runs on the connected cluster."""
    try:
        controller = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        raise ValueError(f"no ucm-serve deployment named {name!r} on this Ray cluster (start one: up --ray)") from None
    return RayDeployment(controller, name)


def deploy(spec: DeploymentSpec, timeout_s: float = 600.0) -> RayDeployment:
    """Start the deployment; RuntimeError (everything stopped again) if it does not come up."""
    try:
        find(spec.name)
    except ValueError:
        pass
    else:
        raise RuntimeError(f"a deployment named {spec.name!r} already runs: `ucm-serve status` / `ucm-serve down`")
    keys = KeyBundle.generate(spec.key_names()) if spec.secure else None
    controller = (
        ray.remote(Controller)
        .options(
            name=spec.name,
            namespace=NAMESPACE,
            lifetime="detached" if spec.detached else None,
            num_cpus=0,
            max_concurrency=8,  # status while a scale call waits for a drain
            max_restarts=0,
        )
        .remote(spec, keys)
    )
    deployment = RayDeployment(controller, spec.name)
    try:
        ray.get(controller.deploy.remote(timeout_s))  # type: ignore[attr-defined]  # Ray types handles as the class
    except BaseException:
        deployment.shutdown()
        raise
    return deployment
