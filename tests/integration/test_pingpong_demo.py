"""The quickstart demo runs end to end on its own embedded nats-server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pingpong_demo_completes_a_rally_on_the_embedded_server() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    result = subprocess.run(
        [sys.executable, "-m", "apps.pingpong", "--count", "40"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "embedded nats-server" in result.stdout
    assert "│    40 │" in result.stdout  # the rally table counts every pong
