"""Code run in a fresh interpreter: what must not share this process (forks, thread setup)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest


def script_words(script, *args, env=None, timeout=600):
    """Runs ``script`` in a fresh interpreter with ``args`` as its ``sys.argv[1:]`` and returns
    what it printed, split into words; a failure fails the test (``CalledProcessError``)."""
    res = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
        env=env,
    )
    return res.stdout.split()


def run_isolated(code, *, env=None, timeout=120):
    """Runs ``code`` in a fresh interpreter (its own session) and returns the JSON it prints last.
    A hang kills the whole process group, forked children included, and fails the test."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"hung: no result within {timeout} s")
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])
