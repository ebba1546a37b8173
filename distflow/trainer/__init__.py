"""Trainer: RL algorithms as pure tensor functions, the FSDP2 wrapper, checkpoints, and the trainer worker."""
