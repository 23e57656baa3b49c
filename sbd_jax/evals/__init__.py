"""Evaluation: decode a task's problems with NTP and SBD, score them, summarise.

tasks/         the built-in arithmetic task and GSM8K / MATH500 / HumanEval / MBPP files
runner         the decode-and-score loop, in memory or resumable on disk
results        one result schema and its views (a table, Table 1's markdown, dashboards)
workdir_eval   a trained workdir on a task (what `python -m sbd_jax.evaluate` runs)
stats, scoring, diagnostics
"""
