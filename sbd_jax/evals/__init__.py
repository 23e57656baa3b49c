"""Evaluation: decode a task's problems with NTP and SBD, score them, summarise.

tasks/         the built-in arithmetic task and GSM8K / MATH500 / HumanEval / MBPP files
runner         the decode-and-score loop, in memory or resumable on disk
results        one result schema and its views (a table, Table 1's markdown, dashboards)
workdir_eval   a trained workdir on a task (what `python -m sbd_jax.evaluate` runs)
while_training the held-out decode of an evaluation while training (`eval.decode_problems`)
diagnostics    a weak model or a bug? (`evaluate --diagnostics`), from heldout_rows (packed
               held-out rows, their NTP loss), block_losses (MATP loss by block offset and
               masking level) and first_forward (what a wholly masked block gets wrong)
stats, scoring
"""
