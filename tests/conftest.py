"""Suite-wide guards.

Triton kernels are tested on every run: on CUDA natively, on CPU through Triton's interpreter,
which must be enabled before triton is imported. A CPU run without TRITON_INTERPRET=1 would
silently test nothing of the kernels, so it is refused here.
"""
import os

import pytest
import torch


def pytest_configure(config):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        raise pytest.UsageError("no GPU: run the tests with TRITON_INTERPRET=1 (see README)")


@pytest.fixture(scope="session", autouse=True)
def forked_runs():
    """In-process engine runs fork from a process that has imported vLLM (``isolation.forked_runs``)."""
    from vllm_bole.testing.isolation import forked_runs

    with forked_runs():
        yield


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """The tiny checkpoints (built once per session, in a subprocess)."""
    from vllm_bole.testing.engine_run import build_models

    return build_models(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def engines(models):
    """The shared engine runs of the engine-level tests (``tests/engines.py``)."""
    from engines import Engines

    return Engines(models)
