"""Starting DistFlow: the command line, ``distflow run`` and its supervision, the in-process
mode, the checks before a run, GPU placement, the run state a checkpoint carries, and the Slurm and Kubernetes renderers.

This is the top layer: it imports the node loops, nothing below imports it (but
:mod:`distflow.launch.checkpoint`, a torch-free leaf the trainer writes through).
"""
