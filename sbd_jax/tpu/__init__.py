"""TPU slices from a machine without one: their devices, the real programs compiled ahead of time for them, and what those programs need."""
