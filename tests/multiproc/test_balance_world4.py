"""data.balance over 4 gloo processes (FSDP2): the placed global batch gives the losses and gradients of the
loader's placement (fp32, within 1e-5), for text (debug_qwen3.toml's model, synthetic rows of random documents) and
the digits images of debug_qwen3_vl.toml, and the trainer logs the balance metrics. About 40 / 70 / 40 s on 2 cores
(process start-up and the first step dominate)."""

import pytest
from _harness import run_multiproc  # pytest puts tests/multiproc/ on sys.path

from titan_mm.observe.metrics import read_metrics

SMALL = ["--data.micro_batch_size", "2", "--training.global_batch_size", "16",  # 2 micro-batches per rank
         "--metrics.enable_tensorboard", "False", "--checkpoint.enable", "False", "--eval.interval", "0"]
CONFIGS = {
    "text": ["--config", "debug_qwen3.toml", "--model.overrides", '{"vocab_size": 256, "num_hidden_layers": 1}',
             "--data.dataset", "synthetic", "--data.seq_len", "64"],  # rows of random documents
    "vl": ["--config", "debug_qwen3_vl.toml", "--data.seq_len", "64"],
}
STEPS = 2


def _grads(model) -> dict:
    """Full (summed over the dp ranks) gradients: a collective on FSDP2's DTensors."""
    out = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad
            out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _worker(rank, world, argv):
    import torch
    import torch.distributed as dist

    from titan_mm.config import load_config
    from titan_mm.parallel.balance_dispatch import Rebalancer
    from titan_mm.train.setup import build_data, setup
    from titan_mm.train.step import forward_backward, global_counts
    from titan_mm.train.trainer import _Batches

    cfg = load_config(argv)
    run = setup(cfg)
    batches = _Batches(build_data(cfg, run.spec, run.model_cfg, run.dp_rank, run.dp_world, run.n_micro))
    steps = [batches.take(run.n_micro) for _ in range(STEPS)]
    ref, out = {}, {"moved": 0, "max_diff": 0.0, "max_grad": 0.0, "loss": {}, "imbalance": {}}
    for method in ("none", "kk"):  # lpt: the same dispatch, another placement (tests/unit/test_balance.py)
        rebalance = Rebalancer.for_run(method, run, cfg.model.flavor)
        for s, micro in enumerate(steps):
            mb = micro if rebalance is None else rebalance(micro)
            if rebalance is not None:
                out["imbalance"][method, s] = rebalance.metrics(0.0, measure=False)
                out["moved"] += sum(not torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(mb, micro))
            n = global_counts(mb, run.ctx)
            loss_sum, _ = forward_backward(run.model, mb, run.ctx, n)
            dist.all_reduce(loss_sum)
            out["loss"][method, s] = float(loss_sum) / n["ce"]
            grads = _grads(run.model)
            run.state.optimizer.zero_grad(set_to_none=True)
            if method == "none":
                ref[s] = grads
                continue
            for k, g in grads.items():
                out["max_diff"] = max(out["max_diff"], float((g - ref[s][k]).abs().max()))
                out["max_grad"] = max(out["max_grad"], float(ref[s][k].abs().max()))
    return out


@pytest.mark.parametrize("kind", ["text", "vl"])
def test_placement_keeps_losses_and_grads(kind):
    res = run_multiproc(_worker, 4, args=([*CONFIGS[kind], *SMALL],), timeout_s=300)
    assert sum(r["moved"] for r in res) > 0  # the placement did move rows between ranks / micro-batches
    r0 = res[0]
    for s in range(STEPS):
        assert abs(r0["loss"]["kk", s] - r0["loss"]["none", s]) <= 1e-5 * abs(r0["loss"]["none", s])
        imb = r0["imbalance"]["kk", s]
        assert imb["balance/pred_imbalance_after"] <= imb["balance/pred_imbalance_before"] + 1e-12
    assert r0["max_diff"] <= 1e-5 * max(1.0, r0["max_grad"]), (r0["max_diff"], r0["max_grad"])
    assert all(r["loss"] == r0["loss"] for r in res)  # global values, the same on every rank


def _train_worker(rank, world, argv, folder):
    from titan_mm.config import load_config
    from titan_mm.train.trainer import train

    train(load_config([*argv, "--job.dump_folder", folder, "--job.name", "kk", "--training.steps", "2",
                       "--metrics.log_freq", "1"]))  # data.balance: the default, kk


def test_trainer_logs_balance_metrics(tmp_path):
    run_multiproc(_train_worker, 4, args=([*CONFIGS["text"], *SMALL], str(tmp_path)), timeout_s=300)
    kk = read_metrics(tmp_path / "kk" / "metrics.jsonl")
    assert sorted(kk) == [1, 2]
    for m in kk.values():
        assert m["balance/pred_imbalance_after"] <= m["balance/pred_imbalance_before"]
        assert m["balance/measured_max_over_mean"] >= 1.0 and m["balance/straggler_wait_s"] >= 0.0
        assert m["balance/dispatch_s"] > 0.0
