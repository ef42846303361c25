"""Tests for settings.py: the pipeline's variables, read once."""

from __future__ import annotations

import pytest

from segflow.errors import InvalidSetting
from segflow.settings import PipelineEnv


def test_unset_is_every_default():
    assert PipelineEnv.read({}) == PipelineEnv()


def test_each_variable_is_read():
    env = {"SEGFLOW_OPTIMIZE": "0", "SEGFLOW_NO_FOLD": "1", "SEGFLOW_NO_LAYOUT": "yes",
           "SEGFLOW_COMPILE": " none ", "SEGFLOW_INTRA_OP_THREADS": "3",
           "SEGFLOW_ONEDNN_DIRECT": "0", "SEGFLOW_ONEDNN_BLOCKED": "0", "SEGFLOW_ARENA": "0",
           "SEGFLOW_ONEDNN_REPLAY": "0", "SEGFLOW_PREBUILD": "0", "SEGFLOW_WINOGRAD": "1",
           "SEGFLOW_STRASSEN": "0", "SEGFLOW_DEBUG": "1"}
    read = PipelineEnv.read(env)
    assert not read.optimize and read.passes_off == {"fold_constants", "layout"}
    assert read.compile == "none" and read.intra_op_threads == 3 and read.debug == 1
    assert not (read.onednn_direct or read.onednn_blocked or read.arena or read.onednn_replay
                or read.prebuild)
    assert read.auto_choices == {"winograd": True, "strassen": False}   # the others: auto


def test_fuse_rules_by_name_leave_the_pass_on():
    read = PipelineEnv.read({"SEGFLOW_NO_FUSE": "conv, batchnorm"},
                            fuse_rules=("batchnorm", "conv"))
    assert read.fuse_rules_off == {"batchnorm", "conv"} and "fuse" not in read.passes_off
    assert "fuse" in PipelineEnv.read({"SEGFLOW_NO_FUSE": "1"}).passes_off
    with pytest.raises(InvalidSetting, match=r"^SEGFLOW_NO_FUSE='bn': unknown fuse rules"):
        PipelineEnv.read({"SEGFLOW_NO_FUSE": "bn"}, fuse_rules=("batchnorm",))


def test_bad_values_name_the_variable():
    with pytest.raises(InvalidSetting, match="^SEGFLOW_NO_FOLD='maybe': expected 0 or 1"):
        PipelineEnv.read({"SEGFLOW_NO_FOLD": "maybe"})
    with pytest.raises(InvalidSetting, match="^SEGFLOW_INTRA_OP_THREADS='0'"):
        PipelineEnv.read({"SEGFLOW_INTRA_OP_THREADS": "0"})
