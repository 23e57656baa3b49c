"""TPU slices from a machine without one: their devices (`topology`), the real train step and
decode loop compiled for them (`programs`), and what those programs need (`report`)."""
