"""Namespace squatting: another local user plants objects under the names of our namespace.

The attacker runs as a real second uid (a subprocess started as root with another uid and gid, no
supplementary groups): it creates a namespace of its own, world-writable, attaches to it (so it
looks live) and renames some of its objects to the names our namespace would have. Opening ours
must raise `ForeignObject` naming the object and the attacker's uid, and touch nothing: the
attacker's objects keep their inode, owner and mode, nothing of ours is left behind. Objects of
our own whose modes are wider than the configured mode are refused the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import ForeignObject
from shmcache.kernel.lockfile import bootstrap_lock
from shmcache.kernel.namespace import create, destroy_namespace, object_names
from shmcache.kernel.ownership import semaphore_owner
from shmcache.testing import namespace_objects, sample_cache_config
from tests.workers import key_of

ATTACKER = 12345
BYSTANDER = 12346

_ATTACKER = r"""
import json, os, sys
os.umask(0)
from shmcache.config import CacheConfig
from shmcache.kernel.lockfile import bootstrap_lock
from shmcache.kernel.namespace import create, object_names
from shmcache.node.index import NodeIndex
from shmcache.node.layout import Header

spec = json.loads(sys.argv[1])
config = CacheConfig(**spec["config"])
names = object_names(config.namespace)
with bootstrap_lock(names, config.mode, 10.0):
    segments = create(names, config)
    node = NodeIndex(segments, 10.0)
    node.attach()  # a live client: the planted namespace looks in use
victim = object_names(spec["victim"], spec["victim_uid"])
paths = {
    "lock": (names.lock_path, victim.lock_path),
    "index": (names.index_path, victim.index_path),
    "arena": (names.arena_path, victim.arena_path),
}
for part in spec["squat"]:
    os.rename(*paths[part])
header = Header.read(segments.index)
print(json.dumps({"semid": header.semid, "signature": header.signature}), flush=True)
sys.stdin.read()  # stay attached until the test is done
"""


def _as_user(uid: int, code: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """`python -c code args` as `uid` (gid `uid`, no supplementary groups), through setpriv."""
    user = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    return subprocess.Popen(
        ["setpriv", *user, sys.executable, "-c", code, *args],
        env={**os.environ, "HOME": "/tmp"},
        cwd=os.getcwd(),
        text=True,
        **kwargs,
    )


def _second_user_can_run_python() -> bool:
    if shutil.which("setpriv") is None or os.geteuid() != 0:
        return False
    proc = _as_user(ATTACKER, "import shmcache", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc.wait(60) == 0


pytestmark = pytest.mark.skipif(
    not _second_user_can_run_python(), reason="needs root, setpriv and an interpreter another uid can run"
)


def _file_state(path: str) -> tuple[int, int, int]:
    st = os.lstat(path)
    return st.st_ino, st.st_uid, stat.S_IMODE(st.st_mode)


@dataclasses.dataclass
class Attacker:
    """A running attacker: its namespace's names, the victim paths it took, and its set."""

    proc: subprocess.Popen[str]
    squatted: dict[str, str]  # part -> the victim path it now occupies
    semid: int
    signature: int
    own: list[str]  # its objects left under its own names

    def state(self) -> dict[str, Any]:
        """Inode, owner and mode of every object it planted, and its set's owner and mode."""
        files = {path: _file_state(path) for path in [*self.squatted.values(), *self.own]}
        return {"files": files, "sem": semaphore_owner(self.semid)}


@contextlib.contextmanager
def attacker(victim: CacheConfig, squat: list[str], *, mode: int = 0o666) -> Iterator[Attacker]:
    """Run an attacker that squats the `squat` objects of `victim`'s namespace; remove everything it
    made afterwards (as root)."""
    own_config = dataclasses.asdict(
        dataclasses.replace(victim, namespace=f"{victim.namespace}-evil", mode=mode)
    )
    spec = {"config": own_config, "victim": victim.namespace, "victim_uid": os.geteuid(), "squat": squat}
    proc = _as_user(ATTACKER, _ATTACKER, json.dumps(spec), stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdin is not None
    own = object_names(f"{victim.namespace}-evil", ATTACKER)
    mine = object_names(victim.namespace)
    paths = {"lock": (own.lock_path, mine.lock_path), "index": (own.index_path, mine.index_path)}
    paths["arena"] = (own.arena_path, mine.arena_path)
    semid = -1
    try:
        line = proc.stdout.readline()
        assert line, f"the attacker failed (exit {proc.wait(30)})"
        report = json.loads(line)
        semid = report["semid"]
        squatted = {part: paths[part][1] for part in squat}
        left = [paths[part][0] for part in paths if part not in squat]
        yield Attacker(proc, squatted, semid, report["signature"], left)
    finally:
        proc.stdin.close()
        proc.wait(30)
        for first, second in paths.values():
            for path in (first, second):
                if os.path.lexists(path) and os.lstat(path).st_uid == ATTACKER:
                    os.unlink(path)
        if semid >= 0:
            _semctl(semid, 0, 0)  # IPC_RMID


_libc = ctypes.CDLL(None, use_errno=True)
_semctl = _libc.semctl


def _set_semaphore_mode(semid: int, mode: int) -> None:
    """IPC_SET the permission bits of a set (root may)."""
    buf = ctypes.create_string_buffer(512)
    assert _semctl(semid, 0, 2, buf) == 0  # IPC_STAT
    raw = bytearray(buf.raw)
    raw[20:22] = mode.to_bytes(2, "little")
    buf = ctypes.create_string_buffer(bytes(raw), 512)
    assert _semctl(semid, 0, 1, buf) == 0  # IPC_SET


@pytest.mark.parametrize(
    "squat", [["lock"], ["index"], ["arena"], ["lock", "index", "arena"]], ids=lambda s: "+".join(s)
)
def test_a_squatted_object_is_refused_and_left_alone(namespace: str, squat: list[str]) -> None:
    config = sample_cache_config(namespace)
    with attacker(config, squat) as evil:
        before = evil.state()
        with pytest.raises(ForeignObject, match=str(ATTACKER)) as raised:
            EmbeddingCache(config)
        assert len(str(raised.value)) < 300
        assert evil.state() == before  # not wiped, not changed, not attached
        # nothing of ours is left behind either: only what the attacker planted is there
        assert namespace_objects(namespace) == {os.path.basename(p) for p in evil.squatted.values()}
    assert not namespace_objects(namespace)
    with EmbeddingCache(config) as cache:  # once the attacker is gone the namespace works
        cache.put(key_of("after"), torch.ones(4))
        assert torch.equal(cache.get(key_of("after")), torch.ones(4))


@pytest.mark.parametrize("attacker_alive", [True, False])
def test_a_squatted_semaphore_set_is_refused_and_left_alone(namespace: str, attacker_alive: bool) -> None:
    """Our index names the attacker's set, with its signature (an id reused after our set was
    removed, the attacker having learnt the signature): neither attached to nor removed."""
    config = sample_cache_config(namespace)
    names = object_names(namespace)
    with bootstrap_lock(names, config.mode, 10.0):
        ours = create(names, config)  # nobody attached: a stale namespace, the next open wipes it
    original = bytes(ours.index[40:48])
    try:
        with attacker(config, []) as evil:
            if not attacker_alive:
                _semctl(evil.semid, ours.layout.client_sem(0), 16, ctypes.c_int(0))  # SETVAL 0
            ours.index[40:48] = evil.semid.to_bytes(4, "little", signed=True) + evil.signature.to_bytes(
                4, "little"
            )
            before = evil.state()
            with pytest.raises(ForeignObject, match=f"semaphore set {evil.semid} is owned by uid {ATTACKER}"):
                EmbeddingCache(config)
            assert evil.state() == before
            assert {"index", "arena", "lock"} == {n.rsplit(".", 1)[1] for n in namespace_objects(namespace)}
            ours.index[40:48] = original
    finally:
        ours.index.close()
        ours.arena.close()
        destroy_namespace(namespace)  # our own set too: the restored header names it


def _widen(names: Any, part: str, semid: int) -> None:
    if part == "semaphores":
        _set_semaphore_mode(semid, 0o666)
    else:
        os.chmod({"lock": names.lock_path, "index": names.index_path, "arena": names.arena_path}[part], 0o644)


@pytest.mark.parametrize("part", ["lock", "index", "arena", "semaphores"])
def test_own_objects_with_too_wide_modes_are_refused_while_live(namespace: str, part: str) -> None:
    config = sample_cache_config(namespace)
    names = object_names(namespace)
    with EmbeddingCache(config) as holder:
        holder.put(key_of("kept"), torch.arange(8.0))
        semid = holder._segments.sems.semid
        files = {p: _file_state(p) for p in (names.lock_path, names.index_path, names.arena_path)}
        _widen(names, part, semid)
        with pytest.raises(ForeignObject, match="wider than the configured 0o600"):
            EmbeddingCache(config)
        assert {p: _file_state(p)[0] for p in files} == {p: s[0] for p, s in files.items()}
        assert torch.equal(holder.get(key_of("kept")), torch.arange(8.0))  # the live process is unharmed
        for path, (_ino, _uid, mode) in files.items():
            os.chmod(path, mode)
        _set_semaphore_mode(semid, 0o600)


@pytest.mark.parametrize("part", ["lock", "index", "arena", "semaphores"])
def test_a_stale_namespace_with_too_wide_modes_is_not_wiped(namespace: str, part: str) -> None:
    config = sample_cache_config(namespace)
    names = object_names(namespace)
    with bootstrap_lock(names, config.mode, 10.0):
        ours = create(names, config)  # nobody attached: stale, an open would wipe it
    try:
        files = {p: _file_state(p)[0] for p in (names.lock_path, names.index_path, names.arena_path)}
        _widen(names, part, ours.sems.semid)
        with pytest.raises(ForeignObject):
            EmbeddingCache(config)
        assert {p: _file_state(p)[0] for p in files} == files  # nothing wiped or recreated
        assert semaphore_owner(ours.sems.semid) is not None
    finally:
        ours.index.close()
        ours.arena.close()
        destroy_namespace(namespace)  # destroy removes our own objects whatever their mode


_BYSTANDER = r"""
import json, sys
from shmcache import CacheConfig, EmbeddingCache
from shmcache.errors import ShmCacheError
from shmcache.ops.snapshot import take_snapshot

theirs, owner, mine = sys.argv[1], int(sys.argv[2]), sys.argv[3]
found = {}
for what, attempt in (
    ("snapshot", lambda: take_snapshot(theirs, owner)),
    ("open", lambda: EmbeddingCache(CacheConfig(enable_embedding_cache=True, namespace=mine))),
):
    try:
        attempt()
        found[what] = ["no error"]
    except ShmCacheError as exc:
        found[what] = [type(exc).__name__, isinstance(exc, PermissionError), str(exc)]
    except BaseException as exc:
        found[what] = ["untyped " + type(exc).__name__, False, str(exc)]
print(json.dumps(found))
"""


def test_another_users_private_objects_are_a_typed_error(namespace: str) -> None:
    """A non-root user meets another user's 0600 objects: the kernel refuses access, and that is a
    `ForeignObject` naming the owner, never a bare PermissionError from the IPC library."""
    with attacker(sample_cache_config(namespace), [], mode=0o600) as evil:
        theirs = object_names(f"{namespace}-evil", ATTACKER)
        planted = object_names(namespace, BYSTANDER)
        os.rename(
            theirs.lock_path, planted.lock_path
        )  # the bystander's own namespace: a 0600 lock of another
        try:
            args = (f"{namespace}-evil", str(ATTACKER), namespace)
            proc = _as_user(BYSTANDER, _BYSTANDER, *args, stdout=subprocess.PIPE)
            out, _ = proc.communicate(timeout=120)
            assert _file_state(planted.lock_path)[1:] == (ATTACKER, 0o600)
        finally:
            os.rename(planted.lock_path, theirs.lock_path)
        assert evil.state()["sem"] is not None
        found = json.loads(out)
    for what in ("snapshot", "open"):
        name, is_permission, message = found[what]
        assert (name, is_permission) == ("ForeignObject", True), found
        assert "not accessible" in message and f"owner uid {ATTACKER}" in message, found
    assert not namespace_objects(namespace)
