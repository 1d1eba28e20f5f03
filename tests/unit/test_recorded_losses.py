"""Every debug config trains to the losses recorded before a refactor (tests/fixtures/debug_losses.json, made by
tests/fixtures/record_losses.py at the commit it names): a change that claims to move code without changing the
arithmetic proves it here.

Bitwise where the recording's machine fingerprint (record_losses.machine: torch version, CPU kernel family, CPU
model, flags, cache size, threads) is this machine's: the same code then runs the same instructions (the kernel
family alone was not enough: a CI machine with the recording's torch and AVX512 moved one loss by 1.4e-7).
Elsewhere fp32 reductions may run in another order (another SIMD width): each step's loss may move by a few units
of fp32 roundoff times the reduction depth, and three AdamW steps at lr 3e-3 carry that into the weights, so the
bound is relative 1e-4 there (the smallest loss change a real arithmetic difference makes in these runs, e.g. one
token's weight, is above 1e-3)."""

import json
from pathlib import Path

import pytest

from tests.fixtures.record_losses import debug_configs, machine, train

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads((ROOT / "tests/fixtures/debug_losses.json").read_text())
SAME_MACHINE = FIXTURE["machine"] == machine()


def test_every_recorded_config_still_exists():
    """Configs added after the recording have no "before" (record them at the next refactor's start)."""
    assert set(FIXTURE["configs"]) <= set(debug_configs(ROOT))


@pytest.mark.slow
@pytest.mark.parametrize("config", sorted(FIXTURE["configs"]))
def test_debug_config_trains_to_the_recorded_losses(config, tmp_path):
    got = train(ROOT, config, tmp_path)
    want = FIXTURE["configs"][config]
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm"):
            if SAME_MACHINE:
                assert g[key] == w[key], f"{config} step {g['step']} {key}: {g[key]!r} != recorded {w[key]!r}"
            else:
                assert g[key] == pytest.approx(w[key], rel=1e-4), f"{config} step {g['step']} {key}"
