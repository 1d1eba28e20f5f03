"""Muon (titan_mm.train.muon, built by titan_mm.train.optim.build_optimizer with optimizer.name = "muon"):
the step equals a plain loop over Keller Jordan's / Moonlight's formulas (fp32, 1e-6), which parameters it
takes, fused weights split part by part, the owner balance of distributed Muon, one schedule over both kinds of
groups, config errors, a DCP round trip, an exact resume after SIGKILL, the bench's CPU smoke run and (GPU) the
bf16 compiled NS."""

import math
import signal

import pytest
import torch

from titan_mm.config import ConfigError, JobConfig, load_config
from titan_mm.registry import FusedRows, get_model_spec
from titan_mm.train.muon import MuonAdamW, newton_schulz
from titan_mm.train.optim import build_lr_scheduler, build_optimizer

TINY_MOE = dict(vocab_size=64, num_hidden_layers=2, hidden_size=32, head_dim=8, num_attention_heads=4,
                num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------ the reference
def ref_newton_schulz(G, steps):
    """Keller Jordan's zeropower_via_newtonschulz5, one matrix, in G's dtype."""
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.clone()
    if G.size(0) > G.size(1):
        X = X.T
    X = X / (X.norm() + 1e-7)
    for _ in range(steps):
        A = X @ X.T
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(0) > G.size(1):
        X = X.T
    return X


def ref_orthogonalize(U, steps, parts=None):
    """U [..., A, B]: every matrix on its own; ``parts``: lists of row indices of a fused weight's parts."""
    if U.ndim > 2:
        return torch.stack([ref_orthogonalize(u, steps, parts) for u in U])
    if parts is None:
        return ref_newton_schulz(U, steps) * 0.2 * math.sqrt(max(U.shape))
    O = torch.empty_like(U)
    for rows in parts:
        O[rows] = ref_newton_schulz(U[rows], steps) * 0.2 * math.sqrt(max(len(rows), U.shape[1]))
    return O


def ref_muon_step(params, grads, bufs, lr, wd, mu=0.95, nesterov=True, steps=5, parts=None):
    """Moonlight's Muon: B = mu B + G; U = G + mu B (nesterov); W = W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) NS(U)."""
    for i, (W, G, B) in enumerate(zip(params, grads, bufs)):
        B.mul_(mu).add_(G)
        U = G + mu * B if nesterov else B
        O = ref_orthogonalize(U, steps, (parts or {}).get(i))
        W.mul_(1 - lr * wd)
        W.sub_(lr * O)


def _model(name="qwen3", flavor="debug_moe", **kw):
    spec = get_model_spec(name)
    cfg = spec.flavors[flavor].replace(**kw) if kw else spec.flavors[flavor]
    torch.manual_seed(0)
    m = spec.build(cfg)
    with torch.no_grad():
        m.init_weights()
    return spec, cfg, m


def _muon_cfg(**kw):
    cfg = JobConfig()
    cfg.optimizer.name = "muon"
    cfg.optimizer.lr = 2e-2
    for k, v in kw.items():
        setattr(cfg.optimizer, k, v)
    return cfg


def _names(model, opt, algo):
    ids = {id(p) for g in opt.param_groups if g["algo"] == algo for p in g["params"]}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def test_newton_schulz_matches_reference_batched():
    g = torch.Generator().manual_seed(0)
    for shape in [(32, 32), (16, 48), (48, 16), (3, 24, 40)]:
        G = torch.randn(*shape, generator=g)
        ref = ref_orthogonalize(G, 5) / (0.2 * math.sqrt(max(shape[-2:])))
        torch.testing.assert_close(newton_schulz(G, 5), ref, atol=1e-6, rtol=0)
    # what NS5 is for: singular values spread over 1.5 decades end up in about [0.68, 1.14]
    G = torch.randn(48, 16, generator=g) @ torch.diag(torch.logspace(-1.5, 0, 16))
    s = torch.linalg.svdvals(newton_schulz(G, 5))
    assert 0.6 < s.min() and s.max() < 1.2, s


def test_owner_assignment_balances_ns_work():
    """Distributed Muon gives each matrix one owner rank; on Qwen3-1.7B's 196 matrices the busiest of 8 ranks
    has at most 5% more NS work than the mean, and every rank computes the same assignment."""
    from titan_mm.train.muon import assign_owners, ns_cost

    layer = [(2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048), (6144, 2048), (6144, 2048), (2048, 6144)]
    shapes = [torch.Size(s) for s in layer * 28]
    owners = assign_owners(shapes, 8)
    assert owners == assign_owners(list(shapes), 8) and set(owners) == set(range(8))
    load = [sum(ns_cost(s) for s, o in zip(shapes, owners) if o == r) for r in range(8)]
    assert max(load) <= 1.05 * sum(load) / 8, load


@pytest.mark.parametrize("nesterov", [True, False])
def test_step_matches_plain_reference(nesterov):
    """Three steps of optimizer.name=muon on tiny Qwen3-MoE (attention, router, 3-D experts; untied head) equal
    the reference loop for Muon's matrices and torch's AdamW for the rest, within 1e-6 (fp32)."""
    spec, mcfg, model = _model(**TINY_MOE)
    cfg = _muon_cfg(muon_nesterov=nesterov)
    opt = build_optimizer(model, cfg, plan=spec.plan(mcfg))
    assert type(opt) is MuonAdamW
    muon = _names(model, opt, "muon")
    kinds = (".attn.wq.", ".attn.wk.", ".attn.wv.", ".attn.wo.", ".router.", ".experts.")
    assert muon == {n for n, _ in model.named_parameters() if any(k in n for k in kinds)}
    assert {"tok_embeddings.weight", "output.weight", "norm.weight"} <= _names(model, opt, "adamw")

    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref_params = {n: p.clone() for n, p in init.items()}
    ref_bufs = {n: torch.zeros_like(p) for n, p in ref_params.items() if n in muon}
    rest = [torch.nn.Parameter(p) for n, p in ref_params.items() if n not in muon]
    rest_names = [n for n in ref_params if n not in muon]
    wd_of = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    by_name = dict(model.named_parameters())
    adamw = torch.optim.AdamW(
        [{"params": [q], "weight_decay": wd_of[id(by_name[n])]} for q, n in zip(rest, rest_names)],
        lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2), eps=cfg.optimizer.eps, foreach=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=g) * 0.01 for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        opt.step()
        names = sorted(muon)
        ref_muon_step([ref_params[n] for n in names], [grads[n] for n in names], [ref_bufs[n] for n in names],
                      lr=cfg.optimizer.lr, wd=cfg.optimizer.weight_decay, nesterov=nesterov)
        for q, n in zip(rest, rest_names):
            q.grad = grads[n].clone()
        adamw.step()
        for q, n in zip(rest, rest_names):
            ref_params[n] = q.detach()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[n], atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")
        assert not torch.equal(p.detach(), init[n]), n  # every parameter moved
    st = opt.state[by_name["layers.0.moe.experts.w1"]]
    torch.testing.assert_close(st["momentum_buffer"], ref_bufs["layers.0.moe.experts.w1"], atol=1e-7, rtol=0)


def test_params_qwen3_vl_and_fused_qkv_split():
    """Qwen3-VL: Muon takes the ViT's and the LLM's block matrices; the patch embedding, position embedding,
    mergers and token embedding stay with AdamW. The ViT's head-major wqkv [H, 3, Dh] is orthogonalized as Q, K,
    V (muon_split_fused, the default), or whole."""
    spec, mcfg, model = _model("qwen3_vl", "debug")
    fused = spec.fused_params(mcfg)
    opt = build_optimizer(model, _muon_cfg(), plan=spec.plan(mcfg), fused=fused)
    muon, adamw = _names(model, opt, "muon"), _names(model, opt, "adamw")
    assert "visual.blocks.0.attn.wqkv.weight" in muon and "language_model.layers.0.mlp.w1.weight" in muon
    assert not any(k in n for n in muon for k in ("patch_embed", "pos_embed", "merger", "tok_embeddings", "norm"))
    assert {"visual.patch_embed.weight", "visual.merger.linear_fc1.weight"} <= adamw
    H, Dh = mcfg.vision.num_heads, mcfg.vision.hidden_size // mcfg.vision.num_heads
    wqkv = dict(model.named_parameters())["visual.blocks.0.attn.wqkv.weight"]
    assert opt.layouts[id(wqkv)] == FusedRows(H, (Dh, Dh, Dh))

    rows = torch.arange(3 * H * Dh).view(H, 3, Dh)
    parts = [rows[:, j].flatten().tolist() for j in range(3)]
    for split in (True, False):
        W = torch.randn(3 * H * Dh, H * Dh, generator=torch.Generator().manual_seed(2))
        G = torch.randn(W.shape, generator=torch.Generator().manual_seed(3))
        p = torch.nn.Parameter(W.clone())
        layouts = {id(p): FusedRows(H, (Dh, Dh, Dh))} if split else {}
        o = MuonAdamW([{"params": [p], "algo": "muon"}], lr=0.02, weight_decay=0.0, layouts=layouts)
        p.grad = G.clone()
        o.step()
        ref = W.clone()
        ref_muon_step([ref], [G], [torch.zeros_like(W)], lr=0.02, wd=0.0, parts={0: parts} if split else None)
        torch.testing.assert_close(p.detach(), ref, atol=1e-6, rtol=0)


def test_one_schedule_over_both_kinds_and_config_errors(tmp_path):
    spec, mcfg, model = _model(**TINY_MOE)
    cfg = _muon_cfg()
    cfg.lr_scheduler.warmup_steps = 4
    opt = build_optimizer(model, cfg, plan=spec.plan(mcfg))
    sched = build_lr_scheduler(opt, cfg)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(2):
        opt.step()
        sched.step()
    assert {g["algo"] for g in opt.param_groups} == {"muon", "adamw"}
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([cfg.optimizer.lr * 3 / 4] * len(opt.param_groups))

    with pytest.raises(ConfigError, match=r"optimizer.muon_momentum must be in \[0, 1\), got 1.0"):
        load_config(["--optimizer.name", "muon", "--optimizer.muon_momentum", "1.0"])
    with pytest.raises(ConfigError, match="optimizer.muon_ns_steps must be >= 1, got 0"):
        load_config(["--optimizer.muon_ns_steps", "0"])
    from titan_mm.parallel.plan import ParallelizePlan

    with pytest.raises(ConfigError, match="no trainable matrix inside its blocks"):
        build_optimizer(model, cfg, plan=ParallelizePlan())


def test_checkpoint_round_trip_keeps_momentum(tmp_path):
    """DCP save -> a fresh model and optimizer -> load: the next two steps are bitwise those of the run that
    went on (the momentum buffers are in the checkpoint)."""
    from titan_mm.train.checkpoint import CheckpointManager
    from titan_mm.train.state import TrainState

    def fresh():
        spec, mcfg, model = _model(**TINY_MOE)
        opt = build_optimizer(model, _muon_cfg(), plan=spec.plan(mcfg))
        return TrainState(model=model, optimizer=opt, scheduler=build_lr_scheduler(opt, _muon_cfg()))

    def steps(state, seeds):
        for s in seeds:
            g = torch.Generator().manual_seed(s)
            for p in state.model.parameters():
                p.grad = torch.randn(p.shape, generator=g) * 0.01
            state.optimizer.step()
            state.scheduler.step()
            state.step += 1

    a = fresh()
    steps(a, [0, 1])
    CheckpointManager(tmp_path, interval=1, async_mode="disabled").save(a)
    steps(a, [2, 3])
    b = fresh()
    CheckpointManager(tmp_path, interval=1, async_mode="disabled").resume(b)
    assert b.step == 2 and any("momentum_buffer" in s for s in b.optimizer.state.values())
    steps(b, [2, 3])
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_exact_resume_after_sigkill_muon(tmp_path):
    """The trainer with optimizer.name=muon, killed (SIGKILL) in the middle of step 4, resumes from its last
    checkpoint and logs bitwise the losses of the run that was never killed."""
    from test_train_e2e import TINY, losses, run_sh

    from titan_mm.checkpoint_io import list_checkpoints

    # blocking saves: step 2's checkpoint is committed before the kill (the async path is test_train_e2e's)
    common = ["--job.dump_folder", str(tmp_path), "--training.steps", "6", "--checkpoint.interval", "2",
              "--checkpoint.async_mode", "disabled", "--optimizer.name", "muon", "--model.flavor", "debug_moe", *TINY]
    a = run_sh([*common, "--job.name", "straight"])
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_sh([*common, "--job.name", "killed"], env_extra={"TITAN_MM_FAULT_KILL_AT_STEP": "3"})
    assert b.returncode == -signal.SIGKILL, (b.returncode, b.stderr[-2000:])
    done = [p.name for p in list_checkpoints(tmp_path / "killed" / "checkpoints")]
    assert done and done[-1] == "step-00000002", done
    c = run_sh([*common, "--job.name", "killed"])
    assert c.returncode == 0 and "resumed from" in c.stderr, c.stderr[-3000:]
    la, lc = losses(tmp_path / "straight"), losses(tmp_path / "killed")
    assert sorted(lc) == list(range(1, 7))
    for s in range(3, 7):
        assert la[s] == lc[s], (s, la[s], lc[s])  # bitwise


@pytest.mark.gpu
def test_bf16_compiled_ns_on_cuda():
    """On CUDA the NS runs in bf16, compiled: close to the fp32 reference (bf16 rounding), and the same update
    with and without compile."""
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.nn.Parameter(torch.randn(256, 768, device="cuda", generator=g))
    grad = torch.randn(p.shape, device="cuda", generator=g)
    outs = []
    for compile_ns in (True, False):
        q = torch.nn.Parameter(p.detach().clone())
        o = MuonAdamW([{"params": [q], "algo": "muon"}], lr=0.02, weight_decay=0.0, fused=True, compile_ns=compile_ns)
        q.grad = grad.clone()
        o.step()
        outs.append((p.detach() - q.detach()) / 0.02)
    ref = ref_orthogonalize(grad.double(), 5).float()

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    assert rel(outs[0], outs[1]) < 0.02 and rel(outs[0], ref) < 0.05, (rel(outs[0], outs[1]), rel(outs[0], ref))


def test_bench_optim_step_cpu_smoke(tmp_path):
    """bench/optim_step.py --cpu (the debug flavor): both optimizers built and timed, the JSON written."""
    import json

    from bench.optim_step import main

    out = tmp_path / "optim_step.json"
    assert main(["--cpu", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["model"] == "qwen3/debug" and r["adamw_impl"] == "foreach" and 0 < r["params_muon"] < r["params_total"]
    assert r["adamw_ms"] > 0 and r["muon_eager_ms"] > 0 and r["ratio_muon_over_adamw"] > 0
