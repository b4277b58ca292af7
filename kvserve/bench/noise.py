"""How much CPU other processes (and the hypervisor: steal) took during a timed run, from
/proc/stat: on a shared machine a figure is only as good as the quiet it was measured in."""

from __future__ import annotations

import os
import time

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_snapshot() -> tuple[float, float, float, float] | None:
    """(system busy s, steal s, own process cpu s, monotonic s); None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    t = os.times()
    return ((user + nice + system + irq + softirq) / _CLK_TCK, steal / _CLK_TCK,
            t.user + t.system, time.monotonic())


def _interference(before, after) -> dict:
    """Cores' worth of CPU used by other processes (+ steal) between two snapshots."""
    if before is None or after is None:
        return {}
    wall = max(after[3] - before[3], 1e-9)
    own = after[2] - before[2]
    other = max(after[0] - before[0] - own, 0.0)
    steal = after[1] - before[1]
    return {"own_cores": own / wall, "foreign_cores": (other + steal) / wall,
            "steal_cores": steal / wall}


class Interference:
    """`with Interference() as n: ...` then `n.result`: own, foreign and steal cores."""

    def __enter__(self):
        self.before = _cpu_snapshot()
        return self

    def __exit__(self, *exc):
        self.result = _interference(self.before, _cpu_snapshot())
        return False


def wait_for_quiet(threshold: float, max_wait: float) -> float:
    """Sample 1 s windows until other processes use < threshold cores (or max_wait passes);
    returns the foreign load of the last window."""
    deadline = time.monotonic() + max_wait
    while True:
        with Interference() as probe:
            time.sleep(1.0)
        load = probe.result.get("foreign_cores", 0.0)
        if load < threshold or time.monotonic() >= deadline:
            return load
