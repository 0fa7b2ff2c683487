"""Transfer mediums: where workers write samples and students read them."""

from distill.pipeline.mediums.base import Medium, MediumBase
from distill.pipeline.mediums.shm import SharedMemoryManager, ShmSpaceError, sweep_orphans

__all__ = ["Medium", "MediumBase", "SharedMemoryManager", "ShmSpaceError", "sweep_orphans"]
