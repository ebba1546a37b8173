"""Movers: where a message's bytes live (shared memory, a same-host post, NCCL, CUDA IPC handles)."""
