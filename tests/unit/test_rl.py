"""RL post-training (docs/rl.md): the policy objective against a written-out reference, rewards, group advantages,
the engine's logprobs against the trainer's, the weight sync, the replay buffer's staleness, and resume."""

import math
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from titan_mm.config import ConfigError, Rl, load_config
from titan_mm.nn.attention import build_attn_meta
from titan_mm.objectives import Policy
from titan_mm.objectives.policy import policy_sums
from titan_mm.observe.metrics import read_metrics
from titan_mm.rl import rl_data
from titan_mm.rl.rewards import build_reward
from titan_mm.rl.rollout import RolloutSource, group_advantages, load_prompts, token_logprobs
from titan_mm.train.setup import setup
from titan_mm.launch.train import main

ROOT = Path(__file__).resolve().parents[2]
# a small model on the real tokenizer (the QA prompts): one layer, hidden 64
SMALL = ['--model.overrides', '{"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, '
         '"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32}',
         "--data.seq_len", "32", "--data.micro_batch_size", "4", "--training.global_batch_size", "8",
         "--rl.prompts_per_step", "2", "--rl.group_size", "4", "--rl.max_tokens", "4",
         "--metrics.enable_tensorboard", "False", "--training.deterministic", "True"]
# operator.lt(completion, reference): 0 / 1 rewards that vary for an untrained model's text
VARIED = ["--rl.rewards", '{"operator:lt": 1.0}']


def cfg_of(*extra):
    return load_config(["--config", str(ROOT / "train_configs/debug_rl_qwen3.toml"), *SMALL, *extra])


# the VL config (debug Qwen3-VL, builtin:digits prompts with their images), shrunk to 2 prompts x 4 a step
VL = ["--config", str(ROOT / "train_configs/debug_rl_qwen3_vl.toml"), "--data.micro_batch_size", "4",
      "--training.global_batch_size", "8", "--rl.prompts_per_step", "2", "--rl.group_size", "4",
      "--metrics.enable_tensorboard", "False", *VARIED]


# ---------------------------------------------------------------------------------------------- the objective
def _reference_terms(logits, labels, old, adv, w, ref, eps_low, eps_high, kl_coef):
    """Per token, written out in float64: -min(r A, clip(r) A), kl_coef (e^(ref-lp) - (ref-lp) - 1), entropy."""
    out = {"pg": 0.0, "kl": 0.0, "entropy": 0.0, "clip_frac": 0.0, "logprob_gap": 0.0}
    logp_all = torch.log_softmax(logits.double(), -1)
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            if labels[b, t] == -100:
                continue
            lp = float(logp_all[b, t, labels[b, t]])
            r = math.exp(lp - float(old[b, t]))
            a = float(adv[b, t])
            cr = min(max(r, 1 - eps_low), 1 + eps_high)
            out["pg"] += float(w[b, t]) * -min(r * a, cr * a)
            d = float(ref[b, t]) - lp
            out["kl"] += kl_coef * float(w[b, t]) * (math.exp(d) - d - 1)
            out["entropy"] += float(-(logp_all[b, t].exp() * logp_all[b, t]).sum())
            out["clip_frac"] += float(cr * a < r * a)
            out["logprob_gap"] += abs(lp - float(old[b, t]))
    return out


def test_policy_terms_match_the_written_out_reference():
    g = torch.Generator().manual_seed(0)
    B, S, V = 3, 7, 11
    logits = torch.randn(B, S, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, S), generator=g)
    labels[:, :2] = -100
    labels[2, 5:] = -100
    logp_all = logits.log_softmax(-1)
    lp = logp_all.gather(-1, labels.clamp(min=0)[..., None])[..., 0].where(labels != -100, 0.0)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    # old logprobs 0.5 away on either side: ratios e^(+-0.5) fall outside [0.8, 1.28], so both clips act
    old = lp + 0.5 * torch.where(torch.rand(B, S, generator=g) < 0.5, -1.0, 1.0).double()
    batch = {"old_logprobs": old, "advantages": torch.randn(B, 1, generator=g).double().expand(B, S),
             "rl_weights": torch.rand(B, S, generator=g).double(), "ref_logprobs": lp - 0.3}
    obj = Policy(eps_low=0.2, eps_high=0.28, kl_coef=0.05)
    got = policy_sums(lp, ent, labels, batch, obj)
    want = _reference_terms(logits, labels, old, batch["advantages"], batch["rl_weights"], batch["ref_logprobs"],
                            0.2, 0.28, 0.05)
    assert set(got) == set(obj.terms) == {"pg", "kl", "entropy", "clip_frac", "logprob_gap"}
    for k in want:  # the arithmetic is float64 here; sums of ~15 terms of order 1
        assert abs(float(got[k]) - want[k]) < 1e-12, (k, float(got[k]), want[k])
    assert 0 < want["clip_frac"] < (labels != -100).sum()


def test_policy_counts_token_and_sequence_norm():
    labels = torch.tensor([[-100, 5, 6, -100], [-100, -100, -100, -100], [-100, 7, -100, -100]])
    assert Policy().counts({"labels": labels}) == {"pg": 3, "entropy": 3, "clip_frac": 3, "logprob_gap": 3}
    assert Policy(loss_norm="sequence", kl_coef=0.1).counts({"labels": labels}) == {
        "pg": 2, "kl": 2, "entropy": 3, "clip_frac": 3, "logprob_gap": 3}


# ---------------------------------------------------------------------------------------------- rewards, advantages
def test_rewards_builtin_weighted_and_imported():
    r = build_reward(Rl(rewards={"exact_match": 1.0, "numeric": 0.5, "format": 0.25}))
    assert r(" 348 ", "348", True) == 1.75
    assert r("348.0", "348", False) == 0.5  # numeric only: not the exact text, and cut at max_tokens (no format)
    assert r("it is 348", "348", True) == 0.5
    assert r("abc", "348", True) == 0.0
    assert build_reward(Rl(rewards={"operator:eq": 2.0}))("x", "x", False) == 2.0
    partial = build_reward(Rl(rewards={"char_match": 1.0}))  # per character position, over the longer string
    assert [partial(x, "348", True) for x in (" 348", "347", "358", "3481", "9", "")] == [1.0, 2 / 3, 2 / 3, 0.75,
                                                                                         0.0, 0.0]


@pytest.mark.parametrize("rewards, says", [({"exact_mach": 1.0}, "did you mean 'exact_match'"),
                                            ({"no_such_mod:f": 1.0}, "cannot import"),
                                            ({"math:pi": 1.0}, "is not callable")])
def test_reward_mistakes_are_one_line(rewards, says):
    with pytest.raises(ConfigError, match=says):
        build_reward(Rl(rewards=rewards))


def test_group_advantages():
    r = [1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    a = group_advantages(r, 4, std_normalize=True)
    h = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # deviations +-0.5, unbiased std sqrt(4 x 0.25 / 3)
    assert a[:4] == pytest.approx([h, -h, -h, h], abs=1e-12)
    assert a[4:] == [0.0] * 4  # a group of equal rewards teaches nothing
    assert group_advantages(r, 4, std_normalize=False)[:4] == [0.5, -0.5, -0.5, 0.5]
    # rl.negative_scale: the wrong answers' push-down scaled, the good ones' pull-up unchanged
    assert group_advantages(r, 4, std_normalize=True, negative_scale=0.25)[:4] == pytest.approx(
        [h, -h / 4, -h / 4, h], abs=1e-12)
    assert group_advantages(r, 4, std_normalize=False, negative_scale=0.0)[:4] == [0.5, 0.0, 0.0, 0.5]


def test_prompts_from_builtin_and_jsonl(tmp_path):
    qa = load_prompts("builtin:qa")
    assert len(qa) == 1438 and qa[0]["messages"][-1]["role"] == "user" and qa[0]["reference"].isdigit()
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "2+2=", "answer": "4"}\n\n{"messages": [{"role": "user", "content": "hi"}], '
                 '"reference": "hello"}\n')
    assert load_prompts(str(f)) == [{"prompt": "2+2=", "reference": "4"},
                                    {"messages": [{"role": "user", "content": "hi"}], "reference": "hello"}]
    f.write_text('{"prompt": "2+2="}\n')
    with pytest.raises(ConfigError, match="rl.prompts .* line 1 needs"):
        load_prompts(str(f))
    with pytest.raises(ConfigError, match="rl.prompts 'builtin:text' is not a built-in chat set"):
        load_prompts("builtin:text")


def test_config_mistakes_are_one_line(monkeypatch):
    with pytest.raises(ConfigError, match="must equal rl.prompts_per_step x rl.group_size = 8"):
        cfg_of("--training.global_batch_size", "16")
    with pytest.raises(ConfigError, match="data parallelism .* only"):
        cfg_of("--parallel.tp", "2")
    with pytest.raises(ConfigError, match="rl.group_size must be >= 2"):
        cfg_of("--rl.group_size", "1", "--training.global_batch_size", "2")
    with pytest.raises(ConfigError, match="rl.negative_scale must be >= 0"):
        cfg_of("--rl.negative_scale", "-1")
    assert main(["--config", str(ROOT / "train_configs/debug_rl_qwen3.toml"), *SMALL,
                 "--rl.prompts", "nope.jsonl"]) == 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match=r"rl.prompts_per_step \(2\) must divide by the 4 data-parallel"):
        rl_data(cfg_of())


# ---------------------------------------------------------------------------------------------- engine vs trainer
def _trainer_logprobs(run, source, rollouts):
    batch = source.collate(rollouts)
    got = token_logprobs(run.model, batch, run.device)
    mask = batch["labels"] != -100
    return got[mask], batch["old_logprobs"][mask]


def test_engine_logprobs_equal_the_trainers_and_follow_the_weights(tmp_path):
    cfg = cfg_of("--job.dump_folder", str(tmp_path), *VARIED)
    run = setup(cfg)
    source = RolloutSource(cfg, run)
    b0 = source.generate(0)
    assert source.metrics()["rl/sync_bytes"] == 0  # one rank: the engine runs on the trainer's own tensors
    assert len(b0.rollouts) == 8 and b0.version == 0
    ours, engine = _trainer_logprobs(run, source, b0.rollouts)
    assert ours.numel() >= 8
    assert (ours - engine).abs().max() <= 1e-5  # fp32, the same weights: paged decode vs the training forward

    # a sharded trainer hands over gathered copies: the engine's model holds its own tensors, synced by copy
    source.gen_model.load_state_dict({k: v.clone() for k, v in source.gen_model.state_dict().items()}, assign=True)
    with torch.no_grad():
        for p in run.model.parameters():
            p.mul_(1.5)  # an update of the live weights, in place as the optimizer makes it
    b1 = source.generate(0)
    assert source.metrics()["rl/sync_bytes"] == sum(p.numel() * 4 for p in run.model.parameters())
    ours1, engine1 = _trainer_logprobs(run, source, b1.rollouts)
    assert (ours1 - engine1).abs().max() <= 1e-5
    # the same seeds on other weights: other logprobs (the engine did not keep the old ones)
    assert [r.logprobs for r in b1.rollouts] != [r.logprobs for r in b0.rollouts]


def test_vl_rollouts_carry_images_and_logprobs_equal_the_trainers(tmp_path):
    """Image prompts (builtin:digits): the engine samples from the prompt with its image, the batch carries the
    image's patches, grid and M-RoPE positions, and the trainer's recompute (the family's prepare_batch, the vision
    tower) gives the engine's logprobs (fp32, <= 1e-5). Without the image the recompute differs: it is used."""
    cfg = load_config([*VL, "--job.dump_folder", str(tmp_path)])
    run = setup(cfg)
    source = RolloutSource(cfg, run)
    b = source.generate(0)
    batch = source.collate(b.rollouts)
    doc = source.prompt_doc(b.rollouts[0].prompt)
    per_image = int(doc.media["image_grid_thw"][0].prod())  # patches of one 64x64 digit
    assert batch["image_grid_thw"].shape == (8, 3) and batch["pixel_values"].shape[0] == 8 * per_image
    assert batch["position_ids"].shape[0] == 3 and len(b.rollouts[0].prompt_ids) == len(doc) > len(
        source.prompt_ids[b.rollouts[0].prompt])  # the image pad expanded to its merged tokens
    got = token_logprobs(run.model, batch, run.device, run.ctx.prepare_batch)
    mask = batch["labels"] != -100
    assert mask.sum() >= 8 and (got[mask] - batch["old_logprobs"][mask]).abs().max() <= 1e-5
    blank = dict(batch, pixel_values=torch.zeros_like(batch["pixel_values"]))
    other = token_logprobs(run.model, blank, run.device, run.ctx.prepare_batch)
    assert (other[mask] - got[mask]).abs().max() > 1e-4


@pytest.mark.slow  # the trainer's launch on the VL model, ~15-30 s on 2 busy cores
def test_vl_rl_job_trains(tmp_path):
    """The VL job end to end: 2 steps of the trainer on image rollouts, a real gradient each."""
    assert main([*VL, "--job.dump_folder", str(tmp_path), "--job.name", "vl", "--training.steps", "2",
                 "--checkpoint.enable", "False"]) == 0
    rows = _metrics(tmp_path / "vl")
    assert sorted(rows) == [1, 2] and all(rows[s]["grad_norm"] > 0 for s in rows)
    assert all(rows[s]["count/pg"] > 0 for s in rows)


def test_reference_model_of_the_initial_weights_gives_zero_kl(tmp_path):
    """rl.reference (an HF folder of the initial weights): its logprobs equal the engine's at version 0, so the KL
    term starts at 0 (k3 of identical distributions, fp32 rounding)."""
    run = setup(cfg_of())
    run.spec.save_hf(run.model, run.model_cfg, str(tmp_path / "init"))
    cfg = cfg_of("--job.dump_folder", str(tmp_path), *VARIED, "--rl.kl_coef", "0.1", "--rl.reference",
                 str(tmp_path / "init"))
    run = setup(cfg)
    source = RolloutSource(cfg, run)
    b = source.generate(0)
    for r in b.rollouts:
        assert max(abs(x - y) for x, y in zip(r.ref_logprobs, r.logprobs)) <= 1e-5
    assert source.state_dict()["slots"][0]["reference"] == str(tmp_path / "init")
    with pytest.raises(ConfigError, match="needs model.hf_path"):
        rl_data(cfg_of("--rl.kl_coef", "0.1"))


def test_trainer_and_reference_forward_agree():
    """token_logprobs (the reference's path) equals the policy objective's hook inside the train step's forward."""
    cfg = cfg_of()
    run = setup(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (2, 16), generator=g)
    labels = ids.roll(-1, 1).masked_fill(torch.arange(16) < 8, -100)
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(16).expand(2, 16)}
    got = token_logprobs(run.model, batch, run.device)
    logits = run.model(ids, position_ids=batch["position_ids"], attn=build_attn_meta(batch, "sdpa", run.device)).logits
    want = logits.float().log_softmax(-1).gather(-1, labels.clamp(min=0)[..., None])[..., 0].where(labels != -100, 0)
    assert (got - want.detach()).abs().max() <= 1e-5


def test_the_policy_head_on_the_label_index_is_the_boolean_rows():
    """The policy hook with the collate's ``label_index`` (the head on the labeled rows, no sync on a GPU) gives the
    boolean rows' logprobs, entropies and gradients bit for bit (the same rows in the same order)."""
    run = setup(cfg_of())
    g = torch.Generator().manual_seed(2)
    h = torch.randn(2, 16, run.model.cfg.hidden_size, generator=g)
    labels = torch.randint(0, 1000, (2, 16), generator=g).masked_fill(torch.rand(2, 16, generator=g) < 0.4, -100)
    got = []
    for index in (None, (labels.reshape(-1) != -100).nonzero().squeeze(1)):
        hh = h.clone().requires_grad_()
        lp, ent = run.model.token_logprobs(hh, labels, index)
        lp.sum().backward()
        got.append((lp, ent, hh.grad))
    assert all(torch.equal(a, b) for a, b in zip(*got))
    assert bool((got[0][0][labels == -100] == 0).all()) and bool((got[0][0][labels != -100] < 0).all())


# ---------------------------------------------------------------------------------------------- the trainer
def _metrics(run_dir):
    return read_metrics(Path(run_dir) / "metrics.jsonl")


@pytest.mark.parametrize("k", [0, 1])
def test_staleness_and_resume_bitwise(tmp_path, k):
    """k = 0 trains on rollouts of the current weights, k = 1 on those of the step before; a run stopped after the
    save of step 2 and resumed trains steps 3-4 bitwise as the straight one."""
    common = ["--config", str(ROOT / "train_configs/debug_rl_qwen3.toml"), *SMALL, *VARIED,
              "--job.dump_folder", str(tmp_path), "--rl.staleness", str(k), "--checkpoint.interval", "2",
              "--checkpoint.async_mode", "disabled"]
    assert main([*common, "--job.name", "straight", "--training.steps", "4"]) == 0
    assert main([*common, "--job.name", "resumed", "--training.steps", "2"]) == 0
    assert main([*common, "--job.name", "resumed", "--training.steps", "4"]) == 0
    a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "resumed")
    assert [a[s]["data/rl/staleness"] for s in (1, 2, 3, 4)] == [0, min(1, k), k, k]
    assert [a[s]["data/rl/buffer_size"] for s in (1, 2, 3, 4)] == [k] * 4
    # on-policy (and step 1 of k = 1, sampled by the initial weights) the engine's logprobs are the trainer's (fp32)
    assert all(a[s]["loss/logprob_gap"] < 1e-5 for s in ((1, 2, 3, 4) if k == 0 else (1,))), a
    if k:  # rollouts one update old: the policy moved
        assert all(a[s]["loss/logprob_gap"] > 1e-4 for s in (2, 3, 4))
    assert all(a[s]["grad_norm"] > 0 for s in a)  # the rewards vary: a real gradient
    for s in (3, 4):
        for key in ("loss", "loss/pg", "grad_norm", "data/rl/reward_mean", "data/rl/completion_len"):
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])  # bitwise


@pytest.mark.slow  # three launches of the trainer, ~40 s on 2 cores
@pytest.mark.parametrize("k", [0, 1])
def test_sigkill_and_resume_bitwise(tmp_path, k):
    """kill -9 in the middle of step 4 (after the save of step 2), on-policy (k = 0) and one step stale (k = 1): the
    rerun resumes from step 2 (k = 1: with the buffer of rollouts made at version 1) and trains steps 3-4 bitwise as
    the straight run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    common = [str(ROOT / "run_train.sh"), "--config", "debug_rl_qwen3.toml", *SMALL, *VARIED, "--job.dump_folder",
              str(tmp_path), "--rl.staleness", str(k), "--training.steps", "4", "--checkpoint.interval", "2",
              "--checkpoint.async_mode", "disabled"]
    runs = [("straight", {}), ("killed", {"TITAN_MM_FAULT_KILL_AT_STEP": "3"}), ("killed", {})]
    codes = [subprocess.run([*common, "--job.name", name], env={**env, **extra}, cwd=ROOT, capture_output=True,
                            text=True, timeout=400) for name, extra in runs]
    assert [c.returncode for c in codes] == [0, -signal.SIGKILL, 0], codes[-1].stderr[-3000:]
    assert "resumed from" in codes[2].stderr and "step-00000002" in codes[2].stderr
    a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "killed")
    for s in (3, 4):
        for key in ("loss", "grad_norm", "data/rl/reward_mean", "data/rl/staleness"):
            assert a[s][key] == b[s][key], (s, key, a[s][key], b[s][key])
