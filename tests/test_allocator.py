"""distflow.core.allocator: a process keeps its freed step buffers (no page faults to refill
them), and DISTFLOW_MALLOC_TUNING=0 leaves glibc's defaults. Each case runs in a fresh
interpreter: the thresholds are process-wide and the test process's history would blur them."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from tests.conftest import ROOT

STEP = """
import resource, numpy as np
from distflow.core.allocator import keep_freed_memory
tuned = keep_freed_memory()
def step():  # a step's buffers: 4 MiB in 100 KiB blocks, from the heap, all freed at its end
    blocks = [np.ones(100 * 1024 // 8) for _ in range(40)]
    del blocks
step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(tuned, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
"""


def faults_per_step(tuning: str) -> tuple[bool, float]:
    env = {**os.environ, "DISTFLOW_MALLOC_TUNING": tuning}
    out = subprocess.run([sys.executable, "-c", STEP], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_step_buffers_are_reused_not_faulted_again():
    tuned, faults = faults_per_step("1")
    default, faults_default = faults_per_step("0")
    assert tuned and not default
    # glibc's default trims the 4 MiB heap top every step, so refilling it faults ~1,000 pages
    assert faults_default >= 900, faults_default
    assert faults == 0, faults
