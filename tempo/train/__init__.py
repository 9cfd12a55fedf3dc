"""Training machinery shared by every loop: runtime, the one training step, optimizers, checkpoints, logs, flags."""
