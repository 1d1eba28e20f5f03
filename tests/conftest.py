import os

import pytest
import torch

# Tests are small; one intra-op thread keeps the 2-core CI machine responsive for multi-process tests.
torch.set_num_threads(int(os.environ.get("TITAN_TEST_THREADS", "1")))


# The quick suite (`pytest -q tests`) stays under 10 minutes on 2 cores: these cases (10-100 s each on that
# machine, `--durations`) run in the slow suite (`pytest -q -m slow tests`, also in CI). Each keeps a quicker
# sibling in the quick suite where one exists (world 2 for world 4, one family's debug run for all).
SLOW = (
    "tests/unit/test_kernels_compile.py::",
    "tests/unit/test_kernels_reference.py::test_matches_reference",
    "tests/unit/test_kernels_tuning.py::test_tuning_in_interpreter",
    "tests/unit/test_paged_decode.py::test_triton_kernel_matches_the_reference_in_the_interpreter",
    "tests/unit/test_grouped_mm.py::test_triton_grouped_mm_matches_the_loop_in_the_interpreter",
    "tests/multiproc/test_balance_world4.py::test_placement_keeps_losses_and_grads[vl]",
    "tests/multiproc/test_balance_world4.py::test_trainer_logs_balance_metrics",
    "tests/multiproc/test_balance_world4.py::test_placement_keeps_losses_and_grads[text]",
    "tests/multiproc/test_encoder_balance_world.py::",
    "tests/unit/test_kernels_model.py::",
    "tests/multiproc/test_parallel_vl.py::test_vl_matches_world1[world4]",
    "tests/multiproc/test_parallel_vl.py::test_vl_tp_modes_match_world1[dense-cp2xtp2-sp-lp]",
    "tests/multiproc/test_parallel_vl.py::test_vl_tp_modes_match_world1[moe-tp2-",
    "tests/multiproc/test_parallel_vl.py::test_vl_tp_modes_match_world1[dense-tp2-sp-lp-encodertp]",
    "tests/multiproc/test_trainer_world_change.py::",
    "tests/multiproc/test_trainer_multiproc.py::",
    "tests/multiproc/test_bench_scripts.py::",
    "tests/multiproc/test_parallel_checkpoint.py::test_resume_under_another_topology",
    "tests/multiproc/test_parallel_cp.py::test_cp_matches_world1[world4]",
    "tests/multiproc/test_parallel_tp_ep.py::test_matches_world1[world4]",
    "tests/multiproc/test_parallel_tp_ep.py::test_matches_world1[world2-kernels]",
    "tests/multiproc/test_muon_distributed.py::test_fsdp_x_tp_hsdp_ep_world4_matches_single_device",
    "tests/multiproc/test_seeded_init.py::test_init_independent_of_world_size[tp2_fsdp2]",
    "tests/multiproc/test_seeded_init.py::test_init_independent_of_world_size[ep2_fsdp2]",
    "tests/multiproc/test_parallel_fsdp.py::test_fsdp_matches_world1[hsdp2x2-sac]",
    "tests/multiproc/test_parallel_qwen3_5.py::",
    "tests/multiproc/test_parallel_omni.py::",
    "tests/parity/test_serve_qwen3_5.py::test_greedy_matches_transformers_generate[general_path-",
    "tests/parity/test_serve_qwen3_5.py::test_greedy_matches_transformers_generate[preemption",
    "tests/parity/test_serve_qwen3_5.py::test_greedy_matches_transformers_generate[chunked_prefill-moe]",
    "tests/parity/test_serve_qwen3_5.py::test_beam_search_matches_transformers[preempting]",
    "tests/parity/test_processor_qwen2_5_vl.py::test_video_parity[121-",
    "tests/parity/test_processor_qwen2_5_vl.py::test_loader_trains_qwen2_5_vl_video",
    "tests/unit/test_train_e2e.py::test_debug_config_trains_checkpoints_and_exports[qwen2",
    "tests/unit/test_train_e2e.py::test_debug_config_trains_checkpoints_and_exports[qwen3_",
    "tests/unit/test_train_signals.py::test_sigterm_to_the_whole_process_group_with_loader_workers",
    "tests/unit/test_train_signals.py::test_signal_saves_exits_with_one_line_and_resumes[2]",
    "tests/unit/test_train_signals.py::test_second_signal_exits_at_once_and_keeps_the_last_checkpoint",
)


@pytest.fixture
def all_threads():
    """A slow single-process training run (the accuracy cases) takes every core; other tests keep one thread."""
    n = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(n)


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; run on the H200 through the device tool")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
