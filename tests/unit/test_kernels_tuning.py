"""Launch-config tuning happens outside the model's forward (the forward must not synchronize the GPU).

- test_tuner_bookkeeping: a stand-alone Tuner with a fake timing function (no Triton): outside `tuning()` an
  untuned key gets config 0 and the timing function is never called; inside, every candidate is timed once
  and the fastest is cached; later calls (inside or outside) reuse it; export / load of the picks.
- test_tuning_in_interpreter: runs the `test_interp_*` tests below in a child process with TRITON_INTERPRET=1
  (it must be set before triton is imported): the real kernels' forward and backward never reach the timing
  code for an untuned key (timing function mocked and allowed), `tune_for_model` fills the cache (config 0
  in the interpreter; the fastest under a fake timing function) and covers every key the tiny Qwen3,
  Qwen3-MoE and Qwen3-VL models hit, and the forward then launches the cached picks.
"""

import dataclasses
import os
import pickle
import subprocess
import sys

import pytest
import torch
from titan_mm.models.qwen3_vl.model import vision_inputs  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(not INTERP, reason="runs in the interpreter child of test_tuning_in_interpreter")


@pytest.fixture
def fake_timer(monkeypatch):
    """Timing allowed (as on a GPU) but done by a fake: records every call, config i of a key takes
    `times[i]` ms (so the fastest is known), and runs the launch so its code path is exercised."""
    from titan_mm.kernels import _utils

    calls, idx = [], [0]
    times = [3.0, 1.0, 2.0, 4.0, 5.0, 6.0]  # per candidate of a key: the second one is the fastest
    tune = _utils.Tuner._tune

    def tune_key(self, key, cands, launch):  # candidate numbering restarts per key
        idx[0] = 0
        return tune(self, key, cands, launch)

    def bench(fn):
        fn()
        calls.append(idx[0])
        idx[0] += 1
        return times[calls[-1]]

    monkeypatch.setattr(_utils, "can_time", lambda: True)
    monkeypatch.setattr(_utils, "bench_ms", bench)
    monkeypatch.setattr(_utils.Tuner, "_tune", tune_key)
    return calls


@pytest.fixture
def clean_tuner():
    from titan_mm.kernels import _utils

    _utils.reset_tuning()
    yield _utils
    _utils.reset_tuning()


# ------------------------------------------------------------------------------------------- no Triton


def test_config_sweep_covers_every_candidate():
    """kernel_checks.check_configs forces configs 1 .. CONFIGS_PER_OP[op] - 1: every candidate list must fit in it,
    or a config the tuner may pick on the GPU would never be checked."""
    import titan_mm.kernels  # noqa: F401  (registers the tuners)
    from titan_mm.kernels import _utils
    from titan_mm.tools import kernel_checks

    for t in _utils.Tuner.registry:
        op = t.name.rsplit("_", 1)[0] if t.name.endswith(("_fwd", "_bwd")) else t.name
        for key in [(4304, torch.bfloat16), (2048, torch.float32), (128, torch.bfloat16)]:
            try:
                n = len(t.configs(key))
            except Exception:  # keys of another shape (RoPE's head layout): covered by the interpreter tests
                continue
            assert n <= kernel_checks.CONFIGS_PER_OP.get(op, 4), (t.name, key, n)


def test_tuner_bookkeeping(monkeypatch):
    from titan_mm.kernels import _utils

    cands = [dict(BLOCK=64), dict(BLOCK=128), dict(BLOCK=256)]
    tuner = _utils.Tuner("fake_kernel", lambda key: cands)
    try:
        launched, timed = [], []

        def bench(fn):  # fake device time per config: BLOCK=128 is the fastest
            fn()
            timed.append(launched[-1])
            return {64: 2.0, 128: 0.5, 256: 1.0}[launched[-1]]

        monkeypatch.setattr(_utils, "can_time", lambda: True)
        monkeypatch.setattr(_utils, "bench_ms", bench)

        def launch(c):
            launched.append(c["BLOCK"])

        # the forward: default config, no timing, not cached, reported as untuned
        assert tuner.pick((8, torch.bfloat16), launch) == cands[0]
        assert tuner.pick((8, torch.bfloat16), launch) == cands[0]
        assert timed == [] and launched == [] and tuner.best == {}
        assert _utils.untuned_keys() == {"fake_kernel": [str((8, torch.bfloat16))]}
        # tuning: each candidate timed once, the fastest cached, the key no longer untuned
        with _utils.tuning():
            assert tuner.pick((8, torch.bfloat16), launch) == cands[1]
            assert tuner.pick((8, torch.bfloat16), launch) == cands[1]  # cached: not timed again
        assert timed == [64, 128, 256]
        assert tuner.best == {(8, torch.bfloat16): cands[1]}
        assert "fake_kernel" not in _utils.untuned_keys()
        assert set(_utils.tuned_configs()["fake_kernel"][str((8, torch.bfloat16))]["ms"]) == {
            "BLOCK=64", "BLOCK=128", "BLOCK=256"}
        # the forward after tuning: the cached pick, no timing
        assert tuner.pick((8, torch.bfloat16), launch) == cands[1] and len(timed) == 3
        # a config that fails is skipped and recorded

        def bad_launch(c):
            if c["BLOCK"] == 128:
                raise RuntimeError("out of resources")
            launched.append(c["BLOCK"])
        with _utils.tuning():
            assert tuner.pick((16, torch.bfloat16), bad_launch) == cands[2]
        assert "RuntimeError" in tuner.timings[(16, torch.bfloat16)]["ms"]["BLOCK=128"]
        # out of device memory is not a config failure: it propagates (tune_for_model skips that op)

        def oom_launch(c):
            raise torch.OutOfMemoryError("CUDA out of memory")

        with pytest.raises(torch.OutOfMemoryError), _utils.tuning():
            tuner.pick((24, torch.bfloat16), oom_launch)
        assert (24, torch.bfloat16) not in tuner.best
        # TITAN_KERNELS_TUNE=0 (or the interpreter): tuning() caches config 0 without timing
        monkeypatch.setattr(_utils, "can_time", lambda: False)
        n = len(timed)
        with _utils.tuning():
            assert tuner.pick((32, torch.float32), launch) == cands[0]
        assert len(timed) == n and tuner.best[(32, torch.float32)] == cands[0]
        # FORCE_CONFIG (the config sweep of the checks) wins over the cache and writes nothing
        monkeypatch.setattr(_utils, "FORCE_CONFIG", 2)
        assert tuner.pick((8, torch.bfloat16), launch) == cands[2] and tuner.best[(8, torch.bfloat16)] == cands[1]
        monkeypatch.setattr(_utils, "FORCE_CONFIG", None)
        # picks travel between processes (rank 0 -> the others) as a pickle
        picks = pickle.loads(pickle.dumps(_utils.export_picks()))
        tuner.best.clear()
        tuner.untuned[(8, torch.bfloat16)] = cands[0]
        _utils.load_picks(picks)
        assert tuner.best[(8, torch.bfloat16)] == cands[1] and (8, torch.bfloat16) not in tuner.untuned
    finally:
        _utils.Tuner.registry.remove(tuner)


def test_tune_for_model_skips_without_triton_path():
    from titan_mm.models.qwen3.config import Qwen3Config

    if INTERP:
        pytest.skip("checks the non-interpreter CPU path")
    rep = _tune(Qwen3Config(kernels=True), 128, torch.bfloat16, "cpu")
    assert rep["tuned"] == {} and rep["skipped"], rep


def test_trainer_tunes_once_on_cuda_with_kernels_on(monkeypatch):
    """titan_mm.train.setup.tune_kernels: what it hands to tune_for_model (the spec's widths for tp and
    encoder_tp, the kernels spec, this rank's tokens of a micro-batch, the compute dtype), and that it skips CPU
    runs and kernels-off models."""
    from titan_mm import kernels as K
    from titan_mm.config import load_config
    from titan_mm.parallel.mesh import ParallelDims
    from titan_mm.registry import get_model_spec
    from titan_mm.train.setup import tune_kernels

    seen = []
    monkeypatch.setattr(K, "tune_for_model", lambda *a, **kw: seen.append((a, kw)) or {"tuned": {}, "skipped": []})
    cfg = load_config(["--model.name", "qwen3", "--model.flavor", "debug", "--training.param_dtype", "bfloat16",
                       "--data.seq_len", "256", "--data.micro_batch_size", "2", "--parallel.encoder_tp", "True"])
    pd = ParallelDims(tp=2, cp=2, dp_shard=1, world_size=4)
    mc, spec = _qwen3_cfg(), get_model_spec("qwen3")
    assert tune_kernels(cfg, spec, mc, pd, torch.device("cuda")) is not None
    (args, kw), = seen
    assert args == (spec.kernel_shapes(mc, tp=2, encoder_tp=True), True, 2 * 256 // 2, torch.bfloat16,
                    torch.device("cuda")) and kw == dict(vision_tokens=None)
    assert tune_kernels(cfg, spec, mc, pd, torch.device("cpu")) is None
    assert tune_kernels(cfg, spec, _qwen3_cfg(kernels=False), pd, torch.device("cuda")) is None
    assert len(seen) == 1


# ------------------------------------------------------------------------------ interpreter (child)


def _qwen3_cfg(moe=False, kernels=True):
    from titan_mm.models.qwen3.config import Qwen3Config

    kw = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
              kernels=kernels)
    if moe:  # layer 0 MoE, layer 1 dense
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,))
    return Qwen3Config(**kw)


def _vl_cfg(kernels=True):
    from titan_mm.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig

    text = dataclasses.replace(_qwen3_cfg(), hidden_size=48, vocab_size=160)
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=36,
                          deepstack_visual_indexes=(0,), in_channels=3)
    return Qwen3VLConfig(text=text, vision=vision, mrope_section=(4, 2, 2), image_token_id=151, video_token_id=152,
                         vision_start_token_id=150, vision_end_token_id=153, vision_attn_backend="sdpa",
                         kernels=kernels)


def _fwd_bwd(name, cfg):
    from titan_mm.nn.attention import build_attn_meta

    torch.manual_seed(0)
    if name == "qwen3_vl":
        from titan_mm.models.qwen3_vl.model import Qwen3VLModel
        from titan_mm.models.qwen3_vl.synthetic import make_sample, pack

        m = Qwen3VLModel(cfg)
        m.init_weights()
        g = torch.Generator().manual_seed(1)
        b = pack([make_sample(cfg, [("text", 5), ("image", (4, 6)), ("text", 7)], g, text_vocab=150)], cfg)
        out = m(b["input_ids"], position_ids=b["position_ids"], attn=build_attn_meta(b, "sdpa", "cpu"),
                labels=b["labels"], pixel_values=b["pixel_values"], **vision_inputs(m.cfg, b, "cpu"))
    else:
        from titan_mm.models.qwen3.model import Qwen3Model

        m = Qwen3Model(cfg)
        m.init_weights()
        ids = torch.randint(0, cfg.vocab_size, (2, 16))
        out = m(ids, position_ids=torch.arange(16).repeat(2, 1), labels=ids)
    (out.loss_sum + out.aux_loss).backward()


def _tune(cfg, tokens, dtype, device, tp=1, **kw):
    """tune_for_model at the widths the family's spec gives for ``cfg``, as titan_mm.train.setup.tune_kernels."""
    from titan_mm import kernels as K
    from titan_mm.registry import spec_for_config

    spec = spec_for_config(cfg)
    return K.tune_for_model(spec.kernel_shapes(cfg, tp=tp), spec.runtime(cfg).kernels, tokens, dtype, device, **kw)


def _cfg(name, kernels=True):
    return _vl_cfg(kernels) if name == "qwen3_vl" else _qwen3_cfg(name == "qwen3_moe", kernels)


@interp_only
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen3_vl"])
def test_interp_forward_never_times_untuned_keys(name, fake_timer, clean_tuner):
    _fwd_bwd(name, _cfg(name))
    assert fake_timer == [], "the forward/backward reached the timing code"
    assert all(not t.best for t in clean_tuner.Tuner.registry)
    untuned = clean_tuner.untuned_keys()
    want = {"rms_norm_fwd", "rms_norm_bwd", "rope", "swiglu_fwd", "swiglu_bwd", "linear_cross_entropy"} | (
        {"bias_gelu_fwd", "bias_gelu_bwd"} if name == "qwen3_vl" else set())
    assert set(untuned) == want, untuned


@interp_only
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen3_vl"])
def test_interp_tune_for_model_covers_the_forward(name, clean_tuner):

    rep = _tune(_cfg(name), 24, torch.float32, "cpu", vision_tokens=40)
    assert rep["tuned"] and not rep["skipped"], rep
    # the interpreter cannot time: config 0 for every key
    for t in clean_tuner.Tuner.registry:
        for key, cfg in t.best.items():
            assert cfg == t.configs(key)[0], (t.name, key)
    _fwd_bwd(name, _cfg(name))
    assert clean_tuner.untuned_keys() == {}, "keys the forward met that tune_for_model did not tune"


@interp_only
def test_interp_tune_picks_fastest_and_forward_uses_it(fake_timer, clean_tuner):

    rep = _tune(_cfg("qwen3_vl"), 24, torch.float32, "cpu", vision_tokens=40)
    assert fake_timer, "tune_for_model timed nothing"
    assert set(rep["tuned"]) == {"rms_norm_fwd", "rms_norm_bwd", "rope", "swiglu_fwd", "swiglu_bwd",
                                 "bias_gelu_fwd", "bias_gelu_bwd", "linear_cross_entropy"}, rep
    for t in clean_tuner.Tuner.registry:
        for key, cfg in t.best.items():
            cands = t.configs(key)
            if len(cands) > 1:  # fake times 3, 1, 2, 4 ms: the second candidate wins
                assert cfg == cands[1], (t.name, key, cfg)
                assert len(t.timings[key]["ms"]) == len(cands)
    n_timed = len(fake_timer)
    for t in clean_tuner.Tuner.registry:
        t.last = None
    _fwd_bwd("qwen3_vl", _cfg("qwen3_vl"))
    assert len(fake_timer) == n_timed and clean_tuner.untuned_keys() == {}
    for t in clean_tuner.Tuner.registry:
        if t.last is not None:
            key, cfg = t.last
            assert cfg == t.best[key]


@interp_only
def test_interp_tune_for_model_keys_per_tp_rank(clean_tuner):
    from titan_mm import kernels as K

    rep = _tune(_cfg("qwen3"), 16, torch.float32, "cpu", tp=2)
    assert rep["tuned"]["rope"] == [str((2, 1, 16, torch.float32))]  # 4 / 2 q heads, 2 / 2 kv heads
    assert rep["tuned"]["swiglu_fwd"] == [str((48, True, torch.float32))]  # intermediate 96 / 2
    # out of memory while tuning one op: that op stays on its defaults, the others are tuned
    def oom(*a, **kw):
        raise torch.OutOfMemoryError("CUDA out of memory")

    clean_tuner.reset_tuning()
    swiglu, K.swiglu = K.swiglu, oom  # tune_for_model looks the op up in titan_mm.kernels when it runs
    try:
        rep = _tune(_cfg("qwen3"), 16, torch.float32, "cpu")
    finally:
        K.swiglu = swiglu
    assert any("swiglu" in r and "out of memory" in r for r in rep["skipped"]), rep
    assert "swiglu_fwd" not in rep["tuned"] and "rope" in rep["tuned"], rep
    # TITAN_KERNELS_TUNE=0 and kernels off: nothing runs
    assert _tune(_cfg("qwen3", kernels=False), 16, torch.float32, "cpu")["skipped"]
    clean_tuner.TUNE = False
    try:
        assert _tune(_cfg("qwen3"), 16, torch.float32, "cpu")["skipped"]
    finally:
        clean_tuner.TUNE = True


def test_tuning_in_interpreter():
    if INTERP:
        pytest.skip("this is the parent of the interpreter run")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", TITAN_KERNELS_POISON="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "ignore",
                           os.path.abspath(__file__), "-k", "interp_"], env=env, cwd=root, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-2000:]


def test_loaded_picks_are_launched_without_timing():
    """titan_mm.kernels.load_picks (the picks a resumed run's checkpoint carries, titan_mm.train.setup.tune_kernels):
    inside tuning() a key with a loaded pick launches it, and nothing is timed for it."""
    from titan_mm.kernels import _utils

    t = _utils.Tuner("test_loaded_picks", [dict(BLOCK=1), dict(BLOCK=2)])
    try:
        key = (64, torch.bfloat16)
        _utils.load_picks({**_utils.export_picks(), t.name: {key: dict(BLOCK=2)}})
        assert _utils.export_picks()[t.name] == {key: dict(BLOCK=2)}

        def launch(cfg):
            raise AssertionError(f"timed {cfg}: the loaded pick should have been taken")

        with _utils.tuning():
            assert t.pick(key, launch) == dict(BLOCK=2)
        # a checkpoint of an older version: its unknown tuner and a config outside the candidates are dropped
        old = {t.name: {key: dict(BLOCK=2), (32, torch.float32): dict(BLOCK=3)}, "gone": {key: dict(BLOCK=1)}}
        assert _utils.current_picks(old) == {t.name: {key: dict(BLOCK=2)}}
    finally:
        _utils.Tuner.registry.remove(t)
