"""Test helpers: a session's kernel choices, and the target seen as another CPU."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

import segflow.kernels.target as target_module
from segflow.ir.graph import Node
from segflow.kernels.choice import KernelChoice, KernelKind
from segflow.kernels.target import CpuTarget


def choice(sess: Any, node: Node) -> KernelChoice:
    """The kernel ``sess``'s plan chose for ``node``."""
    return sess.plan.choices[node]


def kind(sess: Any, node: Node) -> KernelKind:
    return sess.plan.choices.kind(node)


def count(sess: Any, *kinds: KernelKind) -> int:
    """How many of ``sess``'s nodes run one of ``kinds``."""
    counts = sess.plan.choices.counts()
    return sum(counts[k] for k in kinds)


def as_cpu(monkeypatch: pytest.MonkeyPatch, *, avx512: bool) -> None:
    """Sessions made from now on see a CPU whose torch kernels are (or are not)
    AVX-512 ones: what the heuristics choose by (the kernels run on either)."""
    monkeypatch.setattr(target_module, "cpu_capability",
                        lambda: "AVX512" if avx512 else "AVX2")


def patch_target(monkeypatch: pytest.MonkeyPatch, **fields: Any) -> None:
    """Sessions made from now on see the detected target with ``fields`` replaced."""
    detect = CpuTarget.detect
    monkeypatch.setattr(CpuTarget, "detect", staticmethod(lambda: replace(detect(), **fields)))
