"""The hostile-input tests' live router, a module-scoped fixture shared by both of their modules."""

from tests.router.hostile_live import live

__all__ = ["live"]
