"""BAGEL's VAE encoding in the trainer's process on its device (DocLayout.encoder, bagel.data.BagelEncoder; issue 47
item 3), fp32 on CPU: the deferred path's batches equal the worker-encoded ones bit for bit (every tensor, a mixed
text-to-image / editing / VLM / digits source with bad rows, images of one size encoded together), so do their skip
counts and an exact resume; a tiny random FLUX-architecture VAE, one image a call; the trainer takes the path;
a bad encoder folder is one line, exit 2, before the build. The latent cache (python -m titan_mm.tools.cache,
named by data.encoders) gives the codec's batches on either path; a bad cache is one line."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from tests.unit.test_bagel_data import (
    RUN,
    TOK,
    assert_batches_equal,
    data,
    loader,
    mixed_sources,
    pixel_cfg,
    png,
)
from tests.unit.test_bagel_generate import tiny_vae
from titan_mm.config import load_config
from titan_mm.launch.train import main
from titan_mm.models.bagel.data import (
    DEFERRED,
    BagelDocs,
    BagelEncoder,
    write_latent_cache,
)
from titan_mm.models.bagel import data as bagel_data
from titan_mm.models.bagel import vae as vae_mod
from titan_mm.models.bagel.vae import CachedCodec, check_codec
from titan_mm.registry import resolve_model
from titan_mm.tools.cache import main as cache
from titan_mm.train.preflight import preflight
from titan_mm.train.setup import build_data, pick_device

STEPS = 6


def with_bad_rows(tmp_path) -> dict[str, float]:
    """mixed_sources plus a source whose rows are skipped (an unreadable image, a missing one) among good ones."""
    png(tmp_path, "ok.png", 8, 8, 9)
    (tmp_path / "junk.png").write_bytes(b"not an image")
    rows = [{"image": "ok.png", "caption": "fine"}, {"image": "junk.png", "caption": "x"},
            {"image": "gone.png", "caption": "x"}, {"image": "ok.png", "caption": "again"}]
    (tmp_path / "bad.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return {**mixed_sources(tmp_path), str(tmp_path / "bad.jsonl"): 1.0}


def take(ld, n: int) -> list[dict]:
    return [b for _, b in zip(range(n), ld)]


def skips(ld) -> dict:
    return {k: v for k, v in ld.metrics().items() if k.startswith("skipped") or k in ("samples_seen", "samples_packed")}


@pytest.mark.parametrize("z", [3, 1])  # RGB latents, and grayscale (the channels' mean) as the digits task's
def test_device_batches_equal_worker_batches_and_resume_exactly(tmp_path, z):
    cfg = pixel_cfg(z, 2)
    d = data(mixture=with_bad_rows(tmp_path), seq_len=96, image_max_pixels=256, prompt_dropout=0.3,
             error_min_samples=10**6)
    worker = loader(d, cfg, n_micro=2)
    want = take(worker, 2 * STEPS)
    device = loader(d, cfg, n_micro=2, encode_device="cpu")
    assert isinstance(device.encode, BagelEncoder) and worker.encode is None
    it = iter(device)
    first = [next(it) for _ in range(STEPS)]
    state = device.state_dict()
    later = [next(it) for _ in range(STEPS)]
    assert_batches_equal(first + later, want)  # every key, bit for bit; no deferred key left
    assert skips(device) == skips(worker) and skips(worker)["skipped/corrupt_image"] > 0
    assert all(not set(DEFERRED) & set(b) for b in want)
    resumed = loader(d, cfg, n_micro=2, encode_device="cpu")
    resumed.load_state_dict(state)
    assert_batches_equal(take(resumed, STEPS), later)
    workers = loader(dataclasses.replace(d, num_workers=2), cfg, n_micro=2, encode_device="cpu")
    assert_batches_equal(take(workers, 2 * STEPS), want)  # the workers defer, this process encodes


def test_images_of_one_size_are_encoded_together(tmp_path):
    """The deferred batch carries each VAE image's uint8 pixels in token order; one codec call per size (up to
    ENCODE_PIXELS), one per image when max_pixels holds one."""
    cfg = pixel_cfg(3, 2)
    d = data(mixture=mixed_sources(tmp_path), seq_len=96, image_max_pixels=256, micro_batch_size=4)
    calls: dict[int, list[int]] = {}
    for max_pixels in (1 << 20, 1):
        ld = loader(d, cfg, encode_device="cpu")
        ld.encode = BagelEncoder(cfg, d, "cpu", max_pixels=max_pixels)
        inner, seen = ld.encode.codec.encode, calls.setdefault(max_pixels, [])
        ld.encode.codec.encode = lambda x, inner=inner, seen=seen: (seen.append(x.shape[0]), inner(x))[1]
        next(iter(ld))
    assert max(calls[1 << 20]) > 1  # several images of one size in one call
    assert set(calls[1]) == {1} and sum(calls[1]) == sum(calls[1 << 20])  # the same images, one a call


def vae_rows(tmp_path, sizes: list[tuple[int, int]], edit: tuple[int, int]):
    """(config, [data]): a tiny random FLUX-architecture AutoencoderKL (a diffusers folder, 4x down, 4 channels), a
    text-to-image row per image size and an editing row (image edit[0] -> image edit[1])."""
    tiny_vae().save_pretrained(tmp_path / "vae")
    rows = []
    for i, (h, w) in enumerate(sizes):
        png(tmp_path, f"i{i}.png", h, w, i)
        rows.append({"image": f"i{i}.png", "caption": f"image {i}"})
    rows.append({"source": f"i{edit[0]}.png", "instruction": "turn it", "target": f"i{edit[1]}.png"})
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    d = data(dataset=str(tmp_path / "rows.jsonl"), encoders=str(tmp_path / "vae"), seq_len=64, shuffle_buffer=0)
    return pixel_cfg(4, 4), d  # the VAE's latent shape


def test_flux_vae_on_the_device_equals_the_worker_latents(tmp_path):
    """A tiny random FLUX-architecture AutoencoderKL (a diffusers folder, 4x down, 4 channels): editing and
    text-to-image rows through both paths give the same batches bit for bit, one image a codec call (batched
    convolutions on the CPU differ in the last bits: docs/bagel.md "Data")."""
    cfg, d = vae_rows(tmp_path, [(8, 16), (16, 8), (16, 16), (8, 8)], edit=(0, 1))
    want = take(loader(d, cfg), 4)
    device = loader(d, cfg, encode_device="cpu")
    device.encode = BagelEncoder(cfg, d, "cpu", max_pixels=1)
    got = take(device, 4)
    assert_batches_equal(got, want)
    assert any(b["cond_latents"].abs().sum() > 0 for b in got) and all(b["latents"].abs().sum() > 0 for b in got)


def test_the_trainer_encodes_on_its_device():
    cfg = load_config(["--config", "debug_bagel_digits"])
    spec, model_cfg = resolve_model("bagel", cfg.model.flavor, overrides=cfg.model.overrides)
    ld = build_data(cfg, spec, model_cfg, 0, 1, 1)
    assert isinstance(ld.encode, BagelEncoder) and ld.encode.codec.device == pick_device(cfg)
    batch = next(iter(ld))
    assert not set(DEFERRED) & set(batch) and batch["latents"][batch["latent_mask"]].abs().sum() > 0


def test_bad_encoder_folder_is_one_line_before_the_build(tmp_path, capsys):
    tiny_vae().save_pretrained(tmp_path / "vae4")  # 4 latent channels, 4x: the digits config's codec has 1, 2x
    (tmp_path / "empty").mkdir()
    for enc, msg in ((tmp_path / "empty", "no config.json there nor in its vae/"),
                     (tmp_path / "vae4", "the VAE has 4 latent channels and 4x downsampling")):
        assert main([*RUN, "--job.dump_folder", str(tmp_path / "runs"), "--data.encoders", str(enc)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert msg in err[-1], err
    assert not (tmp_path / "runs").exists()  # refused before the run folder and the model
    with pytest.raises(ValueError, match="no config.json there") as e:  # the deferred builder checks the name too
        BagelDocs(pixel_cfg(), data(encoders=str(tmp_path / "empty")), TOK, 0, defer=True)
    assert "\n" not in str(e.value)


def test_preflight_checks_a_vae_without_loading_it(tmp_path, monkeypatch):
    """Preflight builds the first records deferred, as the trainer does: the VAE's shape comes from its config.json
    or its ae.safetensors header (one line each), and its weights are neither loaded nor run on the host."""
    tiny_vae(z=1, levels=2).save_pretrained(tmp_path / "vae")  # the digits config's 1 channel at 2x

    def no_load(*a, **k):
        raise AssertionError("preflight loaded a VAE")

    monkeypatch.setattr(vae_mod, "load_vae", no_load)
    monkeypatch.setattr(bagel_data, "load_codec", no_load)
    preflight(load_config([*RUN, "--data.encoders", str(tmp_path / "vae")]))
    flux = pixel_cfg(16, 8)  # FLUX's shape: BFL's layout fixes 4 levels (8x)
    save_file({"encoder.conv_out.weight": torch.zeros(8, 2, 3, 3)}, tmp_path / "ae4.safetensors")
    save_file({"decoder.conv_in.weight": torch.zeros(2, 16, 3, 3)}, tmp_path / "odd.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    save_file({"encoder.conv_out.weight": torch.zeros(32, 2, 3, 3)}, tmp_path / "ae16.safetensors")
    check_codec(str(tmp_path / "ae16.safetensors"), flux)
    for name, msg in (("ae4", "the VAE has 4 latent channels and 8x downsampling"),
                      ("odd", "has no encoder.conv_out.weight: not an autoencoder in BFL's layout"),
                      ("junk", "is no safetensors file")):
        with pytest.raises(ValueError, match=msg) as e:
            check_codec(str(tmp_path / f"{name}.safetensors"), flux)
        assert "\n" not in str(e.value)


def test_an_image_the_cache_lacks_is_a_counted_skip(tmp_path):
    """A latent cache is read where the rows are built, also when the trainer encodes on its device: an image the
    cache lacks (the data changed since the tool ran) is skipped and counted there, and the run goes on."""
    mixture = mixed_sources(tmp_path)
    cache([*TOOL, "--data.mixture", json.dumps(mixture), "--data.image_max_pixels", "256",
           "--out", str(tmp_path / "cache")])
    png(tmp_path, "new.png", 8, 8, 5)  # an editing record whose target came after the cache
    with open(tmp_path / "edit.jsonl", "a") as f:
        f.write(json.dumps({"source": "s.png", "instruction": "edit new", "target": "new.png"}) + "\n")
    cfg = pixel_cfg(3, 2)
    d = data(mixture=mixture, seq_len=96, image_max_pixels=256, encoders=str(tmp_path / "cache"))
    assert isinstance(BagelDocs(cfg, d, TOK, 0, defer=True).codec, CachedCodec)
    ld = loader(d, cfg, n_micro=2, encode_device="cpu")
    assert len(take(ld, 6)) == 6
    assert skips(ld).get("skipped/processing_error", 0) > 0, skips(ld)


# ---- the latent cache (python -m titan_mm.tools.cache; data.encoders names it) ----

TOOL = ["--config", "debug_bagel_digits", "--model.overrides",
        json.dumps({"llm_config": {"vocab_size": 151680}, "vae_config": {"z_channels": 3, "downsample": 2}})]


def test_latent_cache_of_the_tool_gives_the_codec_batches(tmp_path, capsys):
    """The tool's cache of a mixed source's images (the pixel codec's latents, pixel_cfg(3, 2) as the config's
    model): named by data.encoders, both paths give the codec's batches bit for bit."""
    mixture = mixed_sources(tmp_path)
    idx = cache([*TOOL, "--data.mixture", json.dumps(mixture), "--data.image_max_pixels", "256",
                 "--out", str(tmp_path / "cache"), "--rows-per-shard", "3"])
    assert idx["images"] > 3 and len(idx["shards"]) > 1 and "latents in" in capsys.readouterr().out
    cfg, d = pixel_cfg(3, 2), data(mixture=mixture, seq_len=96, image_max_pixels=256, prompt_dropout=0.3)
    want = take(loader(d, cfg, n_micro=2), 8)
    cached = dataclasses.replace(d, encoders=str(tmp_path / "cache"))
    assert isinstance(BagelDocs(cfg, cached, TOK, 0).codec, CachedCodec)
    assert_batches_equal(take(loader(cached, cfg, n_micro=2), 8), want)
    assert_batches_equal(take(loader(cached, cfg, n_micro=2, encode_device="cpu"), 8), want)


def test_vae_latent_cache_equals_the_vae(tmp_path):
    """A tiny random FLUX-architecture VAE's cache (one image a call): the batches the VAE gives, bit for bit."""
    cfg, d = vae_rows(tmp_path, [(8, 16), (16, 8), (16, 16), (8, 8)], edit=(0, 1))
    idx = write_latent_cache(cfg, d, TOK, 0, str(tmp_path / "cache"), max_pixels=1)
    assert idx["images"] == 4 and idx["skipped"] == {}
    want = take(loader(d, cfg), 4)
    assert_batches_equal(take(loader(dataclasses.replace(d, encoders=str(tmp_path / "cache")), cfg,
                                     encode_device="cpu"), 4), want)
    (tmp_path / "same").mkdir()  # images of one size: encoded together, each latent its own tensor in the shard
    cfg, d = vae_rows(tmp_path / "same", [(16, 16)] * 4, edit=(0, 1))
    assert write_latent_cache(cfg, d, TOK, 0, str(tmp_path / "same" / "cache"))["images"] == 4
    want = take(loader(d, cfg), 4)
    got = take(loader(dataclasses.replace(d, encoders=str(tmp_path / "same" / "cache")), cfg), 4)
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a if k not in ("latents", "cond_latents"))
        for k in ("latents", "cond_latents"):  # one call of 4 images against 4 of one: ~1e-6 per layer, ~10 layers
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-5)


def test_bad_latent_cache_is_one_line(tmp_path, capsys):
    """Through the launcher (exit 2, before the build): a cache of another latent shape, of another format; an
    image the cache lacks is one ValueError line; the tool refuses a folder that holds files."""
    mixture = mixed_sources(tmp_path)
    cache([*TOOL, "--data.mixture", json.dumps(mixture), "--data.image_max_pixels", "256",
           "--out", str(tmp_path / "rgb")])
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "latents.json").write_text(json.dumps({"format": "titan_mm.bagel_latents/0"}))
    for enc, msg in ((tmp_path / "rgb", "holds latents of 3 channels at 2x; the model's vae_config wants 1 at 2x"),
                     (tmp_path / "old", "latents.json is format 'titan_mm.bagel_latents/0'")):
        assert main([*RUN, "--job.dump_folder", str(tmp_path / "runs"), "--data.encoders", str(enc)]) == 2
        assert msg in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "runs").exists()
    codec = CachedCodec(str(tmp_path / "rgb"), pixel_cfg(3, 2))
    with pytest.raises(ValueError, match="an image of 4x8 px is not in the latent cache") as e:
        codec.encode(torch.zeros(1, 3, 4, 8))
    assert "\n" not in str(e.value)
    with pytest.raises(SystemExit) as ex:
        cache([*TOOL, "--out", str(tmp_path / "rgb")])
    assert ex.value.code == 2 and "holds files already" in capsys.readouterr().err
