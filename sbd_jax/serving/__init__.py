"""Serving a trained model over HTTP (`python -m sbd_jax.serve`).

slots     fixed-shape decode rows on device: admit a prompt into a row, advance every row a
          bounded number of forwards (jitted; few compilations)
engine    the host loop: a bounded queue of requests, admission into free rows between calls,
          streaming of settled tokens, cancellation, draining on shutdown
protocol  OpenAI-compatible request and response bodies, validated in one place
app       the FastAPI application: /v1/completions, /v1/chat/completions, /v1/models, /health
lm_eval_task  the built-in task as an lm-evaluation-harness task over a local JSONL file
"""
