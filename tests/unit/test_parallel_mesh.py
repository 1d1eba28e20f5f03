import pytest

from titan_mm.parallel.mesh import ParallelDims


def test_infer_dp_shard():
    pd = ParallelDims(tp=2, cp=2, world_size=8)
    assert pd.dp_shard == 2 and pd.fsdp == 4


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(tp=3, world_size=8), "does not divide world_size(8)"),
        (dict(dp_shard=2, tp=2, world_size=8), "!= world_size(8)"),
        (dict(dp_shard=2, ep=4, world_size=2), "ep(4) does not divide dp_shard(2) * cp(1) = 2"),
        (dict(tp=0, world_size=1), "parallel.tp must be an integer >= 1"),
    ],
)
def test_rejects_impossible(kw, msg):
    with pytest.raises(ValueError) as e:
        ParallelDims(**kw)
    assert msg in str(e.value)


def test_ep_borrows_from_dp_shard_and_cp():
    pd = ParallelDims(dp_shard=2, cp=2, ep=4, world_size=4)
    assert pd.ep_fsdp == 1
    pd = ParallelDims(dp_shard=4, ep=2, world_size=4)
    assert pd.ep_fsdp == 2


def test_check_model():
    pd = ParallelDims(tp=2, dp_shard=1, ep=1, world_size=2)
    with pytest.raises(ValueError, match=r"tp\(2\) does not divide num_key_value_heads\(1\)"):
        pd.check_model(num_heads=4, num_kv_heads=1)
    pd = ParallelDims(dp_shard=2, ep=2, world_size=2)
    with pytest.raises(ValueError, match=r"ep\(2\) does not divide num_experts\(3\)"):
        pd.check_model(num_heads=4, num_kv_heads=2, num_experts=3)
    pd = ParallelDims(dp_shard=1, cp=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        pd.check_model(num_heads=4, num_kv_heads=2, seq_len=34)


def test_world1_no_process_group():
    pd = ParallelDims(world_size=1)
    assert pd.build_meshes() == {} and pd.mesh("fsdp") is None and pd.fsdp_mesh() is None
