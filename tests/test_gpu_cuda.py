"""GPU entries on a real GPU: zero copy across processes, bit identity, exporter death.

Skipped without CUDA (CI has none); tools/gpu_check.py runs the same checks with figures.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: GPU entries run only on a GPU"),
]


@pytest.mark.timeout(400)
def test_device_checks_pass() -> None:
    from tools.gpu_check import run_checks

    report = run_checks()
    assert not report.failed(), report
    assert len(report.checks) >= 20
