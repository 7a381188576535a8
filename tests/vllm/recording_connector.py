"""``RecordingECExampleConnector``: vLLM's ``ECExampleConnector`` that logs every connector call.

For observing vLLM's call order in a real engine (test harness only). Each call on either role
appends one JSON line ``{"t", "pid", "role", "method", "args"}`` to the file named by
``ec_connector_extra_config["record_path"]`` (``O_APPEND``, so the scheduler-side and worker-side
instances, in one process or two, share the file), then does what ``ECExampleConnector`` does.

    ec_transfer_config = {
        "ec_connector": "RecordingECExampleConnector",
        "ec_connector_module_path": "tests.vllm.recording_connector",
        "ec_role": "ec_both",
        "ec_connector_extra_config": {"shared_storage_path": str(folder), "record_path": str(log)},
    }
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.example_connector import ECExampleConnector

RECORDED = (
    "bind_connector_metadata",
    "build_connector_meta",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "ensure_cache_available",
    "get_finished",
    "has_cache_item",
    "register_caches",
    "request_finished",
    "save_caches",
    "shutdown",
    "start_load_caches",
    "start_save_caches",
    "start_worker_services",
    "take_unavailable_requests",
    "update_connector_output",
    "update_state_after_alloc",
    "update_state_after_free",
)


def describe(value: Any) -> Any:
    """A short JSON-able description of a connector call argument."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return {"tensor": list(value.shape), "dtype": str(value.dtype), "device": str(value.device)}
    if hasattr(value, "request_id") and hasattr(value, "mm_features"):
        return {
            "request": value.request_id,
            "mm": [
                {
                    "id": f.identifier,
                    "modality": f.modality,
                    "offset": f.mm_position.offset,
                    "length": f.mm_position.length,
                }
                for f in value.mm_features
            ],
        }
    if type(value).__name__ == "SchedulerOutput":
        return {
            "scheduled_encoder_inputs": {k: list(v) for k, v in value.scheduled_encoder_inputs.items()},
            "finished_req_ids": sorted(value.finished_req_ids),
            "free_encoder_mm_hashes": list(value.free_encoder_mm_hashes),
        }
    if isinstance(value, dict):
        return {"keys": sorted(str(k) for k in value)}
    if isinstance(value, set | frozenset | list | tuple):
        return [describe(v) for v in value]
    return repr(value)[:300]


_depth = threading.local()


class RecordingECExampleConnector(ECExampleConnector):
    """``ECExampleConnector`` plus a JSON-lines log of every connector call (see module docstring)."""

    def __init__(self, vllm_config: Any, role: Any) -> None:
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config
        self._record_path: str = extra["record_path"]
        self._record("__init__", {"role": role.name, "ec_role": vllm_config.ec_transfer_config.ec_role}, role)
        super().__init__(vllm_config, role)

    def _record(self, method: str, args: Any, role: Any = None) -> None:
        role = role if role is not None else self._role
        line = {"t": time.time(), "pid": os.getpid(), "role": role.name, "method": method, "args": args}
        fd = os.open(self._record_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (json.dumps(line) + "\n").encode())
        finally:
            os.close(fd)


def _recorded(name: str) -> Callable[..., Any]:
    original = getattr(ECExampleConnector, name)

    @functools.wraps(original)
    def method(self: RecordingECExampleConnector, *args: Any, **kwargs: Any) -> Any:
        depth = _depth.value = getattr(_depth, "value", 0) + 1
        described = [describe(a) for a in args] + [{k: describe(v)} for k, v in kwargs.items()]
        self._record(name, {"in": described, "depth": depth - 1})  # at entry: nested calls log after
        try:
            result = original(self, *args, **kwargs)
        finally:
            _depth.value = depth - 1
        if result is not None and name not in ("build_connector_meta",):
            self._record(f"{name} ->", describe(result))
        elif result is not None:
            self._record(f"{name} ->", repr(result)[:300])
        return result

    return method


for _name in RECORDED:
    setattr(RecordingECExampleConnector, _name, _recorded(_name))
