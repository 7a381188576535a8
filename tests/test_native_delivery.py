"""The native steps of a hit (format/arrays.c): each array of a value made over its bytes
(`build`: a numpy array, its numpy twin for torch, or a DLPack tensor), a hit's value and
repeat-hit record in one call (`deliver`), a known batch in one call (`deliver_many`); their
bounds, lifetimes (a tensor holds its buffer exactly as long as it or a view of it lives) and
failure modes, and `get_many` taking the one-call path."""

from __future__ import annotations

import subprocess
import sys
import threading
import weakref

import numpy as np
import pytest
import torch

from shmcache import CacheConfig, EmbeddingCache
from shmcache.format import _arrays
from shmcache.format.decode import aliasing, as_byte_array, parse
from shmcache.format.reading import DLType, Recipe, numpy_recipe
from shmcache.format.values import encode
from shmcache.node.audit import audit
from shmcache.process.mappings import Mapping
from shmcache.process.views import Views
from tests.helpers import InterruptAtLine, settle
from tests.workers import expected_value, key_of


def _bf16() -> DLType:
    return DLType(*_arrays.dltype(torch.empty(1, dtype=torch.bfloat16).__dlpack__()))


def _identity(array: np.ndarray) -> np.ndarray:
    return array


def test_the_native_array_step_checks_every_bound_and_keeps_its_buffer() -> None:
    buffer = np.arange(64, dtype=np.uint8)
    words = _arrays.build(buffer, 4, numpy_recipe(4, np.dtype("<u4"), (2, 3), None))
    assert words.base is buffer and words.flags.c_contiguous and not words.flags.writeable
    assert words.tolist() == np.frombuffer(bytes(range(8, 32)), "<u4").reshape(2, 3).tolist()
    twin = Recipe(0, np.dtype(np.uint8), None, (4,), _identity, None, None, None)  # a tensor's: writable
    assert _arrays.build(buffer, 0, twin).flags.writeable
    buffer.flags.writeable = False
    assert not _arrays.build(buffer, 0, twin).flags.writeable
    assert _arrays.build(buffer, 64, numpy_recipe(0, np.dtype(np.float64), (0, 5), None)).shape == (0, 5)
    for base, offset, shape in [
        (0, 57, (1,)),
        (50, 7, (1,)),
        (-1, 0, (1,)),
        (0, -1, (1,)),
        (0, 65, (0,)),
        (0, 0, (9,)),
        (0, 0, (-1,)),
        (0, 0, (1 << 40, 1 << 40)),
        (1 << 62, 1 << 62, (0,)),
    ]:
        with pytest.raises(ValueError):
            _arrays.build(buffer, base, numpy_recipe(offset, np.dtype(np.float64), shape, None))
    for bad in [
        (buffer.reshape(8, 8), numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not 1-D
        (buffer[::2], numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not contiguous
        (buffer.view(np.int8), numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not uint8
        (bytes(8), numpy_recipe(0, np.dtype(np.uint8), (1,), None)),  # not an array
        (buffer, numpy_recipe(0, np.dtype(object), (1,), None)),  # holds references
        (buffer, numpy_recipe(0, "float32", (1,), None)),  # not a dtype
        (buffer, numpy_recipe(0, np.dtype(np.uint8), [1], None)),  # not a tuple
        (buffer, numpy_recipe(0, np.dtype(np.uint8), (1,) * 33, None)),  # too many dimensions
        (buffer, (0, np.dtype(np.uint8), None, (1,))),  # not a recipe
    ]:
        with pytest.raises(TypeError):
            _arrays.build(bad[0], 0, bad[1])  # type: ignore[arg-type]


def test_a_tensor_made_over_dlpack_keeps_its_buffer_while_it_or_a_view_of_it_lives() -> None:
    """A bfloat16 tensor handed to torch over DLPack is zero-copy over the buffer (a write reaches
    it), holds the buffer until the tensor and every tensor derived from it are gone (then, and
    in a thread of its own, lets it go), and one torch refuses lets it go at once."""
    buffer = np.zeros(64, dtype=np.uint8)
    alive = weakref.ref(buffer)
    recipe = Recipe(0, None, _bf16(), (2, 3), torch.from_dlpack, None, None, None)
    tensor = _arrays.build(buffer, 8, recipe)
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (2, 3) and tensor.stride() == (3, 1)
    assert tensor.data_ptr() == buffer.ctypes.data + 8
    tensor[1, 2] = 1.0  # bfloat16 1.0 is 0x3F80, little-endian
    assert buffer[8 + 10 : 8 + 12].tolist() == [0x80, 0x3F]
    row, buffer = tensor[1], None
    del tensor
    assert alive() is not None  # the derived row still holds it
    holder = [row]
    del row
    done = threading.Thread(target=holder.clear)  # the last reference dies in another thread
    done.start()
    done.join()
    assert alive() is None
    buffer = np.zeros(64, dtype=np.uint8)
    alive = weakref.ref(buffer)
    with pytest.raises(RuntimeError, match="refused"):
        _arrays.build(buffer, 0, recipe._replace(to_torch=_refuse))
    buffer = None
    assert alive() is None  # the capsule torch never took over let it go


_ALIVE_AT_EXIT = """
import numpy as np, torch
from shmcache.format import _arrays
from shmcache.format.reading import DLType, Recipe
class Owner(bytearray):
    def __del__(self):
        print("released", flush=True)
bf16 = DLType(*_arrays.dltype(torch.empty(1, dtype=torch.bfloat16).__dlpack__()))
recipe = Recipe(0, None, bf16, (4,), torch.from_dlpack, None, None, None)
kept = _arrays.build(np.frombuffer(Owner(64), dtype=np.uint8), 0, recipe)
"""


def test_a_tensor_made_over_dlpack_alive_at_exit_lets_its_buffer_go() -> None:
    """torch runs the deleter without the GIL, when the interpreter is already finalizing: the
    finalizing thread still lets the buffer go (the view's release, as a numpy twin's would)."""
    done = subprocess.run([sys.executable, "-c", _ALIVE_AT_EXIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "released"


def test_a_batchs_native_delivery_is_all_or_none() -> None:
    """`deliver_many` answers every hit in order, or raises having kept nothing: a value made
    before the failing one is dropped, no buffer stays referenced."""
    buffers = [np.full(64, i, dtype=np.uint8) for i in range(3)]
    good = numpy_recipe(0, np.dtype(np.uint8), (4,), None)
    made = _arrays.deliver_many(buffers, 0, [good] * 3, Mapping, [0, 1, 2], [None] * 3)
    assert [int(value[0]) for value, _ in made] == [0, 1, 2]
    assert [record.sealed for _, record in made] == [0, 1, 2]
    del made
    counts = [sys.getrefcount(buffer) for buffer in buffers]
    failing = good._replace(shape=(65,))  # overruns its buffer
    with pytest.raises(ValueError, match="overrun"):
        _arrays.deliver_many(buffers, 0, [good, good, failing], Mapping, [0, 1, 2], [None] * 3)
    assert [sys.getrefcount(buffer) for buffer in buffers] == counts
    with pytest.raises(ValueError, match="differ in length"):
        _arrays.deliver_many(buffers, 0, [good] * 2, Mapping, [0, 1, 2], [None] * 3)
    with pytest.raises(TypeError, match="lists"):
        _arrays.deliver_many(tuple(buffers), 0, [good] * 3, Mapping, [0, 1, 2], [None] * 3)  # type: ignore[arg-type]


def _refuse(capsule: object) -> None:
    raise RuntimeError("refused")


def test_the_native_dlpack_step_checks_every_bound() -> None:
    buffer = np.zeros(64, dtype=np.uint8)
    recipe = Recipe(0, None, _bf16(), (1,), torch.from_dlpack, None, None, None)
    for offset, shape in [
        (57, (4,)),
        (-1, (1,)),
        (65, (0,)),
        (0, (33,)),
        (0, (-1,)),
        (0, (1 << 40, 1 << 40)),
        (0, (0, 1 << 62, 1 << 62)),  # no element, but strides that would overflow
        (0, (0, (1 << 63) - 1)),  # strides that would overflow in bytes
    ]:
        with pytest.raises(ValueError):
            _arrays.build(buffer, 0, recipe._replace(offset=offset, shape=shape))
    for dltype in [(4, 0, 1), (4, 4, 1), (256, 16, 1), (4, 16, 0)]:  # no bits, half a byte, out of range
        with pytest.raises(ValueError, match="whole bytes"):
            _arrays.build(buffer, 0, recipe._replace(dlpack=dltype))
    read_only = buffer.copy()
    read_only.flags.writeable = False
    for bad_buffer, bad in [
        (read_only, recipe),  # read-only: a torch tensor cannot be
        (buffer, recipe._replace(dlpack=[4, 16, 1])),  # not a tuple
        (buffer, recipe._replace(dlpack=(4, 16))),  # not three ints
        (buffer, recipe._replace(shape=[1])),  # not a tuple
    ]:
        with pytest.raises(TypeError):
            _arrays.build(bad_buffer, 0, bad)
    taken = torch.zeros(1).__dlpack__()
    torch.from_dlpack(taken)
    for not_a_fresh_capsule in (taken, buffer):  # taken over ("used_dltensor"), not a capsule
        with pytest.raises(ValueError):
            _arrays.dltype(not_a_fresh_capsule)


@pytest.mark.parametrize(
    "value", [np.arange(6.0).reshape(2, 3), torch.arange(6.0), torch.ones(3, 4, dtype=torch.bfloat16)]
)
def test_a_hits_native_delivery_records_what_a_repeat_hit_checks(value: object) -> None:
    """`deliver` makes the value `build` makes and the record of views' mapping, field by field,
    its signature what the value's aliasing reads from it."""
    buffer = as_byte_array(encode(value))
    parsed = parse(buffer.data)
    assert parsed.native is not None
    delivered, record = _arrays.deliver(buffer, 0, parsed.native, Mapping, "sealed", parsed)
    assert type(record) is Mapping and record.sealed == "sealed" and record.parsed is parsed
    assert record.holder() is buffer and record.template() is delivered and record.aliases is None
    ops = aliasing(delivered)
    assert record.aliasing is ops is not None and record.signature == ops.signature(delivered)
    same = np.array_equal if isinstance(value, np.ndarray) else torch.equal
    assert same(delivered, value)  # type: ignore[operator]
    with pytest.raises(TypeError, match="tuple subclass"):
        _arrays.deliver(buffer, 0, parsed.native, dict, "sealed", parsed)  # type: ignore[arg-type]
    no_tensor = parsed.native._replace(to_torch=_not_a_tensor, layout=((4,), (1,), torch.uint8))
    with pytest.raises(AttributeError, match="data_ptr"):  # its own error, no later call's
        _arrays.deliver(buffer, 0, no_tensor, Mapping, "sealed", parsed)


def _not_a_tensor(array: object) -> int:
    return 42


def test_an_interrupt_before_a_known_batch_is_made_gives_every_pin_and_reference_back(
    config: CacheConfig,
) -> None:
    """A signal on the first line of the one-call delivery (the batch pinned, its views made, no
    value yet) gives every hit's pins back, the request's included: none is left to
    `cleanup_request`, none stays pinned."""
    with EmbeddingCache(config) as cache:
        keys = [key_of(f"k{i}") for i in range(3)]
        for key in keys:
            cache.put(key, expected_value("k"))
        assert all(value is not None for value in cache.get_many(keys))  # every head checked
        settle()
        interrupter = InterruptAtLine(0, {Views._deliver_known.__code__: None})
        with pytest.raises(KeyboardInterrupt), interrupter.tracing():
            cache.get_many(keys, request_id="r")
        assert interrupter.fired
        settle()
        assert cache.cleanup_request("r") == 0
        assert cache._node.pins.held() == {} and cache.stats()["references"] == 0
        assert audit(cache._node) == []


def test_get_many_of_entries_delivered_before_is_one_native_call_and_pins_like_get(
    config: CacheConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once this process checked every head of a batch (their views dropped since), the batch is
    delivered in one native call, each hit pinned and referenced as `get` would; a batch with
    one entry not delivered here before goes one by one."""
    with EmbeddingCache(config) as cache:
        names = [f"k{i}" for i in range(8)]
        for name in names:
            cache.put(key_of(name), expected_value(name))
        keys = [key_of(name) for name in names]
        assert all(value is not None for value in cache.get_many(keys))  # every head checked
        settle()
        calls: list[int] = []
        native = _arrays.deliver_many
        monkeypatch.setattr(
            _arrays, "deliver_many", lambda *args: calls.append(len(args[0])) or native(*args)
        )
        values = cache.get_many(keys, request_id="r")
        assert calls == [8]
        assert all(
            torch.equal(value, expected_value(name)) for value, name in zip(values, names, strict=True)
        )
        assert cache.cleanup_request("r") == 8
        cache.put(key_of("new"), expected_value("new"))
        del values
        settle()
        mixed = cache.get_many([*keys, key_of("new")])
        assert calls == [8] and all(value is not None for value in mixed)  # one by one
        del mixed
        settle()
        assert cache.stats()["references"] == 0 and audit(cache._node) == []
