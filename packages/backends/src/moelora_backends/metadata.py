"""Aliases kept for existing imports: the metadata machinery lives in :mod:`moelora_core.metadata`
(one machinery for every built-in backend, DESIGN.md §6). ``Capacity`` is now
:class:`~moelora_core.metadata.LaunchSizes` (the launch sizes, not a family's capacity, which is
:class:`~moelora_core.backend_checks.FamilyCapacity`)."""

from moelora_core.metadata import (
    INT_FIELDS,
    MAPPING_FIELDS,
    PER_REQUEST,
    EagerMetadata,
    GraphFamily,
    LaunchSizes,
    build_info,
    host_lists,
)

Capacity = LaunchSizes

__all__ = ["INT_FIELDS", "MAPPING_FIELDS", "PER_REQUEST", "Capacity", "EagerMetadata", "GraphFamily", "LaunchSizes",
           "build_info", "host_lists"]
