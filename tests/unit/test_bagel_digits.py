"""The BAGEL digits debug task's held-out evaluation (issue 47 item 5, titan_mm.models.bagel.digits), fp32 on CPU:
the scorer reads the rows' own images, greedy decoding through the training forward is the teacher-forced argmax,
the sampler is asked what training showed, and (slow) debug_bagel_digits.toml trained by the launcher for half its
steps learns both ways on the held-out digits."""

import numpy as np
import pytest
import torch
from PIL import Image

from titan_mm.config import load_config
from titan_mm.data.builtin.images import digits_records
from titan_mm.data.sources import Unit
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.launch.train import main
from titan_mm.loader import load_model, model_from_config
from titan_mm.models.bagel import digits
from titan_mm.models.bagel.data import DRAW_DIGIT, BagelDocs, collate, generation_doc
from titan_mm.models.bagel.model import BagelModel
from titan_mm.models.bagel.sample import unpatchify
from titan_mm.models.bagel.spec import ROUTING_KEYS, prepare_batch
from titan_mm.nn.attention import build_attn_meta
from titan_mm.nn.init import seeded_init
from titan_mm.tools.bagel_digits import main as score
from titan_mm.tools.bagel_generate import main as generate

JOB = load_config(["--config", "debug_bagel_digits"])
_, CFG = model_from_config(JOB, torch.device("cpu"))
TOK = load_tokenizer()
DOCS = BagelDocs(CFG, JOB.data, TOK, JOB.training.seed)
HELD_OUT = digits_records(test=True)
AS_DIGITS = Unit("digits", "builtin:digits_test", "builtin")  # asked one way per epoch: the generation doc is one


def _model(seed: int = 0) -> BagelModel:
    with seeded_init(seed):
        model = BagelModel(CFG)
        model.init_weights()
    with torch.no_grad():  # llm2vae starts at 0 (BAGEL's init): move it so the velocities are not all 0
        model.llm2vae.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed))
    return model.eval()


def _generation_doc(rec):
    """The training rows' generation doc of ``rec`` (the epoch that asks it that way)."""
    for epoch in (0, 1):
        d = DOCS(rec, AS_DIGITS, f"g{rec['index']}", epoch)
        if d.seq["latent_mask"].any():
            return d
    raise AssertionError("no epoch asks the digit to be drawn")


def test_the_classifier_reads_the_rows_images():
    """The held-out digits as the rows encode them (resized, pooled to the codec's latent) and decode them back are
    read as their labels: the scorer sees what training drew (polarity, size), not only load_digits' arrays."""
    recs = HELD_OUT[:120]
    images = []
    for r in recs:
        d = _generation_doc(r)
        x = torch.from_numpy(d.seq["latents"][d.seq["latent_mask"]])
        hw = int(np.sqrt(len(x))) * CFG.latent_patch_size
        images.append(DOCS.codec.decode(unpatchify(x, (hw, hw), CFG.latent_patch_size)[None])[0])
    read = digits.classify(torch.stack(images))
    # load_digits' own held-out arrays: 98.3%; the rows' 16 x 16 bicubic copies pooled to 8 x 8 lose little
    assert np.mean(read == np.array([int(r["answer"]) for r in recs])) >= 0.95


def test_greedy_answers_are_the_teacher_forced_argmax():
    """Greedy decoding re-runs the chat cut at the answer: its first token is the argmax of the full training doc's
    logits at the answer's bos, and a prefix holding the true answer is the training doc's first tokens."""
    model = _model()
    recs = HELD_OUT[:6]
    chats = [DOCS(r, digits.CHAT, f"c{r['index']}") for r in recs]
    n = len(chats[0])
    cut = digits.answer_prefix(chats[0], 3, TOK.encode(recs[0]["answer"]))
    assert np.array_equal(cut.input_ids, chats[0].input_ids[:n - 1]) and cut.segments[-1] == (2, "causal")
    assert np.array_equal(cut.positions, chats[0].positions[:, :n - 1]) and (cut.labels == -100).all()
    b = prepare_batch(CFG, collate([[c] for c in chats], n), "cpu")
    with torch.no_grad():
        logits = model(b["input_ids"], position_ids=b["position_ids"],
                       attn=build_attn_meta(b, CFG.attn_backend, "cpu", kind="segments"),
                       **{k: b[k] for k in ROUTING_KEYS}, noisy_latents=b["cond_latents"] * 0,
                       cond_latents=b["cond_latents"], timesteps=torch.zeros(b["input_ids"].shape),
                       latent_pos=b["latent_pos"], vit_patches=b["vit_patches"], vit_pos=b["vit_pos"],
                       vit_index=b["vit_index"], vit_attn=b["vit_attn"]).logits
    want = logits[:, n - 3].argmax(-1).tolist()  # at the answer's bos
    got = digits.greedy(model, chats, 3, DOCS.specials.eos)
    assert [g[0] for g in got] == want
    assert all(g[-1] == -1 for g in got)  # a random model ends no turn in 2 tokens: marked, never an exact answer


def test_the_sampler_is_asked_what_training_showed():
    """The sampler's context for "draw d" holds the training rows' prompt split, token for token."""
    seen = 0
    for rec in HELD_OUT[:10]:
        d = _generation_doc(rec)
        prompt = TOK.encode(DRAW_DIGIT.format(rec["answer"]))
        ctx = generation_doc(CFG, prompt, torch.zeros(CFG.vae_config.z_channels, 8, 8), DOCS.specials)
        if d.segments[0][1] == "causal":  # the prompt was not dropped (data.prompt_dropout)
            k = d.segments[0][0]
            assert np.array_equal(ctx.input_ids[:k], d.input_ids[:k]) and ctx.segments == d.segments
            seen += 1
    assert seen >= 5


def test_generation_is_seeded_and_read_per_digit():
    model = _model(1)
    a = digits.generation(model, DOCS, 1, (16, 16), seed=3, steps=2)
    b = digits.generation(model, DOCS, 1, (16, 16), seed=3, steps=2)
    assert a[2].shape == (10, 1, 3, 16, 16) and torch.equal(a[2], b[2]) and a[1] == b[1]
    assert a[0] == np.mean([r == d for d, rs in enumerate(a[1]) for r in rs])
    assert 0 <= a[2].min() and a[2].max() <= 1


@pytest.mark.slow
def test_a_half_length_digits_run_learns_both_ways(tmp_path):
    """debug_bagel_digits.toml trained by the launcher for half its steps (600 of 1200, the same warmup-stable-decay
    schedule compressed; 6 min on 2 shared cores): generated digits read as asked >= 80% (the issue's target) and
    held-out understanding >= 70% (chance is 10%). The full run meets both targets of issue 47 item 5
    (understanding >= 90% too): bench/bagel_digits.py, bench/results/bagel_digits_cpu.json."""
    assert main(["--config", "debug_bagel_digits", "--job.dump_folder", str(tmp_path), "--job.name", "run",
                 "--training.steps", "600", "--metrics.enable_tensorboard", "False"]) == 0
    got = load_model(tmp_path / "run")
    s = digits.evaluate(got.model, BagelDocs(got.model_cfg, got.data, got.tokenizer, got.job.training.seed),
                        per_digit=5, **digits.SAMPLER)
    assert s.understanding >= 0.7 and s.generation >= 0.8, (s.understanding, s.generation)

def test_mistakes_are_one_line_exit_2(tmp_path, capsys):
    for args, msg in ((["--model", str(tmp_path), "--per-digit", "0"], "give counts >= 1"),
                      (["--model", str(tmp_path / "none")], "does not exist")):
        assert score(args) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err


def test_bagel_generate_draws_through_the_pixel_codec(tmp_path):
    """python -m titan_mm.tools.bagel_generate --vae pixels: a digits run's PNG, decoded by the pixel codec."""
    assert main(["--config", "debug_bagel_digits", "--job.dump_folder", str(tmp_path), "--job.name", "run",
                 "--training.steps", "1", "--metrics.enable_tensorboard", "False"]) == 0
    out = tmp_path / "seven.png"
    assert generate(["--model", str(tmp_path / "run"), "--prompt", DRAW_DIGIT.format(7), "--height", "16",
                     "--width", "16", "--steps", "3", "--shift", "1", "--vae", "pixels", "--out", str(out)]) == 0
    with Image.open(out) as im:
        assert im.size == (16, 16) and im.mode == "RGB"
