"""TPU slices from a machine without one: their devices (`topology`), the real train step and
decode loop compiled for them (`programs`), XLA's cost model read from them (`cost`), the train
step's time (`step_time`), and what those programs need (`report`)."""
