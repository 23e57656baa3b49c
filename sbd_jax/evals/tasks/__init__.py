"""Evaluation tasks: the built-in arithmetic problems and GSM8K / MATH500 / HumanEval / MBPP files.

`registry.get(name)` gives a `task.Task`; `benchmarks` defines the file tasks, `arithmetic` the
built-in one; `answers`, `code` and `execution` extract, prepare and run what models write.
"""
