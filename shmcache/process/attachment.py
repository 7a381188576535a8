"""Opening and leaving a namespace as one process: attach under the bootstrap lock, detach so that
the last process out removes every object."""

from __future__ import annotations

from dataclasses import dataclass

from shmcache.config import CacheConfig
from shmcache.errors import CacheClosed
from shmcache.kernel.namespace import (
    ObjectNames,
    Segments,
    bootstrap_lock,
    create,
    object_names,
    open_existing,
    remove_objects,
    wipe,
)
from shmcache.node.index import NodeIndex

__all__ = ["Attachment"]


@dataclass
class Attachment:
    """This process's attachment to a namespace: its objects and its client record."""

    config: CacheConfig
    names: ObjectNames
    segments: Segments
    node: NodeIndex
    destroyed: bool = False

    @classmethod
    def open(cls, config: CacheConfig) -> Attachment:
        """Attach to `config.namespace`, creating it (after wiping stale objects) if no live
        process holds it."""
        names = object_names(config.namespace)
        with bootstrap_lock(names, config.mode, config.lock_timeout_s):
            segments = open_existing(names, config)
            created = segments is None
            if segments is None:
                wipe(names)
                segments = create(names, config)
            try:
                node = NodeIndex(segments, config.lock_timeout_s)
                node.attach()
            except BaseException:
                segments.close()
                if created:  # nobody else can have attached: we still hold the bootstrap lock
                    remove_objects(names)
                raise
        return cls(config, names, segments, node)

    def detach(self) -> None:
        """Give back this process's client record; the last live process removes the namespace."""
        self.segments.close()  # no view is made after this
        if self.destroyed:
            return
        try:
            with bootstrap_lock(
                self.names, self.config.mode, self.config.lock_timeout_s, create=False
            ) as held:
                if held:  # else the namespace was destroyed: nothing of ours is left
                    self.node.detach()
                    if not self.node.any_other_live():
                        remove_objects(self.names)
        except CacheClosed:
            pass  # destroyed already
