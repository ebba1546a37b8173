"""A calibrated discrete-event model of one DistFlow step and of the ``controller: single`` baseline.

Why it exists: the paper's claim (near-linear scaling to 1024 GPUs, a single controller the
bottleneck) cannot be run here. This package simulates it from parts that are measured or real:
compute from a cost table (an assumption, stated), routing by the nodes' own functions
(``distflow.buffer.routing``), and per-message / per-byte CPU costs from this project's benches.
``engine`` (events, FIFO servers, processor-shared cores), ``costs`` (cost tables, workloads,
network), ``calibrate`` (costs from the benches' JSON lines), ``cluster`` (the two step topologies
at any N), ``local`` (the same step on this machine's cores, to check the model against real runs).
"""
