"""The node layer: the shared index of a namespace and its protocol.

layout.py (every byte), slots.py (the slot state machine), sections.py (held markers and
repair), native.c (the hot transactions in C, and the concurrency protocol beside them),
lookups.py (the hit path), crashpoints.py (the crash-point table), pins.py, clients.py,
counters.py, attachments.py, allocator.py, reservations.py (the reservation protocol) and
index.py (`NodeIndex`, composing them into transactions). It imports nothing from the layers
above.
"""
