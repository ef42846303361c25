"""Host memory policy: resolution, where it applies, and that ``retain`` stops re-faulting.

malloc's configuration is process-wide and ``retain`` is one-way, so the fault
counts are measured in fresh subprocesses, one per policy.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from segflow.ir.types import Device
from segflow.runtime.host_memory import HostMemory, apply_host_memory
from segflow.settings import ENV_HOST_MEMORY

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_resolve_api_then_environment_then_retain() -> None:
    assert HostMemory.resolve(None, env={}) is HostMemory.RETAIN
    assert HostMemory.resolve(None, env={ENV_HOST_MEMORY: "system"}) is HostMemory.SYSTEM
    assert HostMemory.resolve(" Retain ", env={ENV_HOST_MEMORY: "system"}) is HostMemory.RETAIN
    assert HostMemory.resolve(HostMemory.SYSTEM, env={}) is HostMemory.SYSTEM


def test_resolve_names_the_source_of_a_bad_value() -> None:
    with pytest.raises(ValueError, match=r"^host_memory='arena': expected one of retain, system$"):
        HostMemory.resolve("arena", env={})
    with pytest.raises(ValueError, match=rf"^{ENV_HOST_MEMORY}='keep': expected one of"):
        HostMemory.resolve(None, env={ENV_HOST_MEMORY: "keep"})


def test_only_cpu_sessions_that_ask_for_it_change_malloc() -> None:
    assert apply_host_memory(HostMemory.SYSTEM, Device.parse("cpu")) is HostMemory.SYSTEM
    assert apply_host_memory(HostMemory.RETAIN, Device.parse("cuda:0")) is HostMemory.SYSTEM
    expected = HostMemory.RETAIN if GLIBC else HostMemory.SYSTEM
    assert apply_host_memory(HostMemory.RETAIN, Device.parse("cpu")) is expected


def test_a_session_records_the_policy_in_force() -> None:
    import segflow
    from segflow.models import build, example_inputs

    sess = segflow.InferenceSession(build("mlp_chain", layers=2), host_memory="system")
    sess.run(None, example_inputs("mlp_chain", layers=2))
    assert sess.last_run_stats is not None
    assert sess.last_run_stats.settings["host_memory"] == "system"
    with pytest.raises(ValueError, match="host_memory='never'"):
        segflow.InferenceSession(build("mlp_chain", layers=2), host_memory="never")


# A session, then 48 MiB blocks allocated, written and freed in turn: above glibc's
# largest dynamic mmap threshold (32 MiB), so under its own policy every block is
# fresh zero-filled pages (12,288 faults); retained, the heap reuses the first block.
_PROBE = """
import json, resource, sys, torch, segflow
from segflow.models import build
segflow.InferenceSession(build("mlp_chain", layers=2), host_memory=sys.argv[1])
faults = []
for _ in range(4):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(12 << 20).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""


def _faults(policy: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", _PROBE, policy], capture_output=True,
                         text=True, check=True, timeout=300)
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not GLIBC, reason="mallopt tuning is glibc-only")
def test_retain_reuses_freed_blocks_instead_of_faulting_them_in_again() -> None:
    pages = (48 << 20) // 4096
    system = _faults("system")
    retain = _faults("retain")
    assert min(system[1:]) > pages // 2, system
    assert max(retain[1:]) < pages // 20, retain
