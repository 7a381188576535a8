"""Cross-node single flight: a lease in the store per key, so that nodes that miss the same key
together run one encoder forward between them (the RFC's "future extension"; no peer has it).

The protocol rests on Mooncake's `put` never overwriting (first writer wins). A node that owns its
node reservation of a key and found no copy in the store:

1. puts `<value key>@lease` = its token (random id, the node's tag, and a deadline: now +
   `compute_timeout_s`) and
   reads the lease back. Its own token: it holds the lease and computes; the value is published
   as every computed value is, and the lease is removed once that publish is over (the master
   may have put the lease in a segment that outlives the holder, while the holder's copy of the
   value dies with it: a lease left to expire would then hold every waiter to its deadline).
2. Another token: it waits, looking for the value every 50 ms (each look is a pull), until that
   token's deadline, and at most `WAIT_SHARE` of its own `compute_timeout_s`: the node's other
   processes wait on its node reservation meanwhile, each for `compute_timeout_s` from its own
   arrival, so the takeover's compute must end within theirs (waiting for the other node's
   deadline, a waiter that came 0.3 s after the owner got `ComputeTimeout`, and a token with a
   deadline far off, a clock ahead or a foreign writer, held the owner that long).
3. A deadline passed (the holder died or hangs) or a lease gone (a holder's own segment vanishes
   ~10 s after it dies): it overwrites the lease with its own token (`upsert`) and reads it back;
   its own token: it computes. A holder that dies mid-compute thus costs one takeover, bounded
   by `compute_timeout_s`; two waiters taking over at once may both compute (still one per node).
4. A holder whose compute fails, or whose publish is dropped or fails, removes its lease too, so
   a waiter takes over at once. Mooncake has no compare-and-remove, so a removal reads the lease
   first and removes it only if it is still ours and more than `RELEASE_MARGIN_S` from its
   deadline: past that, a waiter may be taking it over between our read and our remove, and
   removing its new lease would let yet another node compute. Such a lease is left to expire.
   The margin holds while the nodes' clocks agree to within it, less the remove's latency (with
   `compute_timeout_s` under the margin a lease is never removed: waiters wait its deadline).
5. A lease that bears our own node's tag is never waited for: we hold the key's node
   reservation, so the process of our node that took the lease no longer does (it died, with
   every process of the node if the namespace was wiped since): we take it over at once, where
   another node waits for its deadline. The tag is a digest of the kernel's boot id, the host
   name and the namespace's index object name (namespace and uid): two containers of one host
   that share a host name and a namespace name would take each other's leases over at once
   (each still computes once per node).

`try_reserve_many` (the encoder hook's and the vLLM scheduler's batch path) takes leases without
waiting (`try_hold`): a key whose lease another node holds is given back by our node and waited
for on the blocking path, or asked for again (the scheduler's next step); past `WAIT_SHARE` of
`compute_timeout_s` since this process first saw that lease, it is taken over, as on the
blocking path.
A caller that computes for itself alone and stores nothing (a vLLM `ec_consumer` engine) only
looks (`held_elsewhere`): it waits for another node's live lease, as long as the batch path
would (`WAIT_SHARE` of `compute_timeout_s` since this process first saw it), takes none of its
own, and removes an orphan of its own node (step 5) as a holder removes its lease (step 4).

Any store error means "compute": node-local exactly-once never depends on the lease.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import Callable
from typing import Final, NamedTuple

import xxhash

from shmcache.format.values import Value
from shmcache.remote.store import RemoteStore

__all__ = ["LEASE_SUFFIX", "Lease", "held_elsewhere", "hold_or_wait", "node_tag", "release", "try_hold"]

LEASE_SUFFIX: Final = "@lease"
WAIT_SHARE: Final = 0.5  # of compute_timeout_s: the longest a node waits for another node's lease
POLL_S: Final = 0.05
READ_S: Final = 2.0
BATCH_READ_S: Final = 0.2  # the batch path's patience: a scheduler step must not wait on a lease
RELEASE_MARGIN_S: Final = 2.0  # a lease this close to its deadline is left to expire (step 4)


class Lease(NamedTuple):
    """A lease this node holds: the value's name in the store and our token in its lease."""

    name: str
    token: bytes


def node_tag(index_name: str) -> str:
    """The tag our lease tokens bear: this host's boot and name, and the namespace's index object."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
    except OSError:
        boot = b""
    return xxhash.xxh3_64_hexdigest(b"|".join([boot, socket.gethostname().encode(), index_name.encode()]))


def _token(timeout_s: float, node: str) -> bytes:
    return f"{secrets.token_hex(8)}|{node}|{time.time() + timeout_s:.3f}".encode()


def _deadline(token: bytes) -> float:
    try:
        return float(token.rsplit(b"|", 1)[1])
    except (IndexError, ValueError):
        return 0.0  # not a token of ours: take it over


def _ours(held: bytes, node: str) -> bool:
    """Whether the lease `held` bears our node's tag (orphaned while we hold the node reservation)."""
    parts = held.split(b"|")
    return len(parts) == 3 and parts[1] == node.encode()


def _waits(held: bytes, node: str) -> bool:
    """Whether a lease `held` by another holder is worth waiting for: another node's, before its
    deadline."""
    return not _ours(held, node) and time.time() < _deadline(held)


def hold_or_wait(
    store: RemoteStore, name: str, timeout_s: float, node: str, pull: Callable[[], Value | None]
) -> tuple[bytes | None, Value | None]:
    """(our lease token, None): compute the value; (None, value): another node computed it.
    `node` is our node's tag; `pull` looks for the value in the store (under our node
    reservation)."""
    lease = name + LEASE_SUFFIX
    mine = _token(timeout_s, node)
    if not store.put_bytes(lease, mine):
        return mine, None  # the store does not answer: compute
    held = _read(store, lease)
    give_up = time.monotonic() + WAIT_SHARE * timeout_s  # once: successive holders share it
    while held is not None and held != mine:
        while _waits(held, node) and time.monotonic() < give_up:
            gone = store.size_of(lease) is None  # looked up first: a holder removes its lease
            value = pull()  # only after its publish is over, so a value stored is found now
            if value is not None:
                return None, value
            if gone:
                break  # removed, the value not stored: take over
            time.sleep(POLL_S)
        mine = _token(timeout_s, node)
        if not store.upsert_bytes(lease, mine):
            return mine, None
        held = _read(store, lease)
    try:
        value = pull()  # a holder that published and removed its lease just before we put ours
    except BaseException:  # ours, and nobody computes under it: waiters take over at once
        release(store, Lease(name, mine))
        raise
    if value is not None:
        release(store, Lease(name, mine))
        return None, value
    return mine, None


def try_hold(
    store: RemoteStore, name: str, timeout_s: float, node: str, seen: dict[bytes, float]
) -> bytes | None:
    """Take the lease of `name` without waiting (the batch path): our token (compute), or None
    when another node holds a live lease (wait for its value), for at most `WAIT_SHARE` of
    `timeout_s` since this process first saw that token (`seen`: token -> when, kept by the
    caller across calls; the batch path is asked again at each scheduler step). `node` is our
    node's tag. Any store error means ours."""
    lease = name + LEASE_SUFFIX
    now = _pruned(seen, timeout_s)
    for put in (store.put_bytes, store.upsert_bytes):  # put; over a lease not worth waiting for, upsert
        mine = _token(timeout_s, node)
        if not put(lease, mine):
            return mine
        held = _read(store, lease, BATCH_READ_S)
        if held is None or held == mine:
            return mine
        waited = now - seen.setdefault(held, now)
        if _waits(held, node) and (put is store.upsert_bytes or waited < WAIT_SHARE * timeout_s):
            return None
    return None


def held_elsewhere(
    store: RemoteStore, name: str, node: str, timeout_s: float, seen: dict[bytes, float]
) -> bool:
    """Whether another node holds a live lease of `name` worth waiting for: one look, nothing
    taken; no once this process saw that lease `WAIT_SHARE` of `timeout_s` ago (`seen`, as for
    `try_hold`). An orphaned lease of our own node is removed, as `release` removes ours, so
    other nodes stop waiting for it. `node` is our node's tag. Any store error, or a lease still
    being written (Mooncake answers empty meanwhile), means no: the caller computes for itself."""
    held = store.get_bytes(name + LEASE_SUFFIX)
    if held is None:
        return False
    if _ours(held, node):
        release(store, Lease(name, held))
        return False
    now = _pruned(seen, timeout_s)
    return _waits(held, node) and now - seen.setdefault(held, now) < WAIT_SHARE * timeout_s


def _pruned(seen: dict[bytes, float], timeout_s: float) -> float:
    """Drop from `seen` the tokens first seen more than `timeout_s` ago (of no use any more: it
    stays bounded); now, on the monotonic clock."""
    now = time.monotonic()
    for old, at in list(seen.items()):  # `seen` is shared by the process's threads: no `del`
        if now - at > timeout_s:
            seen.pop(old, None)
    return now


def _read(store: RemoteStore, lease: str, patience: float = READ_S) -> bytes | None:
    """The lease as stored. Mooncake's `get` answers empty while another client is still writing
    the object (a put racing ours), and while the object sits in a dead client's segment (until
    the master drops it, ~`client_ttl`): look again for up to `patience` seconds; None if it
    never shows (then we compute)."""
    deadline = time.monotonic() + patience
    while True:
        held = store.get_bytes(lease)
        if held is not None or time.monotonic() > deadline:
            return held
        time.sleep(POLL_S)


def release(store: RemoteStore, held: Lease) -> None:
    """Remove our lease `held`, if it is still ours and not about to be taken over (step 4)."""
    lease = held.name + LEASE_SUFFIX
    if store.get_bytes(lease) == held.token and time.time() + RELEASE_MARGIN_S < _deadline(held.token):
        store.remove(lease)  # the deadline is looked at after the read: the remove follows at once
