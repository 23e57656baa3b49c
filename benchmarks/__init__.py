"""Benchmarks, each a question a user asks, each writing its raw output next to a markdown table
(`report`); current results on BENCHMARKS.md. They measure the library and are not part of it:
they live at the repository root, outside the installed package, and run from there
(`python -m benchmarks.NAME`); no module of `sbd_jax` imports them.

table1            the paper's Table 1 at small scale (accuracy, NFE speedup, wall-clock)
decode_speed      tokens per second of NTP and SBD at known tokens per forward
synthetic_acceptance  verified SBD against NTP at drafts accepted k per check by construction
batch_throughput  batches, lockstep and refill on a trained model
serve_load        the HTTP server under 1-64 clients, as vLLM's serving benchmark measures it
rules             every reveal rule side by side, plain and verified
precision         what bfloat16 does to verified decoding's "token for token"
departures        which of the README job's departures from the paper matter
jsonl_tasks       the paper's recipe on JSONL tasks (copy, reversal, a letter mapping)
tradeoff          accuracy against NFE speedup of evaluated runs, one figure
compile_cache     what JAX's persistent compilation cache saves a restart
train_step        an SBD train step against an NTP step
tpu_time          time(n) of the decode forward on TPU slices, by XLA's cost model
tpu_train_step    the 8B train step on TPU slices, NTP and SBD, calibrated against MaxText
roofline          the paper's Tables 3-4 (`roofline_model`: the cost model)
side_by_side, forward_timing, decode_timing, prediction, xla_cpu   how they time
"""
