"""Triton kernels of vllm-bole. Each kernel has a plain-torch twin in ``vllm_bole`` that is the
CPU path and the test oracle's twin. On CPU, kernels run only under ``TRITON_INTERPRET=1``
(set before import)."""
