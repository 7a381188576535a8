"""Run one real vLLM engine in a fresh process and record what it did.

``spawn_engine(EngineRun(...))`` starts ``run_engine`` in a new *spawned* process (its own process
group), waits for it, makes sure nothing it started survives, and returns the parsed
``EngineResult``. ``run_engine`` sets the environment (CPU KV cache, offline hub, loopback, the
harness ``sitecustomize`` on ``PYTHONPATH``), creates ``vllm.LLM`` on the tiny model of
``tests.vllm.model``, generates greedily with logprobs for each request (one image each) and
writes the result JSON: per request the generated token ids, their logprobs and the top-k
logprobs, the latency and time to first token; and the encoder runs on real inputs after
``vllm.LLM()`` returned, counted by the harness probe (see ``tests/vllm/site/sitecustomize.py``)
in whichever process runs the model.
"""

from __future__ import annotations

import contextlib
import io
import json
import multiprocessing
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from PIL import Image

SITE_DIR = Path(__file__).resolve().parent / "site"
DEFAULT_PROMPT = "USER: <image>\ndescribe the image . ASSISTANT:"
IMAGE_SIZE = 28


@dataclass(frozen=True)
class ImageRequest:
    """One prompt with one image: a deterministic image from `image_seed`, or encoded `image_bytes`."""

    image_seed: int | None = None
    image_bytes: bytes | None = None
    prompt: str = DEFAULT_PROMPT
    uuid: str | None = None  # passed as multi_modal_uuids: vLLM then uses it verbatim as mm_hash

    def __post_init__(self) -> None:
        if (self.image_seed is None) == (self.image_bytes is None):
            raise ValueError("give exactly one of image_seed and image_bytes")


@dataclass(frozen=True)
class EngineRun:
    """What one engine process does: `requests` on the model in `model_dir`, result to `result_path`."""

    model_dir: str
    result_path: str
    requests: tuple[ImageRequest, ...]
    ec_transfer_config: dict[str, Any] | None = None
    multiprocess: bool = False  # VLLM_ENABLE_V1_MULTIPROCESSING: scheduler and worker in 2 more processes
    max_tokens: int = 4
    logprobs: int = 5
    batched: bool = False  # all requests in one generate() call instead of one call each
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the engine
    cache_dir: str | None = None  # VLLM_CACHE_ROOT; default: "<model_dir>.vllm-cache", shared by runs
    build_model: bool = False  # build_tiny_llava(model_dir) first (instant if built; cheap here as
    # vLLM imports transformers anyway)


@dataclass
class RequestResult:
    token_ids: list[int]
    logprobs: list[float]  # logprob of each generated token
    top_logprobs: list[dict[str, float]]  # per step: token id -> logprob, the top `logprobs`
    latency_s: float  # generate() wall time (the whole batch's when batched)
    ttft_s: float | None  # the engine's first-token latency when it reports one


@dataclass
class EngineResult:
    requests: list[RequestResult]
    encoder_runs: int  # multimodal items the model runner encoded after LLM() returned
    encoder_calls: int  # encoder batches (model-runner calls that encoded >= 1 item) after LLM()
    encoded_mm_hashes: list[str]  # in encode order
    vision_tower_images: int  # images through the CLIP tower after LLM() (cross-check)
    startup_vision_tower_images: int  # ... during LLM() (profiling / producer width probe)
    startup_s: float
    generate_s: float
    shutdown_s: float
    pids: list[int]  # run_engine's process and every process that logged an encoder event
    log_path: str

    @classmethod
    def load(cls, path: str | Path) -> EngineResult:
        data = json.loads(Path(path).read_text())
        data["requests"] = [RequestResult(**r) for r in data["requests"]]
        return cls(**data)


def make_image(seed: int, size: int = IMAGE_SIZE) -> Image.Image:
    """A deterministic RGB noise image (the same seed gives the same pixels everywhere)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def image_png(seed: int, size: int = IMAGE_SIZE) -> bytes:
    """PNG bytes of `make_image(seed)`."""
    buffer = io.BytesIO()
    make_image(seed, size).save(buffer, format="PNG")
    return buffer.getvalue()


def engine_environment(run: EngineRun, work_dir: Path) -> dict[str, str]:
    """The variables `run_engine` sets before vLLM loads (inherited by every process vLLM starts)."""
    python_path = [str(SITE_DIR), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in python_path if p),
        "SHMCACHE_VLLM_ENCODER_LOG": str(work_dir / "encoder.jsonl"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if run.multiprocess else "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(work_dir / "hf"),
        # vLLM caches what it learns of the model class in a subprocess (~10 s on 2 cores) here
        "VLLM_CACHE_ROOT": run.cache_dir or f"{run.model_dir.rstrip('/')}.vllm-cache",
        "VLLM_RPC_BASE_PATH": str(work_dir),
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_LOOPBACK_IP": "127.0.0.1",
        "MASTER_ADDR": "127.0.0.1",
        # A worker that misses vLLM's 5 s exit grace is SIGTERMed and leaves its /dev/shm queues behind
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "60",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    env.update(run.env)
    return env


def _install_hooks() -> None:
    """Run the harness sitecustomize in this process (one started before PYTHONPATH named it)."""
    import importlib.util

    existing = sys.modules.get("sitecustomize")
    if existing is not None and Path(getattr(existing, "__file__", "") or "").parent == SITE_DIR:
        existing.install()
        return
    spec = importlib.util.spec_from_file_location(
        "_shmcache_vllm_sitecustomize", SITE_DIR / "sitecustomize.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # installs on import


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _prompts(run: EngineRun) -> list[dict[str, Any]]:
    from PIL import Image

    prompts = []
    for request in run.requests:
        if request.image_bytes is not None:
            image = Image.open(io.BytesIO(request.image_bytes)).convert("RGB")
        else:
            assert request.image_seed is not None
            image = make_image(request.image_seed)
        prompt: dict[str, Any] = {"prompt": request.prompt, "multi_modal_data": {"image": image}}
        if request.uuid is not None:
            prompt["multi_modal_uuids"] = {"image": [request.uuid]}
        prompts.append(prompt)
    return prompts


def _request_result(output: Any, latency_s: float) -> RequestResult:
    completion = output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    steps = completion.logprobs or []
    logprobs = [float(step[token].logprob) for step, token in zip(steps, token_ids, strict=True)]
    top = [{str(t): float(lp.logprob) for t, lp in step.items()} for step in steps]
    metrics = getattr(output, "metrics", None)
    ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
    return RequestResult(token_ids, logprobs, top, latency_s, float(ttft) if ttft else None)


def _generate(llm: Any, run: EngineRun) -> list[RequestResult]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=run.max_tokens, logprobs=run.logprobs, seed=0)
    prompts = _prompts(run)
    if run.batched:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return [_request_result(output, elapsed) for output in outputs]
    results = []
    for prompt in prompts:
        start = time.perf_counter()
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        results.append(_request_result(output, time.perf_counter() - start))
    return results


START_GATE_ENV = "SHMCACHE_VLLM_START_GATE"


def _wait_at_gate(gate: str | None) -> None:
    """With a gate file named: report readiness (`<gate>.<pid>.ready`), then wait until the gate
    file exists, so that several engines send their requests at the same moment."""
    if not gate:
        return
    Path(f"{gate}.{os.getpid()}.ready").touch()
    while not Path(gate).exists():
        time.sleep(0.01)


def _make_llm(run: EngineRun) -> Any:
    """The tiny-model engine the tests use (CPU, float32, eager, small budgets)."""
    from vllm import LLM

    return LLM(
        model=run.model_dir,
        max_model_len=128,
        enforce_eager=True,
        dtype="float32",
        limit_mm_per_prompt={"image": 1},
        max_num_seqs=4,
        max_num_batched_tokens=256,
        ec_transfer_config=run.ec_transfer_config,
        disable_log_stats=False,  # fills RequestOutput.metrics (time to first token)
        seed=0,
    )


def run_engine(run: EngineRun) -> None:
    """Entry point of a fresh process: run `run` on a real vLLM engine and write its result JSON."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)  # one process group with everything vLLM starts, for spawn_engine to reap
    work_dir = Path(run.result_path).with_suffix(".d")
    work_dir.mkdir(parents=True, exist_ok=True)
    env = engine_environment(run, work_dir)
    os.environ.update(env)
    _install_hooks()
    log_path = Path(env["SHMCACHE_VLLM_ENCODER_LOG"])
    log_path.touch()
    if run.build_model:
        from tests.vllm.model import build_tiny_llava

        build_tiny_llava(Path(run.model_dir))

    start = time.perf_counter()
    llm = _make_llm(run)
    startup_s = time.perf_counter() - start
    startup_events = len(_read_events(log_path))
    _wait_at_gate(os.environ.get(START_GATE_ENV))

    start = time.perf_counter()
    requests = _generate(llm, run)
    generate_s = time.perf_counter() - start

    start = time.perf_counter()
    llm.llm_engine.engine_core.shutdown(timeout=60)  # vLLM's 5 s default can SIGKILL EngineCore mid-cleanup
    del llm
    shutdown_s = time.perf_counter() - start

    events = _read_events(log_path)
    after = events[startup_events:]
    runner = [e for e in after if e["kind"] == "runner"]
    result = EngineResult(
        requests=requests,
        encoder_runs=sum(len(e["mm_hashes"]) for e in runner),
        encoder_calls=len(runner),
        encoded_mm_hashes=[h for e in runner for h in e["mm_hashes"]],
        vision_tower_images=sum(e["images"] for e in after if e["kind"] == "tower"),
        startup_vision_tower_images=sum(e["images"] for e in events[:startup_events] if e["kind"] == "tower"),
        startup_s=startup_s,
        generate_s=generate_s,
        shutdown_s=shutdown_s,
        pids=sorted({os.getpid(), *(e["pid"] for e in events)}),
        log_path=str(log_path),
    )
    tmp = Path(run.result_path + ".tmp")
    tmp.write_text(json.dumps(asdict(result), indent=1))
    tmp.replace(run.result_path)


class EngineFailed(RuntimeError):
    pass


def _reap_group(pgid: int, grace: float = 5.0) -> bool:
    """Wait up to `grace` s for process group `pgid` (ours) to empty, then SIGKILL what is left.

    Returns True if anything was left to kill."""
    deadline = time.monotonic() + grace
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    return True


class EngineProcess:
    """A running `run_engine(run)` in its own spawned process (and process group)."""

    def __init__(self, run: EngineRun) -> None:
        self.run = run
        self._process = multiprocessing.get_context("spawn").Process(
            target=run_engine, args=(run,), name="vllm-engine"
        )
        self._process.start()
        assert self._process.pid is not None
        self.pid: int = self._process.pid

    def is_alive(self) -> bool:
        return self._process.is_alive()

    def wait(self, timeout: float = 300.0) -> EngineResult:
        """Wait for the engine and return its result; whatever the outcome, nothing it started survives.

        Raises `EngineFailed` if it fails, times out, or leaves a process behind."""
        self._process.join(timeout)
        timed_out = self._process.is_alive()
        leftover = _reap_group(self.pid, grace=0.0 if timed_out else 5.0)
        self._process.join(10)
        if timed_out:
            raise EngineFailed(f"engine timed out after {timeout} s: {self.run.result_path}")
        if self._process.exitcode != 0:
            raise EngineFailed(f"engine exited with {self._process.exitcode}: {self.run.result_path}")
        if leftover:
            raise EngineFailed(f"engine left processes behind (killed): {self.run.result_path}")
        return EngineResult.load(self.run.result_path)

    def kill(self) -> None:
        """Kill the engine and everything it started (for cleanup after a failure elsewhere)."""
        _reap_group(self.pid, grace=0.0)
        if self._process.is_alive():  # killed before it made its own process group
            self._process.kill()
        self._process.join(10)


def spawn_engine(run: EngineRun, timeout: float = 300.0) -> EngineResult:
    """Run `run_engine(run)` in a fresh spawned process and return its result (see `EngineProcess`)."""
    return EngineProcess(run).wait(timeout)
