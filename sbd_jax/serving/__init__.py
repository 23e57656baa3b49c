"""Serving a trained model over HTTP (`python -m sbd_jax.serve`).

slots     fixed-shape decode rows on device: admit a prompt into a row, advance every row a
          bounded number of forwards (jitted; few compilations)
pool      the rows of one compiled setting: admission, one device call per pass, settled tokens
          passed on to their requests
engine    the host loop: a bounded queue of requests, a pool per compiled setting (an allow-list
          made at start-up), cancellation, draining on shutdown, failure and hang detection
protocol  OpenAI-compatible request and response bodies, validated in one place
intake    a body from bytes to a validated request, each step bounded before it does work per item
text_stream  a choice's text as its tokens arrive, cut at stop strings and stop token ids
stops     stop strings found as the text grows (an automaton: a step per new character)
app       the FastAPI application: /v1/completions, /v1/chat/completions, /v1/models, /health
lm_eval_task  the built-in task as an lm-evaluation-harness task over a local JSONL file
"""
