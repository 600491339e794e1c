"""What a benchmark records about the machine it ran on, so that `report.py` can say it under each table.

    from machine import describe      # benchmarks/ is the script's folder: `python benchmarks/x.py`
    json.dump({"env": describe(jax=jax.__version__), ...}, f)
"""
from __future__ import annotations

import datetime
import os
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else `platform.processor()`, else "unknown"."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe(**extra) -> dict:
    """{cpu, cpu_count, machine, platform, date, **extra}: the fields `report.machine` reads."""
    return {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "machine": platform.machine(), "platform": platform.platform(),
            "date": datetime.date.today().isoformat(), **extra}
