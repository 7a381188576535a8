"""Handing a reservation to another process (a serving engine reserves in its scheduler process and
computes in its worker process): real processes, and SIGKILL on either side of the hand-off."""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest

from shmcache import CacheClosed, CacheConfig, EmbeddingCache, ReservationTicket
from shmcache.kernel.semaphores import SemaphoreSet
from shmcache.node.layout import needle_of
from shmcache.node.reservations import ClaimKind
from shmcache.node.slots import FailureKind
from shmcache.testing import sample_cache_config
from tests import workers
from tests.helpers import finished, kill, running, spawn, stopped, wait_for
from tests.workers import expected_value, fingerprint, key_of


def _result(path: Path) -> tuple[str, bytes]:
    wait_for(path.exists, timeout=60, what=str(path))
    how, digest = path.read_text().split()
    return how, bytes.fromhex(digest)


def test_the_adopter_commits_and_waiters_never_compute(config: CacheConfig, tmp_path: Path) -> None:
    with EmbeddingCache(config) as cache:
        res = cache.try_reserve(key_of("x"))
        assert res is not None and res.owned
        ticket = res.hand_over()
        assert pickle.loads(pickle.dumps(ticket)) == ticket
        assert not res.let_go()  # not adopted yet: the hold stays
        adopted, go, out = tmp_path / "adopted", tmp_path / "go", tmp_path / "out"
        adopter = spawn(workers.adopt_then, config, ticket, "x", str(adopted), str(go))
        waiter = spawn(workers.get_or_compute_to, config, "x", str(out))
        wait_for(adopted.exists, what="the adoption")
        assert adopted.read_text() == "adopted"
        assert res.let_go()
        time.sleep(0.3)
        assert not out.exists()  # the waiter still waits for the adopter's commit
        go.touch()
        assert _result(out) == ("waited", fingerprint(expected_value("x")))
        adopter.join(30)
        waiter.join(30)
        assert adopter.exitcode == 0 and waiter.exitcode == 0
        assert cache.stats()["computes"] == 0 and cache.stats()["takeovers"] == 0


def test_an_adopter_killed_after_the_giver_let_go_is_taken_over(config: CacheConfig, tmp_path: Path) -> None:
    with EmbeddingCache(config) as cache:
        res = cache.try_reserve(key_of("y"))
        assert res is not None
        adopted = tmp_path / "adopted"
        adopter = spawn(workers.adopt_then, config, res.hand_over(), "y", str(adopted), None)
        wait_for(adopted.exists, what="the adoption")
        assert res.let_go()
        kill(adopter)
        value = cache.get_or_compute(key_of("y"), lambda: expected_value("y"))
        assert fingerprint(value) == fingerprint(expected_value("y"))
        assert cache.stats()["takeovers"] == 1


def test_an_adopter_killed_while_the_giver_holds_ends_at_let_go(config: CacheConfig, tmp_path: Path) -> None:
    with EmbeddingCache(config) as cache:
        res = cache.try_reserve(key_of("z"))
        assert res is not None
        adopted, out = tmp_path / "adopted", tmp_path / "out"
        adopter = spawn(workers.adopt_then, config, res.hand_over(), "z", str(adopted), None)
        wait_for(adopted.exists, what="the adoption")
        kill(adopter)  # dead holding it; the giver's hold keeps waiters waiting
        assert cache.try_reserve(key_of("z")) is None
        assert res.let_go()  # the record names the dead adopter: the giver's hold goes
        waiter = spawn(workers.get_or_compute_to, config, "z", str(out))
        assert _result(out) == ("computed", fingerprint(expected_value("z")))
        waiter.join(30)


def test_a_giver_killed_before_the_adoption_leaves_nothing_to_adopt(
    config: CacheConfig, tmp_path: Path
) -> None:
    ticket_path = tmp_path / "ticket"
    giver = spawn(workers.hand_over_then_wait, config, "w", str(ticket_path))
    with EmbeddingCache(config) as cache:
        wait_for(ticket_path.exists, what="the ticket")
        ticket = pickle.loads(ticket_path.read_bytes())
        assert isinstance(ticket, ReservationTicket)
        kill(giver)
        assert cache.adopt(ticket, key_of("w")) is None  # its holder died: a takeover, not an adoption
        value = cache.get_or_compute(key_of("w"), lambda: expected_value("w"))
        assert fingerprint(value) == fingerprint(expected_value("w"))
        assert cache.stats()["takeovers"] == 1


def test_a_withdrawn_reservation_is_reserved_again_without_a_failure(config: CacheConfig) -> None:
    import threading

    with EmbeddingCache(config) as cache:
        res = cache.try_reserve(key_of("v"))
        assert res is not None and res.owned
        got: list[object] = []
        waiter = threading.Thread(
            target=lambda: got.append(cache.get_or_compute(key_of("v"), lambda: expected_value("v")))
        )
        waiter.start()
        wait_for(lambda: cache.stats()["coalesced_waits"] == 1, what="the waiter")
        res.withdraw()  # a scheduler deferring its request: no ComputeFailed for the waiter
        waiter.join(30)
        assert len(got) == 1 and fingerprint(got[0]) == fingerprint(expected_value("v"))  # type: ignore[arg-type]
        assert cache.stats()["computes"] == 1 and cache.stats()["compute_failures"] == 0


def test_a_handed_over_reservation_never_adopted_ends_with_withdraw(config: CacheConfig) -> None:
    """A worker that dies inside the adoption (or never adopts) leaves the record the giver's:
    `let_go` keeps answering False, and the giver's `withdraw` (a connector's request_finished)
    frees it for the next claimer, with no failure reported."""
    with EmbeddingCache(config) as cache:
        res = cache.try_reserve(key_of("u"))
        assert res is not None
        res.hand_over()
        assert not res.let_go() and cache.try_reserve(key_of("u")) is None
        res.withdraw()
        again = cache.try_reserve(key_of("u"))
        assert again is not None and again.owned
        again.abandon()


def test_calls_on_an_ended_reservation_never_release_a_newer_one_of_its_slot(config: CacheConfig) -> None:
    """The semaphore is the slot's, not the reservation's: an abandon repeated after a hand-over
    (or a late `let_go`) named only the slot and released the semaphore of the next reservation
    this process made there, which another claimer then took over (its commit: ReservationLost)."""
    one = dataclasses.replace(config, ways=1, max_entries=1)
    with EmbeddingCache(one) as cache, EmbeddingCache(one) as other:
        first = cache.try_reserve(key_of("a"))
        assert first is not None and first.owned
        first.hand_over()
        first.abandon("never adopted")  # ends it
        second = cache.try_reserve(key_of("b"))
        assert second is not None and second.owned and second.slot == first.slot
        first.abandon("again")
        first.withdraw()
        assert first.let_go()
        assert other.try_reserve(key_of("b")) is None  # still held: another claimer waits
        value = second.commit(expected_value("b"))
        assert fingerprint(value) == fingerprint(expected_value("b"))
        assert cache.stats()["takeovers"] == 0
        del value


def test_a_reservation_dropped_unended_is_withdrawn(config: CacheConfig, tmp_path: Path) -> None:
    """A caller that drops its reservation without commit, abandon or withdraw (an exception in
    between, unused items of `try_reserve_many`): before, the key stayed reserved for the whole
    node until this process exited, and every other process waited `compute_timeout_s` for it."""
    with EmbeddingCache(dataclasses.replace(config, compute_timeout_s=60.0)) as cache:
        res = cache.try_reserve(key_of("d"))
        [also] = cache.try_reserve_many([key_of("e")])
        assert res is not None and res.owned and also is not None and also.owned
        del res, also
        wait_for(lambda: cache.stats()["reserved"] == 0, 10, "the withdraws")
        out = tmp_path / "out"
        other = spawn(workers.get_or_compute_to, config, "d", str(out))
        try:
            assert _result(out) == ("computed", fingerprint(expected_value("d")))  # at once: not after 60 s
        finally:
            other.join(30)
        assert cache.stats()["compute_failures"] == 0  # withdrawn: no failure reported to waiters


def test_a_reservation_handed_back_leaves_its_semaphore_free_once_sealed(
    config: CacheConfig, tmp_path: Path
) -> None:
    """A hands to B, B hands back to A before A let go: A's second adoption joined the semaphore
    again, but A held it for that generation once, so a unit stayed taken after the seal (the
    slot could never be reserved again while A lived)."""
    with EmbeddingCache(config) as cache:
        first = cache.try_reserve(key_of("b"))
        assert first is not None and first.owned
        back, go = tmp_path / "back", tmp_path / "go"
        with running(
            workers.adopt_and_hand_back, config, first.hand_over(), "b", str(back), str(go)
        ) as other:
            wait_for(back.exists, what="the ticket handed back")
            again = cache.adopt(pickle.loads(back.read_bytes()), key_of("b"))
            assert again is not None and again.owned
            go.touch()
            assert finished(other)
        value = again.commit(expected_value("b"))
        assert first.let_go()
        assert not cache._node.reservations.owner_alive(again.slot)  # nobody holds it (1 before)
        del value


def test_close_leaves_a_reservation_in_use_to_its_holder_and_withdraws_one_dropped(
    config: CacheConfig,
) -> None:
    """A thread may still be computing when another closes the cache (a live view defers the
    detach): its commit must land, and nothing may free its extent under it. A reservation
    dropped unended before the close is withdrawn by it, release thread or not."""
    with EmbeddingCache(config) as other:
        closing = EmbeddingCache(config)
        closing.put(key_of("v"), expected_value("v"))
        view = closing.get(key_of("v"))  # defers the detach
        in_use, dropped = closing.try_reserve(key_of("c")), closing.try_reserve(key_of("d"))
        assert in_use is not None and in_use.owned and dropped is not None and dropped.owned
        del dropped
        closing.close()
        assert other.try_reserve(key_of("c")) is None  # still its holder's
        again = other.try_reserve(key_of("d"))
        assert again is not None and again.owned  # withdrawn
        again.abandon()
        value = in_use.commit(expected_value("c"))
        assert fingerprint(value) == fingerprint(expected_value("c"))
        assert fingerprint(other.get(key_of("c"))) == fingerprint(expected_value("c"))  # type: ignore[arg-type]
        del value, view
        closing.flush_releases()  # the last view gone: the closed cache detaches


def test_the_detach_withdraws_the_reservations_still_held(config: CacheConfig) -> None:
    """A reservation still held when its process detaches (closed, no live view) can never be
    committed: before, it kept its key reserved for the whole node until the process exited (every
    other process waited `compute_timeout_s`, then `ComputeTimeout`), and a commit after the detach
    raised a misleading `ReservationLost` ("taken over")."""
    with EmbeddingCache(config) as other:
        closing = EmbeddingCache(config)
        in_use, dropped = closing.try_reserve(key_of("c")), closing.try_reserve(key_of("d"))
        assert in_use is not None and in_use.owned and dropped is not None and dropped.owned
        closing.close()  # no live view: it detaches now
        again = other.try_reserve(key_of("c"))
        assert again is not None and again.owned  # withdrawn by the detach
        with pytest.raises(CacheClosed, match="detached"):
            in_use.commit(expected_value("c"))
        in_use.abandon()  # ended already: nothing to give up, and `again` keeps its hold
        assert other.try_reserve(key_of("c")) is None
        value = again.commit(expected_value("c"))
        assert fingerprint(value) == fingerprint(expected_value("c"))
        del dropped  # its deferred withdraw finds nothing to do (the release thread is gone)
        later = other.try_reserve(key_of("d"))
        assert later is not None and later.owned
        later.withdraw()
        assert other.stats()["compute_failures"] == 0  # the detach withdrew: no failure reported
        del value


def test_a_commit_running_when_the_detach_starts_lands(config: CacheConfig) -> None:
    """The detach withdraws only reservations nothing writes into: it waits for a commit already
    running (here held up in its allocation by a process stopped inside the node section), which
    then lands; a withdraw under it (the reverted f3e60eb) freed its extent, and the commit raised
    `ReservationLost` or, had the allocation come first, wrote into memory another key then got."""
    with EmbeddingCache(config) as other:
        closing = EmbeddingCache(config)
        in_use, dropped = closing.try_reserve(key_of("c")), closing.try_reserve(key_of("d"))
        assert in_use is not None and in_use.owned and dropped is not None and dropped.owned
        retiring = spawn(workers.stop_retiring, config, ["x"])
        try:
            wait_for(lambda: stopped(retiring.pid), what="a process stopped holding the node section")
            committed: list[object] = []
            value = expected_value("c")  # built here: the thread only commits
            committer = threading.Thread(target=lambda: committed.append(in_use.commit(value, view=False)))
            gate = closing._claims.writes  # read only: when each thread is where the race needs it
            committer.start()
            wait_for(lambda: bool(gate._running), what="the commit in its write (held at the node section)")
            closer = threading.Thread(target=closing.close)
            closer.start()
            wait_for(lambda: gate._shut, what="the detach to shut the writes")
            time.sleep(0.2)  # it waits for the commit, which waits for the node section
            assert committer.is_alive() and closer.is_alive() and gate._running
            os.kill(retiring.pid, signal.SIGCONT)
            committer.join(30)
            closer.join(30)
            retiring.join(30)
        finally:
            kill(retiring)
        assert committed and fingerprint(committed[0]) == fingerprint(expected_value("c"))  # type: ignore[arg-type]
        assert fingerprint(other.get(key_of("c"))) == fingerprint(expected_value("c"))  # type: ignore[arg-type]
        later = other.try_reserve(key_of("d"))
        assert later is not None and later.owned  # the one nothing wrote into was withdrawn
        later.withdraw()
        assert other.stats()["compute_failures"] == 0


def test_no_claim_sees_a_sealed_entry_whose_semaphore_is_still_held(
    namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seal gives its semaphore back inside its stripe section. Given back after it (as it
    once was), a claim of another key of the one-way stripe that ran in between evicted the
    fresh entry, then failed to take its slot (FULL: the put's value lost, the claimer's
    computed uncached). Every claim run at a semaphore release of the sealed slot must own it."""
    config = dataclasses.replace(sample_cache_config(namespace, max_entries=4, ways=1), return_mode="clone")
    with EmbeddingCache(config) as cache:
        node = cache._node
        a = needle_of(key_of("a"))
        other = next(
            needle_of(key_of(f"b{i}"))
            for i in range(256)
            if node.stripe_of(needle_of(key_of(f"b{i}"))) == node.stripe_of(a)
        )
        claims = []
        release = SemaphoreSet.release

        def claim_first(sems: SemaphoreSet, index: int) -> None:
            if not claims:
                claims.append(node.reserve(other, (0, 0), 0))
            release(sems, index)

        monkeypatch.setattr(SemaphoreSet, "release", claim_first)
        cache.put(key_of("a"), expected_value("a"))
        monkeypatch.undo()
        assert all(claim.kind is ClaimKind.OWNER for claim in claims), claims
        for claim in claims:
            node.abandon(claim.slot, claim.gen, FailureKind.FAILED, "test")
        assert cache.stats()["uncacheable"] == 0
