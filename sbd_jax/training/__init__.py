"""Training: train state and step, the loop, optimizer, checkpoints, metrics, workdirs."""
