"""bench/wan_cp.py's counted part on 2 gloo processes: the bytes each rank hands titan_mm.parallel.cp's
collectives in one forward + backward of a Wan clip equal cp_bytes (the script exits otherwise), in Ulysses and
ring mode, and the loss is world 1's."""

import pytest

from bench.wan_cp import counted

pytestmark = pytest.mark.slow  # spawned gloo worlds: about 40 s on 2 shared cores


def test_counted_bytes_equal_the_formula(tmp_path):
    rows = counted([1, 2], tmp_path)
    assert [(r["mode"], r["cp"]) for r in rows] == [("ulysses", 1), ("ulysses", 2), ("ring", 1), ("ring", 2)]
    assert all(r["payload_per_rank"] == [r["formula_payload"]] * r["cp"] for r in rows)
    assert rows[1]["formula_payload"] > 0 and rows[3]["formula_payload"] > 0
    # the same fp32 products, the attention's sums regrouped over two ranks: 1e-5 relative
    assert all(r["loss_sum"] == pytest.approx(rows[0]["loss_sum"], rel=1e-5) for r in rows)
