"""vllm-bole's vLLM adapter: the only package (with ``vllm_bole.plugin``) that imports vLLM.

* :mod:`.config_hook`: the user's ``{"method": "bole_tree", ...}`` speculative config -> vLLM's
  native configuration (installed by :func:`register` in every process that loads the plugin).
* :mod:`.worker`: CPU / GPU workers whose model side is built without vLLM's speculative config.
* :mod:`.runner`: the V1 model-runner mixin (tree steps, verification, commit, drafting).
* :mod:`.layers`: attention / Mamba2 / GDN overrides active during tree steps only.
* :mod:`.proposer`: the class name vLLM's config carries (refuses to be used by vLLM itself).
"""
from __future__ import annotations


def register() -> None:
    """Install the config hook (idempotent). Workers and runners are imported by vLLM by name."""
    from vllm_bole.adapter import config_hook

    config_hook.install()
