"""Integration: tiny models with kernels on (every op through the Triton interpreter on CPU) equal the same
models with kernels off, fp32: loss_sum and every parameter gradient (relative L2 < 1e-4, the tolerance of
titan_mm.tools.kernel_checks.check_model).

- test_qwen3_kernels_on_equals_off: Qwen3 dense (titan_mm.tools.kernel_checks.check_model).
- test_models_kernels_on_equal_off: Qwen3, Qwen3-MoE and Qwen3-VL (image + DeepStack) with kernels=True and with
  per-op specs, run in a child process with TRITON_INTERPRET=1; the autograd graph of the loss shows which
  kernels ran (AddRMSNormFunction in the decoder blocks, BiasGeluFunction in the ViT MLPs, RMSNormFunction for
  the other norms), so a spec that turns an op off must leave it out and one that turns it on must put it in.
- test_select_ops_tables: which callables the op table hands to the blocks and the ViT MLP, per spec (no
  interpreter).
"""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from titan_mm.tools.kernel_checks import failures, run_in_interpreter
from titan_mm.models.qwen3_vl.model import vision_inputs  # noqa: E402

pytest.importorskip("titan_mm.models.qwen3.model")


def test_qwen3_kernels_on_equals_off():
    result = run_in_interpreter(["model"])
    bad = failures(result, "model", "float32")
    assert not bad, "\n".join(bad)


# ---- the model checks run in a child process (TRITON_INTERPRET=1 must be set before triton is imported) ----

# the eager kernel paths' autograd nodes (titan_mm.kernels.{rms_norm,bias_gelu}: *Function.apply)
NORM, ADD, BG = "RMSNormFunctionBackward", "AddRMSNormFunctionBackward", "BiasGeluFunctionBackward"
KERNEL_NODES = (NORM, ADD, BG)
# kernels spec -> kernel nodes expected in the loss graph of (the qwen3 text models, qwen3-vl)
SPECS = {
    True: ({NORM, ADD}, {NORM, ADD, BG}),
    "all,-add_rms_norm,-bias_gelu": ({NORM}, {NORM}),
    "add_rms_norm,bias_gelu": ({ADD}, {ADD, BG}),
}


def _grad_fn_names(t):
    names, seen, stack = set(), set(), [t.grad_fn]
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        names.add(f.name())
        stack.extend(nf for nf, _ in f.next_functions)
    return names


def _qwen3_cfg(moe: bool):
    from titan_mm.models.qwen3.config import Qwen3Config

    kw = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
    if moe:  # layer 0 MoE, layer 1 dense
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,))
    return Qwen3Config(**kw)


def _vl_cfg():
    from titan_mm.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig

    text = dataclasses.replace(_qwen3_cfg(False), hidden_size=48, vocab_size=160)
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                          temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=48, num_position_embeddings=36,
                          deepstack_visual_indexes=(0,), in_channels=3)
    return Qwen3VLConfig(text=text, vision=vision, mrope_section=(4, 2, 2), image_token_id=151, video_token_id=152,
                         vision_start_token_id=150, vision_end_token_id=153, vision_attn_backend="sdpa")


def _run_model(name, kernels, seed=0):
    """(loss_sum, {param: grad}, kernel autograd nodes in the loss graph) for one tiny model."""
    import torch

    from titan_mm.nn.attention import build_attn_meta

    torch.manual_seed(seed)
    if name == "qwen3_vl":
        from titan_mm.models.qwen3_vl.model import Qwen3VLModel
        from titan_mm.models.qwen3_vl.synthetic import make_sample, pack

        cfg = dataclasses.replace(_vl_cfg(), kernels=kernels)
        m = Qwen3VLModel(cfg)
        m.init_weights()
        g = torch.Generator().manual_seed(1)
        s = [make_sample(cfg, [("text", 5), ("image", (4, 6)), ("text", 7)], g, text_vocab=150),
             make_sample(cfg, [("text", 4), ("image", (4, 4)), ("text", 6)], g, text_vocab=150)]
        b = pack(s, cfg)
        out = m(b["input_ids"], position_ids=b["position_ids"], attn=build_attn_meta(b, "sdpa", "cpu"),
                labels=b["labels"], pixel_values=b["pixel_values"], **vision_inputs(m.cfg, b, "cpu"))
        n_labels = (b["labels"] != -100).sum()
    else:
        from titan_mm.models.qwen3.model import Qwen3Model

        cfg = dataclasses.replace(_qwen3_cfg(name == "qwen3_moe"), kernels=kernels)
        m = Qwen3Model(cfg)
        m.init_weights()
        B, S = 2, 16
        ids = torch.randint(0, cfg.vocab_size, (B, S))
        labels = torch.randint(0, cfg.vocab_size, (B, S))
        labels[:, :3] = -100
        out = m(ids, position_ids=torch.arange(S).repeat(B, 1), labels=labels)
        n_labels = (labels != -100).sum()
    loss = out.loss_sum / n_labels + out.aux_loss
    nodes = sorted(_grad_fn_names(loss) & set(KERNEL_NODES))
    loss.backward()
    return out.loss_sum.detach(), {k: p.grad for k, p in m.named_parameters()}, nodes


def _child() -> None:
    import torch

    from titan_mm.kernels import _dispatch, use_triton
    from titan_mm.tools.kernel_checks import rel_l2

    torch.set_float32_matmul_precision("highest")
    assert use_triton(torch.empty(1)), "the Triton path is not active (TRITON_INTERPRET=1 is needed on CPU)"
    recs = []
    for name in ("qwen3", "qwen3_moe", "qwen3_vl"):
        ref_loss, ref_grads, ref_nodes = _run_model(name, False)
        recs.append({"model": name, "spec": "off", "what": "kernel nodes", "nodes": ref_nodes, "ok": not ref_nodes})
        for spec, (want_text, want_vl) in SPECS.items():
            loss, grads, nodes = _run_model(name, spec)
            want = sorted(want_vl if name == "qwen3_vl" else want_text)
            recs.append({"model": name, "spec": str(spec), "what": "kernel nodes", "nodes": nodes, "want": want,
                         "ok": nodes == want})
            err = rel_l2(loss, ref_loss)
            recs.append({"model": name, "spec": str(spec), "what": "loss_sum", "err": err, "ok": err < 1e-4})
            for k, g in grads.items():
                if ref_grads[k] is None and g is None:
                    continue
                err = rel_l2(g, ref_grads[k]) if g is not None and ref_grads[k] is not None else float("inf")
                recs.append({"model": name, "spec": str(spec), "what": f"grad {k}", "err": err, "ok": err < 1e-4})
        # the custom ops (what torch.compile graphs call) through the same model, eagerly
        _dispatch.PREFER_OPS = True
        try:
            loss, grads, _ = _run_model(name, True)
        finally:
            _dispatch.PREFER_OPS = False
        err = max([rel_l2(loss, ref_loss)] + [rel_l2(g, ref_grads[k]) for k, g in grads.items() if g is not None])
        recs.append({"model": name, "spec": "True [ops]", "what": "loss_sum and grads (max)", "err": err,
                     "ok": err < 1e-4})
    print(json.dumps(recs))


_RESULT: dict = {}


def _model_records():
    if "recs" not in _RESULT:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, TRITON_INTERPRET="1", TITAN_KERNELS_POISON="1", CUDA_VISIBLE_DEVICES="")
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.run([sys.executable, "-W", "ignore", os.path.abspath(__file__), "child"], env=env, cwd=root,
                              capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _RESULT["recs"] = json.loads(proc.stdout.strip().splitlines()[-1])
    return _RESULT["recs"]


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe", "qwen3_vl"])
def test_models_kernels_on_equal_off(model):
    recs = [r for r in _model_records() if r["model"] == model]
    assert recs
    bad = [f"{r['model']} kernels={r['spec']} {r['what']}: " + (f"err {r['err']:.3e}" if "err" in r else
                                                                  f"{r['nodes']} want {r.get('want', [])}")
           for r in recs if not r["ok"]]
    assert not bad, "\n".join(bad)


def test_select_ops_tables():
    import torch

    from titan_mm import kernels as K
    from titan_mm.nn.mlp import silu_mul
    from titan_mm.nn.norm import add_rms_norm, rms_norm
    from titan_mm.models.qwen3.model import Qwen3Model, select_ops
    from titan_mm.models.qwen3_vl.model import Qwen3VLModel

    off = select_ops(False)
    assert (off.rms_norm, off.add_rms_norm, off.act_mul, off.bias_gelu) == (rms_norm, add_rms_norm, silu_mul, None)
    on = select_ops(True)
    assert (on.rms_norm, on.add_rms_norm, on.bias_gelu) == (K.rms_norm, K.add_rms_norm, K.bias_gelu)
    some = select_ops("all,-add_rms_norm,-bias_gelu")
    assert some.rms_norm is K.rms_norm and some.bias_gelu is None
    # unfused add + norm with the Triton RMSNorm: the eager add, then K.rms_norm
    assert some.add_rms_norm.func is add_rms_norm and some.add_rms_norm.keywords == {"norm": K.rms_norm}
    assert select_ops("add_rms_norm").add_rms_norm is K.add_rms_norm and select_ops("add_rms_norm").rms_norm is rms_norm
    with torch.device("meta"):
        for spec, want_add, want_bg in ((True, K.add_rms_norm, K.bias_gelu), (False, add_rms_norm, None),
                                        ("bias_gelu", add_rms_norm, K.bias_gelu)):
            vl = Qwen3VLModel(dataclasses.replace(_vl_cfg(), kernels=spec))
            assert all(b.add_norm is want_add for b in vl.language_model.layers.values())
            assert all(blk.mlp.bias_gelu is want_bg for blk in vl.visual.blocks)
            lm = Qwen3Model(dataclasses.replace(_qwen3_cfg(True), kernels=spec))
            assert all(b.add_norm is want_add for b in lm.layers.values())
        # exact GELU (hidden_act "gelu") has no fused kernel: the ViT MLP keeps the reference
        cfg = _vl_cfg()
        cfg = dataclasses.replace(cfg, kernels=True, vision=dataclasses.replace(cfg.vision, hidden_act="gelu"))
        assert Qwen3VLModel(cfg).visual.blocks[0].mlp.bias_gelu is None


if __name__ == "__main__" and sys.argv[1:] == ["child"]:
    _child()
