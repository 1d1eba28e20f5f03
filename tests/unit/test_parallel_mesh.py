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


def test_check_model_rejects_unsupported_matrix_cells():
    """Cells of the issue-8 matrix that cannot exist: ep on a dense model (Qwen3, Qwen3-VL dense), Ulysses with
    cp * tp above the kv heads (the tiny test configs have 2: cp2 x tp2 runs ring / all-gather instead)."""
    for dims in (dict(dp_shard=2, ep=2, world_size=2), dict(dp_shard=4, ep=2, world_size=4),
                 dict(dp_shard=2, tp=2, ep=2, world_size=4)):
        with pytest.raises(ValueError, match=r"ep\(2\) > 1 but the model has no experts; set parallel.ep = 1"):
            ParallelDims(**dims).check_model(num_heads=4, num_kv_heads=2, num_experts=0)
    pd = ParallelDims(dp_shard=1, cp=2, tp=2, world_size=4)
    with pytest.raises(ValueError, match=r"Ulysses CP needs cp\(2\) \* tp\(2\) to divide .*num_key_value_heads\(2\); "
                                         r"use cp_mode='ring'"):
        pd.check_model(num_heads=4, num_kv_heads=2, cp_ulysses=True)
    pd.check_model(num_heads=4, num_kv_heads=2, cp_ulysses=False)  # ring / all-gather take any head count


@pytest.mark.parametrize(
    "args,dims,msg",
    [
        (["--model.name", "qwen3"], dict(dp_shard=2, ep=2, world_size=2), "model has no experts"),
        (["--model.name", "qwen3_vl"], dict(dp_shard=2, ep=2, world_size=2), "model has no experts"),
        (["--model.name", "qwen3_moe", "--parallel.cp_mode", "ulysses"], dict(dp_shard=1, cp=2, tp=2, world_size=4),
         "Ulysses CP needs cp(2) * tp(2)"),
        # the check is on the padded row length (102 -> 112), which cp=2 would split fine
        (["--model.name", "qwen3", "--data.seq_len", "102"], dict(dp_shard=1, cp=3, world_size=3),
         "row length 112 (data.seq_len rounded up by the data pipeline) is not a multiple of tp(1) * 2 * cp(3) = 6"),
    ],
)
def test_trainer_checks_the_model_up_front(args, dims, msg):
    """The trainer calls check_model right after resolving the model config (before building anything)."""
    import torch

    from titan_mm.config import ConfigError, load_config
    from titan_mm.train.setup import check_parallel, model_from_config

    cfg = load_config(["--model.flavor", "debug", *args])
    spec, mcfg = model_from_config(cfg, torch.device("cpu"))
    with pytest.raises(ConfigError) as e:
        check_parallel(cfg, ParallelDims(**dims), spec, mcfg)
    assert str(e.value).startswith("[parallel] ") and msg in str(e.value)
    check_parallel(cfg, ParallelDims(dp_shard=dims["world_size"], world_size=dims["world_size"]), spec, mcfg)
