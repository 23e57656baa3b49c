"""A run's directory: its layout and config (`workdir`), its Orbax checkpoints and params export
(`checkpointing`), and loading its trained model to decode (`loading`, `compare`). Training
writes it; sampling, evaluation, serving and conversion read it."""
