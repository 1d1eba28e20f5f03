"""BAGEL's data as a trainer source (issue 47, items 3 and 5), fp32 on CPU: the pixel codec; each record kind's
document equals the one BAGEL's packer order gives (bagel.synthetic._Sample, checked against the reference's mask in
test_bagel.py) from images loaded and pooled here; the loader's mixture, dp sharding, exact resume and skip counts;
mistakes in one line."""

import dataclasses
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.resume_check import RESUME_ARGS, assert_resumes_exactly
from tests.unit.test_bagel import _objective, _ours
from tests.unit.test_bagel_generate import ref_patchify
from titan_mm.config import Data
from titan_mm.data.builtin import builtin_records
from titan_mm.data.builtin.images import DIGIT_QUESTION
from titan_mm.data.loader import build_dataloader
from titan_mm.data.packing import IGNORE_INDEX
from titan_mm.data.sources import SkipSample, hash_ints, list_units
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.launch.train import main
from titan_mm.models.bagel import BagelModel
from titan_mm.models.bagel.config import FLAVORS, BagelVAEConfig
from titan_mm.models.bagel.data import (
    _WAY_SALT,
    DRAW_DIGIT,
    BagelDocs,
    data_needs,
    fit_size,
    generation_doc,
)
from titan_mm.models.bagel.synthetic import _Sample
from titan_mm.models.bagel.vae import PixelCodec, load_codec

DEBUG = FLAVORS["debug"]
TOK = load_tokenizer()


def pixel_cfg(z: int = 3, down: int = 2):
    """The debug flavor with the real tokenizer's vocabulary and a pixel codec's latent shape."""
    return dataclasses.replace(DEBUG, llm_config=dataclasses.replace(DEBUG.llm_config, vocab_size=151680),
                               vae_config=BagelVAEConfig(z_channels=z, downsample=down))


CFG = pixel_cfg()  # RGB latents, 2x pooled: stride 4 (pooling x latent patch 2); ViT patch 4


def data(**kw) -> Data:
    base = {"encoders": "pixels", "image_min_pixels": 0, "image_max_pixels": 1 << 20, "seq_len": 64,
            "micro_batch_size": 2, "shuffle_buffer": 4, "open_rows": 4}
    return Data(**{**base, **kw})


# ---- the pixel codec ----

def test_pixel_codec_is_average_pooling_and_repetition():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 8, 12, generator=g) * 2 - 1
    rgb = load_codec("pixels", pixel_cfg(3, 2))
    z = rgb.encode(x)
    blocks = x.reshape(2, 3, 4, 2, 6, 2).permute(0, 1, 2, 4, 3, 5).reshape(2, 3, 4, 6, 4)
    torch.testing.assert_close(z, blocks.mean(-1), rtol=0, atol=2 * torch.finfo(torch.float32).eps)
    assert rgb.stride == 2 * DEBUG.latent_patch_size
    up = rgb.decode(z)  # each latent pixel over its 2 x 2 block, to [0, 1]
    assert up.shape == (2, 3, 8, 12) and torch.equal(up[..., ::2, ::2], (z * 0.5 + 0.5).clamp(0, 1))
    assert torch.equal(up[..., 1::2, 1::2], up[..., ::2, ::2])
    gray = PixelCodec(pixel_cfg(1, 1))  # no pooling: the pixels themselves, decoded to [0, 1] on R, G and B
    one = x[:, :1]
    assert torch.equal(gray.encode(one), one)
    assert torch.equal(gray.decode(gray.encode(one)), (one * 0.5 + 0.5).expand(2, 3, 8, 12))
    torch.testing.assert_close(gray.encode(x), x.mean(1, keepdim=True), rtol=0, atol=0)


def test_pixel_codec_mistakes_are_one_line():
    with pytest.raises(ValueError, match="z_channels 1 .grayscale. or 3") as e:
        PixelCodec(pixel_cfg(4, 2))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="multiples of 2"):
        PixelCodec(pixel_cfg(1, 2)).encode(torch.zeros(1, 1, 5, 4))


# ---- each record kind's document ----

def png(tmp_path, name: str, h: int, w: int, seed: int) -> torch.Tensor:
    """Writes a random RGB PNG; returns its pixels [3, h, w] in [-1, 1]."""
    a = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    Image.fromarray(a).save(tmp_path / name)
    return torch.from_numpy(a.astype(np.float32)).permute(2, 0, 1) / 127.5 - 1


def pooled(x_CHW: torch.Tensor, k: int) -> torch.Tensor:
    """k x k block means, written as a reshape (the reference for the codec's average pooling)."""
    C, H, W = x_CHW.shape
    return x_CHW.reshape(C, H // k, k, W // k, k).mean((2, 4))


def ids(text: str, sp) -> list[int]:
    return [sp.bos, *TOK.encode(text), sp.eos]


def assert_docs_equal(a, b):
    for k in ("input_ids", "labels", "positions"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    assert a.segments == b.segments and sorted(a.seq) == sorted(b.seq) and sorted(a.media) == sorted(b.media)
    for k in a.seq:
        assert np.array_equal(a.seq[k], b.seq[k]), k
    for k in a.media:
        assert all(np.array_equal(x, y) for x, y in zip(a.media[k], b.media[k], strict=True)), k


def one_doc(tmp_path, rec: dict, cfg=CFG, epoch: int = 0, **kw):
    (tmp_path / "rows.jsonl").write_text(json.dumps(rec) + "\n")
    unit = list_units(str(tmp_path / "rows.jsonl"))[0]
    docs = BagelDocs(cfg, data(**kw), TOK, seed=0)
    return docs(rec, unit, "s:1", epoch), docs


def test_t2i_record_is_caption_then_noised_pooled_pixels(tmp_path):
    x = png(tmp_path, "a.png", 8, 12, 0)
    doc, docs = one_doc(tmp_path, {"image": "a.png", "caption": "a red square"})
    lat = doc.seq["latents"][doc.seq["latent_mask"]]
    torch.testing.assert_close(torch.from_numpy(lat), ref_patchify(pooled(x, 2), 2), rtol=0, atol=3e-7)
    want = generation_doc(CFG, TOK.encode("a red square"), docs.codec.encode(x[None])[0], docs.specials)
    assert_docs_equal(doc, want)
    assert doc.input_ids[:len(ids("a red square", docs.specials))].tolist() == ids("a red square", docs.specials)
    assert (doc.labels == IGNORE_INDEX).all() and doc.segments[-1] == (3 * 2 + 2, "noise")


def test_edit_record_is_clean_source_vit_source_instruction_noised_target(tmp_path):
    src, tgt = png(tmp_path, "s.png", 8, 8, 1), png(tmp_path, "t.png", 12, 8, 2)
    doc, docs = one_doc(tmp_path, {"source": "s.png", "instruction": "make it blue", "target": "t.png"})
    enc = docs.codec.encode
    want = generation_doc(CFG, TOK.encode("make it blue"), enc(tgt[None])[0], docs.specials,
                          source=(enc(src[None])[0], src))
    assert_docs_equal(doc, want)
    forks, _ = one_doc(tmp_path, {"source_image": "s.png", "instruction": "make it blue", "target_image": "t.png"})
    assert_docs_equal(forks, want)  # the keys of the EditJSONLIterableDataset in BAGEL's forks
    with pytest.raises(SkipSample, match="names no \"source\""):
        one_doc(tmp_path, {"instruction": "make it blue", "target": "t.png"})
    assert [k for _, k in doc.segments] == ["full", "full", "causal", "noise"]
    assert np.array_equal(doc.media["vit_patches"][0], ref_patchify(src, 4).numpy())
    assert doc.n_patches == 4


def test_edit_source_dropouts_leave_splits_out_but_keep_their_positions(tmp_path):
    """vit_cond_dropout / vae_cond_dropout: over epochs every keep / drop pair of the source's splits comes up, and a
    dropped split's position is still taken (BAGEL's pack_sequence: curr_rope_id += 1, continue)."""
    src, tgt = png(tmp_path, "s.png", 8, 8, 1), png(tmp_path, "t.png", 8, 8, 2)
    rec = {"source": "s.png", "instruction": "make it blue", "target": "t.png"}
    (tmp_path / "rows.jsonl").write_text(json.dumps(rec) + "\n")
    unit = list_units(str(tmp_path / "rows.jsonl"))[0]
    docs = BagelDocs(CFG, data(vit_cond_dropout=0.5, vae_cond_dropout=0.5), TOK, seed=0)
    seen = set()
    for epoch in range(16):
        doc = docs(rec, unit, "e:1", epoch)
        want = _Sample(CFG, docs.specials)
        vae = bool(doc.seq["cond_latents"].any())  # the clean VAE split's patches are there when kept
        vit = "vit_lens" in doc.media
        if vae:
            want.vae_image(docs.codec.encode(src[None])[0], noised=False, unit=-1)
        else:
            want.dropped_image()
        if vit:
            want.vit_image(src)
        else:
            want.dropped_image()
        want.text(ids("make it blue", docs.specials), loss=False)
        want.vae_image(docs.codec.encode(tgt[None])[0], noised=True, unit=0)
        assert_docs_equal(doc, want.doc())
        assert doc.positions[0, -1] == 2 + len(ids("make it blue", docs.specials))  # both positions taken anyway
        seen.add((vae, vit))
    assert seen == {(True, True), (True, False), (False, True), (False, False)}


def test_image_sizes_keep_within_the_area_bounds_the_tables_and_the_multiples():
    d = data(image_min_pixels=64 * 64, image_max_pixels=256 * 256)
    assert fit_size(1000, 500, 16, 4096, d) == (352, 176)  # area down to <= 256^2, sides floored to 16
    assert fit_size(1000, 500, 16, 224, d) == (224, 112)  # the longer side within the position table
    assert fit_size(20, 30, 16, 4096, d) == (64, 80)  # up to the smallest area, sides rounded up
    assert fit_size(32, 32, 16, 4096, d) == (64, 64)
    assert fit_size(3, 3, 16, 4096, data()) == (16, 16)  # at least one multiple


def test_chat_record_is_vit_split_question_and_answer_with_ce(tmp_path):
    x = png(tmp_path, "q.png", 8, 12, 3)
    rec = {"messages": [{"role": "user", "content": [{"type": "image", "image": "q.png"},
                                                     {"type": "text", "text": "What is it?"}]},
                        {"role": "assistant", "content": "A square."}]}
    doc, docs = one_doc(tmp_path, rec)
    s = _Sample(CFG, docs.specials)
    s.vit_image(x)
    s.text(ids("What is it?", docs.specials), loss=False)
    s.text(ids("A square.", docs.specials), loss=True)
    assert_docs_equal(doc, s.doc())
    llava = {"image": "q.png", "conversations": [{"from": "human", "value": "<image>\nWhat is it? "},
                                                 {"from": "gpt", "value": "A square."}]}
    assert_docs_equal(one_doc(tmp_path, llava)[0], s.doc())  # BAGEL's own VLM SFT rows: the prompt stripped
    answer = TOK.encode("A square.")
    assert doc.labels[doc.labels != IGNORE_INDEX].tolist() == [*answer, docs.specials.eos]


def test_digits_are_asked_both_ways_alternating_by_epoch():
    """builtin:digits: the understanding chat in one epoch, "Draw the digit d." -> its noised pixels in the next
    (the first way from (seed, image)); the held-out images (builtin:digits_test) are not among its records."""
    cfg = pixel_cfg(1, 2)
    unit = list_units("builtin:digits")[0]
    rec = builtin_records("digits")[0]
    assert {r["index"] for r in builtin_records("digits")}.isdisjoint(r["index"] for r in builtin_records("digits_test"))
    docs = BagelDocs(cfg, data(image_max_pixels=256), TOK, seed=0)
    first_gen = hash_ints(0, rec["index"], _WAY_SALT) % 2 == 1
    a, b = docs(rec, unit, "d:1", 0), docs(rec, unit, "d:1", 1)
    gen, und = (a, b) if first_gen else (b, a)
    with Image.open(io.BytesIO(rec["messages"][0]["content"][0]["image"])) as im:  # 64 x 64 -> 16 x 16, bicubic
        x = torch.from_numpy(np.asarray(im.convert("RGB").resize((16, 16), Image.Resampling.BICUBIC),
                                        np.float32)).permute(2, 0, 1) / 127.5 - 1
    latent = pooled(x.mean(0, keepdim=True), 2)
    want = generation_doc(cfg, TOK.encode(DRAW_DIGIT.format(rec["answer"])), latent, docs.specials)
    for k in ("input_ids", "labels", "positions"):
        assert np.array_equal(getattr(gen, k), getattr(want, k))
    torch.testing.assert_close(torch.from_numpy(gen.seq["latents"]), torch.from_numpy(want.seq["latents"]),
                               rtol=0, atol=3e-7)
    s = _Sample(cfg, docs.specials)
    s.vit_image(x)
    s.text(ids(DIGIT_QUESTION, docs.specials), loss=False)
    s.text(ids(rec["answer"], docs.specials), loss=True)
    assert_docs_equal(und, s.doc())


# ---- the loader: mixture, sharding, resume, skips ----

def t2i_file(tmp_path, name: str, n: int, side: int = 4) -> str:
    lines = []
    for i in range(n):
        png(tmp_path, f"{name}{i}.png", side, side, i)
        lines.append(json.dumps({"image": f"{name}{i}.png", "caption": f"{name} {i}"}))
    (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return str(tmp_path / f"{name}.jsonl")


def loader(d: Data, cfg=CFG, **kw):
    return build_dataloader(d, needs=data_needs(cfg), seed=0, return_sample_ids=True, **kw)


def test_mixture_draws_sources_by_weight(tmp_path):
    a, b = t2i_file(tmp_path, "a", 20), t2i_file(tmp_path, "b", 20)
    ld, got = loader(data(mixture={a: 3.0, b: 1.0}, micro_batch_size=4)), []
    for _ in ld:
        got += ld.last_sample_ids
        if len(got) >= 800:
            break
    share = sum(":a.jsonl/" in s for s in got) / len(got)
    assert abs(share - 0.75) < 4 * (0.75 * 0.25 / len(got)) ** 0.5, share  # 4 binomial sd


def mixed_sources(tmp_path) -> dict[str, float]:
    png(tmp_path, "s.png", 8, 8, 7)
    png(tmp_path, "q.png", 8, 8, 8)
    (tmp_path / "edit.jsonl").write_text("\n".join(
        json.dumps({"source": "s.png", "instruction": f"edit {i}", "target": "q.png"}) for i in range(6)) + "\n")
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "q.png"}, f"question {i}"]},
                      {"role": "assistant", "content": f"answer {i}"}]}) for i in range(6)) + "\n")
    return {t2i_file(tmp_path, "t", 8): 2.0, str(tmp_path / "edit.jsonl"): 1.0, str(tmp_path / "chat.jsonl"): 1.0,
            "builtin:digits": 1.0}


def assert_batches_equal(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys):
        assert sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)


def test_loader_resumes_exactly_and_shards_over_dp(tmp_path):
    """A mixture of all four kinds: a loader stopped after 3 steps and a fresh one loading its state give the
    straight run's later batches bit for bit; two dp ranks read the slots of the one global stream; two worker
    processes give the same batches."""
    d = data(mixture=mixed_sources(tmp_path), seq_len=96, image_max_pixels=256, prompt_dropout=0.3)
    cfg = pixel_cfg(3, 2)
    it = iter(straight := loader(d, cfg, n_micro=2))
    first = [next(it) for _ in range(6)]
    state = straight.state_dict()
    later = [next(it) for _ in range(6)]
    resumed = loader(d, cfg, n_micro=2)
    resumed.load_state_dict(state)
    assert_batches_equal(later, [b for _, b in zip(range(6), resumed)])
    kinds = torch.cat([b["seg_kinds"].flatten() for b in first + later]).unique().tolist()
    assert kinds == [0, 1, 2] and any(b["num_label_tokens"] > 0 for b in first)  # causal, full, noise; CE
    for r in range(2):  # rank r of 2 reads slot r of every step
        ranked = [b for _, b in zip(range(6), loader(d, cfg, dp_rank=r, dp_world=2))]
        assert_batches_equal(ranked, (first + later)[r::2])
    workers = loader(dataclasses.replace(d, num_workers=2), cfg, n_micro=2)  # each builds its own BagelDocs
    assert_batches_equal([b for _, b in zip(range(6), workers)], first)


def test_a_mixed_batch_runs_both_losses(tmp_path):
    """A loader batch of every kind through the training forward: both loss sums finite, the flow-matching count
    every value of its noised latent tokens."""
    cfg = pixel_cfg(3, 2)
    batch = next(iter(loader(data(mixture=mixed_sources(tmp_path), seq_len=96, image_max_pixels=256,
                                  micro_batch_size=4), cfg)))
    torch.manual_seed(0)
    model = BagelModel(cfg)
    model.init_weights()
    obj = _objective()  # the debug config's: CE + flow matching (BAGEL's shifted sampler) under "segments"
    prepared = obj.prepare([batch], 0)[0]
    out = _ours(model, prepared, obj)
    assert batch["num_label_tokens"] > 0 and batch["vit_lens"].numel()
    assert prepared["num_latent_elements"] == int(batch["latent_mask"].sum()) * cfg.patch_latent_dim > 0
    assert all(torch.isfinite(out.terms[k]) and out.terms[k] > 0 for k in ("ce", "mse"))


def test_malformed_rows_are_skipped_and_counted(tmp_path):
    png(tmp_path, "ok.png", 4, 4, 0)
    (tmp_path / "junk.png").write_bytes(b"not an image")
    rows = [{"image": "ok.png", "caption": "fine"}, "{not json", {"image": "gone.png", "caption": "x"},
            {"image": "junk.png", "caption": "x"}, {"picture": "ok.png"}, {"image": "ok.png", "caption": ""},
            {"messages": [{"role": "user", "content": "no answer"}]},
            {"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]},
                          {"role": "assistant", "content": "a clip"}]}]
    (tmp_path / "rows.jsonl").write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    ld = loader(data(dataset=str(tmp_path / "rows.jsonl"), micro_batch_size=1, seq_len=16, shuffle_buffer=0,
                     error_min_samples=10**6))
    it = iter(ld)
    for _ in range(3):
        next(it)
    m = ld.metrics()
    passes = m["samples_seen"] // len(rows)
    want = {"malformed_json": 1, "missing_media": 1, "corrupt_image": 1, "bad_schema": 1, "empty": 2,
            "unknown_modality": 1}
    assert passes >= 1 and all(m[f"skipped/{k}"] >= n * passes for k, n in want.items()), m
    assert m["samples_packed"] >= passes


# ---- mistakes ----

def test_mistakes_are_one_line(tmp_path):
    for kw, msg in (({"encoders": ""}, "data.encoders is empty"),
                    ({"prompt_dropout": 1.0}, "data.prompt_dropout = 1.0"),
                    ({"vit_cond_dropout": -0.1}, "data.vit_cond_dropout = -0.1"),
                    ({"encoders": str(tmp_path)}, "no config.json there")):
        with pytest.raises(ValueError, match=msg) as e:
            BagelDocs(CFG, data(**kw), TOK, 0)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="z_channels 1 .grayscale. or 3"):
        BagelDocs(DEBUG, data(), TOK, 0)  # the debug flavor's 4 latent channels are no pixels
    with pytest.raises(SkipSample, match="a BAGEL record has \"caption\""):
        one_doc(tmp_path, {"prompt": "x"})


RUN = ["--config", "debug_bagel_digits", "--metrics.enable_tensorboard", "False", "--training.deterministic", "True",
       "--checkpoint.async_mode", "disabled"]


def test_launcher_mistakes_are_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "edit.jsonl").write_text(json.dumps({"source": "a.png", "instruction": "x", "target": "b.png"}) + "\n")
    for args, msg in ((["--data.encoders", ""], "data.encoders is empty"),
                      (["--model.overrides", "{}"], "the model's vae_config must have z_channels 1"),
                      (["--data.dataset", str(tmp_path / "none.jsonl")], "none.jsonl"),
                      (["--data.dataset", "builtin:text"],
                       "none of its first 8 records makes a 'bagel' sample (last: bad_schema"),
                      (["--data.mixture", json.dumps({"builtin:digits": 1, str(tmp_path / "edit.jsonl"): 1})],
                       "edit.jsonl: none of its first 8 records makes a 'bagel' sample (last: missing_media")):
        assert main([*RUN, "--job.dump_folder", str(tmp_path / "runs"), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert msg in err[-1], err
    assert not (tmp_path / "runs").exists()  # refused before the run folder


@pytest.mark.slow
def test_digits_run_resumes_exactly(tmp_path):
    """debug_bagel_digits through the launcher: stopped at its step-4 checkpoint and resumed, every step's losses
    are the straight run's, bit for bit (the loader's packed rows, shuffle buffer and draws come back)."""
    assert_resumes_exactly(lambda name, steps: main([*RUN, "--job.dump_folder", str(tmp_path), "--job.name", name,
                                                     "--training.steps", str(steps), *RESUME_ARGS]), tmp_path,
                           lambda r: (r["loss"], r["loss/ce"], r["loss/mse"]))


def test_bagel_t2i_parquet_rows_draw_one_of_their_captions(tmp_path):
    """BAGEL's t2i parquet row: the image's bytes and a JSON object of captions, one drawn per (sample, epoch)."""
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    x = png(tmp_path, "a.png", 8, 8, 4)
    caps = {"short": "a square", "long": "a square of random colored pixels"}
    pq.write_table(pa.table({"image": [(tmp_path / "a.png").read_bytes()], "captions": [json.dumps(caps)]}),
                   tmp_path / "t2i.parquet")
    unit = list_units(str(tmp_path / "t2i.parquet"))[0]
    docs = BagelDocs(CFG, data(), TOK, seed=0)
    rec = {"image": (tmp_path / "a.png").read_bytes(), "captions": json.dumps(caps)}
    got = {docs(rec, unit, "p:1", e).input_ids.tobytes() for e in range(8)}
    want = {generation_doc(CFG, TOK.encode(c), docs.codec.encode(x[None])[0], docs.specials).input_ids.tobytes()
            for c in caps.values()}
    assert got == want  # both captions drawn over 8 epochs, nothing else
    row = next(iter(loader(data(dataset=str(tmp_path / "t2i.parquet"), micro_batch_size=1, seq_len=16))))
    first = row["input_ids"][0][row["doc_ids"][0] == 0].numpy()  # the parquet row through the loader
    assert first.tobytes() in want


def chain_reference(imgs, instrs, start: int, end: int, joined: bool, pick, enc, sp):
    """BAGEL's UnifiedEditIterableDataset.parse_row for the span (start, end) and the branch ``joined`` (its random
    choices given), as titan's splits (no dropouts): the start image conditions; joined: the span's instructions
    "a. b." (end pulled back one at the chain's last image) and the end image as the only target; else each edit's
    instruction and its image as a target, the ones before the end conditioning again."""
    want = _Sample(CFG, sp)
    want.vae_image(enc(imgs[start][None])[0], noised=False, unit=-1)
    want.vit_image(imgs[start])
    if joined:
        end -= end == len(imgs) - 1
        text = "".join(pick(i - 1) + ". " for i in range(start + 1, end + 1)).rstrip()
        want.text(ids(text, sp), loss=False)
        want.vae_image(enc(imgs[end][None])[0], noised=True, unit=0)
        return want.doc()
    for unit, i in enumerate(range(start + 1, end + 1)):
        want.text(ids(pick(i - 1), sp), loss=False)
        want.vae_image(enc(imgs[i][None])[0], noised=True, unit=unit)
        if i != end:
            want.vae_image(enc(imgs[i][None])[0], noised=False, unit=-1)
            want.vit_image(imgs[i])
    return want.doc()


def test_bagel_edit_parquet_chain_draws_spans_as_bagel_does(tmp_path):
    """BAGEL's edit parquet row (image_list, instruction_list of variants): over samples and epochs every span BAGEL
    can draw comes up in both branches, and each doc is the reference's for its span, branch and variants."""
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    imgs = [png(tmp_path, f"c{i}.png", 8, 8, 10 + i) for i in range(4)]
    raw = [(tmp_path / f"c{i}.png").read_bytes() for i in range(4)]
    instrs = [["make it red", "paint it red"], ["flip it"], ["add a dot", "dot it"]]
    pq.write_table(pa.table({"image_list": [raw], "instruction_list": [instrs]}), tmp_path / "edit.parquet")
    unit = list_units(str(tmp_path / "edit.parquet"))[0]
    docs = BagelDocs(CFG, data(), TOK, seed=0)
    rec = {"image_list": raw, "instruction_list": instrs}
    enc, sp = docs.codec.encode, docs.specials
    # every (span, branch, variants) BAGEL's parse_row can give for this row
    spans = [(s, e) for s in range(3) for e in range(s + 1, min(s + 3, 4))]
    choices = {}
    for s, e in spans:
        for joined in ((False, True) if e - s > 1 else (False,)):
            for pick_ix in np.ndindex(*(len(v) for v in instrs)):
                doc = chain_reference(imgs, instrs, s, e, joined, lambda i: instrs[i][pick_ix[i]], enc, sp)
                choices[doc.input_ids.tobytes() + doc.seq["latents"].tobytes()] = (s, e, joined), doc
    seen = set()
    for sample in range(12):
        for epoch in range(4):
            doc = docs(rec, unit, f"c:{sample}", epoch)
            got = doc.input_ids.tobytes() + doc.seq["latents"].tobytes()
            assert got in choices, (sample, epoch)
            span, want = choices[got]
            assert_docs_equal(doc, want)  # labels, positions, segments and the ViT media too
            seen.add(span)
    assert seen == {(s, e, j) for s, e in spans for j in ((False, True) if e - s > 1 else (False,))}
    row = next(iter(loader(data(dataset=str(tmp_path / "edit.parquet"), micro_batch_size=1, seq_len=64))))
    assert int(row["latent_mask"].sum()) > 0  # the parquet row through the loader: at least one noised target


def test_bagel_edit_chain_mistakes_are_counted_skips(tmp_path):
    png(tmp_path, "a.png", 8, 8, 1)
    one = ["a.png"]
    for rec, match in (({"image_list": one, "instruction_list": []}, "at least 2 images"),
                       ({"image_list": one * 3, "instruction_list": [["x"]]}, "one entry per edit: 2 for 3"),
                       ({"image_list": one * 2, "instruction_list": [[]]}, "holds no instruction")):
        with pytest.raises(SkipSample, match=match):
            one_doc(tmp_path, rec)
