"""bench/profile_split.py: kernels go to their categories, idle is the span minus the busy union, per step."""

from bench.profile_split import category, render, split


def _k(name, ts, dur, cat="kernel"):
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur)


def test_kernel_names_go_to_their_categories():
    assert category("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN") == "gemm"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamW>") == "optimizer"
    assert category("triton_per_fused__softmax_topk_0") == "moe_routing"
    assert category("triton_poi_fused_index_mul_sum_3") == "moe_permute"
    assert category("_gather_sum_kernel") == category("_combine_bwd_kernel") == "moe_permute"
    assert category("_rms_fwd_kernel") == "norms"
    assert category("triton_per_fused_native_layer_norm_2") == "norms"
    assert category("_ce_row_kernel") == "loss"
    assert category("void at::native::cunn_SoftMaxForward<4, float>") == "loss"
    assert category("Memcpy DtoD (Device -> Device)") == "copies"
    assert category("triton_poi_fused_gelu_gelu_backward_0") == "elementwise"
    assert category("ncclDevKernel_AllGather_RING_LL") == "comm"
    assert category("mystery") == "other"


def test_split_per_step_with_idle_and_overlap():
    ev = [_k("nvjet_a", 0, 100), _k("_rms_fwd_kernel", 150, 50), _k("Memcpy HtoD", 180, 40, "gpu_memcpy"),
          _k("nvjet_b", 300, 100), dict(ph="X", cat="cpu_op", name="aten::mm", ts=0, dur=1000)]
    ms, kernels = split(ev, steps=2)
    # busy union: [0,100] [150,220] [300,400] = 270 us over a 400 us span
    assert ms["step"] == 0.2 and ms["idle"] == 0.065
    assert ms["gemm"] == 0.1 and ms["norms"] == 0.025 and ms["copies"] == 0.02
    assert sorted(kernels["gemm"]) == [["nvjet_a", 0.05, 0.5], ["nvjet_b", 0.05, 0.5]]
    lines = render([dict(case="c", stack="titan", device="NVIDIA H100 80GB HBM3", profile_ms=ms)]).splitlines()
    # columns: the row's device, then the categories with at least 0.05 ms per step (gemm, idle), after the step
    assert lines[0] == "| case | device | stack | step ms | gemm | idle |"
    assert lines[2] == "| c | H100 80GB HBM3 | titan | 0.2 | 0.1 | 0.1 |"
