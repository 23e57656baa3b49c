"""Training: `trainer.train(config, workdir)` and what it is made of.

state, step      the sharded train state (abstract first) and the jitted train step
trainer          the loop: restore or init, step, log, checkpoint, export
optim            AdamW with warm-up, cosine decay and clipping
checkpointing    Orbax checkpoints (train state + data iterator) and params exports
workdir          a workdir's layout, its config, what a resume may change
metrics, dashboards, metrics_plot, stopping
"""
