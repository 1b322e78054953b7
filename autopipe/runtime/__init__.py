"""autopipe's runtime: the GPipe schedule and the transports that run stages under it."""
from .schedule import Schedule, Task

__all__ = ["Schedule", "Task"]
