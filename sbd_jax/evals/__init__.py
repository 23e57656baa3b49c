"""Evaluation: tasks, the decode-and-score runner, statistics, diagnostics."""
