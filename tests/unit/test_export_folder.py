"""python -m titan_mm.export writes a complete HF folder: transformers' AutoTokenizer, pipeline and (for vision
models) AutoImageProcessor / AutoProcessor load it offline and agree with titan_mm's tokenizer and processors.

One tiny run per family kind (one training step through the trainer, a committed checkpoint), exported once.
"""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers / huggingface_hub read it: local folders only
transformers = pytest.importorskip("transformers")
from transformers import AutoImageProcessor, AutoTokenizer  # noqa: E402

from titan_mm.checkpoint_io import resolve_checkpoint  # noqa: E402
from titan_mm.config import ConfigError, load_config  # noqa: E402
from titan_mm.data.chat_templates import chat_template_jinja  # noqa: E402
from titan_mm.data.processors import Processor, ProcessorConfig  # noqa: E402
from titan_mm.data.schema import parse_record  # noqa: E402
from titan_mm.data.tokenizer import load_tokenizer, qwen3_tokenizer_dir  # noqa: E402
from titan_mm.export import export, hf_folder_files  # noqa: E402
from titan_mm.launch.train import main  # noqa: E402
from titan_mm.loader import checkpoint_config, load_model  # noqa: E402
from titan_mm.train.setup import model_from_config  # noqa: E402

ONE_STEP = ["--training.steps", "1", "--checkpoint.interval", "1", "--checkpoint.async_mode", "disabled",
            "--metrics.enable_tensorboard", "False", "--training.global_batch_size", "0",
            "--lr_scheduler.warmup_steps", "0", "--data.micro_batch_size", "1", "--data.seq_len", "32",
            "--job.device", "cpu"]  # fp32 on CPU everywhere (on the H200 the ViT's flash path wants bf16)
TEXTS = ["Hello world!", "  spaces\tand\nnewlines  ", "数字 7 ✓ émoji 🙂",
         "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>"]


def _run_and_export(tmp_path_factory, name, config, *extra):
    root = tmp_path_factory.mktemp(name)
    assert main(["--config", config, "--job.dump_folder", str(root), "--job.name", name, *ONE_STEP, *extra]) == 0
    out = export(root / name, root / "hf")
    return root / name, out


@pytest.fixture(scope="module")
def text_run(tmp_path_factory):
    return _run_and_export(tmp_path_factory, "text", "debug_qwen3", "--data.dataset", "synthetic",
                           "--model.overrides", '{"num_hidden_layers": 1}')


@pytest.fixture(scope="module")
def vl_run(tmp_path_factory):
    return _run_and_export(tmp_path_factory, "vl", "debug_qwen3_vl")


def _processor(cfg):
    """titan_mm's processor of the run of ``cfg`` (its tokenizer, [data] and the family's data needs)."""
    spec, model_cfg = model_from_config(cfg, torch.device("cpu"))
    return Processor(load_tokenizer(cfg.data.tokenizer_path), ProcessorConfig(cfg.data, spec.data_needs(model_cfg)))


def _run_cfg(run):
    return checkpoint_config(resolve_checkpoint(run))


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}]


def test_text_export_tokenizer_chat_template_and_pipeline(text_run):
    run, out = text_run
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / f).is_file(), f
    assert not (out / "preprocessor_config.json").exists()  # a text model has no image processor
    ours = load_tokenizer(None)
    hf = AutoTokenizer.from_pretrained(out)
    assert len(hf) == ours.vocab_size
    for t in TEXTS:
        assert hf.encode(t, add_special_tokens=False) == ours.encode(t), t
        assert hf(t)["input_ids"] == ours.encode(t)  # no BOS is added, as in training
    assert (hf.eos_token, hf.pad_token) == ("<|im_end|>", "<|endoftext|>")
    # the template the run's processors rendered (Qwen3's, the family's default)
    proc = _processor(_run_cfg(run))
    text, _, _ = proc.render(parse_record({"messages": CHAT}))
    assert hf.apply_chat_template(CHAT, tokenize=False) == text
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"eos_token_id": [ours.im_end_id, ours.endoftext_id], "pad_token_id": ours.endoftext_id}

    # pipeline("text-generation"), greedy (the pipeline samples unless told), == titan_mm's model on the weights
    pipe = transformers.pipeline("text-generation", model=str(out))
    prompt = "The digit after six is"
    got = pipe(prompt, max_new_tokens=3, do_sample=False, return_full_text=False)[0]["generated_text"]
    model = load_model(run).model
    ids = ours.encode(prompt)
    new = []
    with torch.no_grad():
        for _ in range(3):
            x = torch.tensor([ids + new])
            nxt = int(model(x, position_ids=torch.arange(x.shape[1])[None]).logits[0, -1].argmax())
            if nxt in gen["eos_token_id"]:
                break
            new.append(nxt)
    assert new and got == ours.decode(new)
    torch.manual_seed(0)
    chat = pipe([{"role": "user", "content": "Hi!"}], max_new_tokens=2)[0]["generated_text"]
    assert chat[-1]["role"] == "assistant" and chat[-1]["content"]


def _image(h, w, seed=0):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def _vl_chat(img):
    return [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": "What digit?"}]},
            {"role": "assistant", "content": "7"}]


def test_vl_export_image_processor_and_template_match_titan(vl_run):
    run, out = vl_run
    cfg = _run_cfg(run)
    proc = _processor(cfg)
    img = _image(50, 70)  # resized to 64 x 64 by the run's image_min/max_pixels (4096)
    sample = parse_record({"messages": _vl_chat(img)})
    doc = proc(sample)
    ip = AutoImageProcessor.from_pretrained(out)
    got = ip(images=[img], return_tensors="np")
    np.testing.assert_array_equal(got["image_grid_thw"], doc.media["image_grid_thw"][0])
    np.testing.assert_allclose(got["pixel_values"], doc.media["pixel_values"][0], rtol=0, atol=1e-6)
    tok = AutoTokenizer.from_pretrained(out)
    text, _, _ = proc.render(sample)
    assert tok.apply_chat_template(_vl_chat(img), tokenize=False) == text
    assert tok.apply_chat_template(_vl_chat(img)[:2], tokenize=False, add_generation_prompt=True) == \
        proc.render(parse_record({"messages": _vl_chat(img)[:2]}), add_generation_prompt=True)[0]
    # every part kind of the schema and a tool turn render alike (render only: no media is read)
    mixed = [{"role": "user", "content": [{"type": "video", "video": "clip.mp4"}, {"type": "text", "text": "And"},
                                          {"type": "image_url", "image_url": {"url": "a.png"}}]},
             {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
             {"role": "tool", "content": "{\"n\": 1}"}, {"role": "assistant", "content": "One."}]
    assert tok.apply_chat_template(mixed, tokenize=False) == proc.render(parse_record({"messages": mixed}))[0]
    video = json.loads((out / "video_preprocessor_config.json").read_text())
    assert video["size"] == {"shortest_edge": cfg.data.video_min_pixels, "longest_edge": cfg.data.video_max_pixels}
    assert (video["fps"], video["min_frames"], video["max_frames"]) == \
        (cfg.data.video_fps, cfg.data.video_min_frames, cfg.data.video_max_frames)


def test_vl_export_auto_processor_matches_titan(vl_run):
    """AutoProcessor needs transformers' video processor, which needs torchvision (not installable beside the
    CPU torch here; run it where torchvision is)."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor

    run, out = vl_run
    proc = _processor(_run_cfg(run))
    img = _image(64, 64, seed=3)  # already the run's size: no resize, so any image backend gives the same pixels
    sample = parse_record({"messages": _vl_chat(img)})
    doc = proc(sample)
    hf = AutoProcessor.from_pretrained(out)
    text = hf.apply_chat_template(_vl_chat(img), tokenize=False)
    assert text == proc.render(sample)[0]
    got = hf(text=[text], images=[img], return_tensors="np")
    np.testing.assert_array_equal(got["input_ids"][0], doc.input_ids)
    np.testing.assert_array_equal(got["image_grid_thw"], doc.media["image_grid_thw"][0])
    np.testing.assert_allclose(got["pixel_values"], doc.media["pixel_values"][0], rtol=0, atol=1e-6)


def test_tokenizer_from_data_tokenizer_path_and_model_hf_path(text_run, tmp_path):
    """data.tokenizer_path wins; a folder with only tokenizer.json gets the processors' eos / pad tokens; without
    it, the model's HF folder's tokenizer is taken; data.chat_template replaces the family's template."""
    _, out = text_run
    own = tmp_path / "tok"
    own.mkdir()
    shutil.copyfile(os.path.join(qwen3_tokenizer_dir(), "tokenizer.json"), own / "tokenizer.json")
    cfg = load_config(["--config", "debug_qwen3", "--data.tokenizer_path", str(own),
                       "--data.chat_template", "chatml"])
    files = hf_folder_files(cfg)
    assert files["tokenizer.json"] == own / "tokenizer.json" and "vocab.json" not in files
    conf = json.loads(files["tokenizer_config.json"])
    assert (conf["eos_token"], conf["pad_token"]) == ("<|im_end|>", "<|endoftext|>")
    assert conf["chat_template"] == files["chat_template.jinja"] == chat_template_jinja("chatml")
    folder = tmp_path / "hf"
    folder.mkdir()
    shutil.copyfile(out / "config.json", folder / "config.json")
    for name, body in files.items():
        if isinstance(body, str):
            (folder / name).write_text(body)
        else:
            shutil.copyfile(body, folder / name)
    hf = AutoTokenizer.from_pretrained(folder)
    assert hf.encode(TEXTS[2], add_special_tokens=False) == load_tokenizer(str(own)).encode(TEXTS[2])
    msgs = CHAT[:2] + [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}]
    assert hf.apply_chat_template(msgs, tokenize=False) == _processor(cfg).render(parse_record({"messages": msgs}))[0]

    by_hf = hf_folder_files(load_config(["--config", "debug_qwen3", "--model.hf_path", str(out)]))
    assert by_hf["tokenizer.json"] == out / "tokenizer.json" and by_hf["vocab.json"] == out / "vocab.json"


def test_missing_tokenizer_is_one_line(tmp_path):
    cfg = load_config(["--config", "debug_qwen3", "--data.tokenizer_path", str(tmp_path / "gone")])
    with pytest.raises(ConfigError) as e:
        hf_folder_files(cfg)
    msg = str(e.value)
    assert "\n" not in msg and "tokenizer" in msg and "data.tokenizer_path" in msg and "gone" in msg
