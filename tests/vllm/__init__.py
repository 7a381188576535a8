"""Test harness that runs real vLLM (the CPU build) on a tiny random-weight LLaVA, offline.

- ``model.build_tiny_llava(path)``: the model, built deterministically and cached;
- ``engine.spawn_engine(EngineRun(...))`` / ``engine.EngineProcess``: one engine per spawned process,
  with greedy tokens, logprobs, latencies and the encoder runs counted after ``vllm.LLM()``;
- ``site/sitecustomize.py``: the import hooks the engine processes need (torchvision alias, probe);
- ``recording_connector``: vLLM's ECExampleConnector logging every connector call;
- ``smoke``: ``python -m tests.vllm.smoke`` (the harness against vLLM's own ECExampleConnector).
"""
