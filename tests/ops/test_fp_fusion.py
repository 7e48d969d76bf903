"""Importing lockstep's ops pins Triton's floating-point fusion on (the setting every measured bit was made with), so
a Triton whose default changes does not move the bits; a value the user set is kept."""

import os
import subprocess
import sys

import pytest

SCRIPT = "import os, lockstep.ops; print(os.environ['TRITON_DEFAULT_FP_FUSION'])"


@pytest.mark.parametrize("preset, want", [(None, "1"), ("0", "0")])
def test_fp_fusion_is_pinned_unless_set(preset: str | None, want: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if preset is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = preset
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == want
