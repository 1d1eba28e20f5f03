"""Wan's data (titan_mm/data/clips.py, titan_mm/models/wan/data.py, python -m titan_mm.tools.cache): captioned clips
in lmms-engine's format (mp4, gif and frame folders written here), tiny random UMT5 / AutoencoderKLWan built here,
the latent cache and the in-pipeline path giving the same batches, buckets, prompt dropout, dp sharding, exact
resume, malformed rows counted, and the debug config training from a cache. Nothing downloads."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

diffusers = pytest.importorskip("diffusers")  # the optional extra [diffusers]
pytest.importorskip("transformers")

from tests.resume_check import RESUME_ARGS, assert_resumes_exactly  # noqa: E402
from titan_mm.config import ConfigError, Data, load_config  # noqa: E402
from titan_mm.data.clips import CacheSource, ClipLoader, RawSource, geometry  # noqa: E402
from titan_mm.launch.train import main as train  # noqa: E402
from titan_mm.models.wan.data import TEXT_LEN, load_encoders  # noqa: E402
from titan_mm.models.wan.toy import moving_square, save_random_encoders, write_mp4  # noqa: E402
from titan_mm.observe.metrics import read_metrics  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402
from titan_mm.tools.cache import main as cache  # noqa: E402
from titan_mm.train.preflight import preflight  # noqa: E402

CAPTIONS = ["a red ball rolls left", "a green cube falls down", "a red cube rolls right fast",
            "a green ball falls slow", "a ball rolls up", "a cube falls", "a red ball", "a green cube rolls left"]
DATA = ["--config", "debug_wan_data", "--data.video_fps", "0", "--data.video_min_frames", "1",
        "--data.video_max_frames", "9", "--data.video_max_pixels", "20000"]
WAN = get_model_spec("wan")
CLIPS = WAN.data_needs(WAN.flavor("debug")).clips


def _row(video, caption):
    return {"messages": [{"role": "user", "content": [{"type": "video", "video": video},
                                                      {"type": "text", "text": caption}]}]}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """(rows.jsonl, the encoders' pipeline folder, the cache folder the tool wrote from them, the tool's index)."""
    root = tmp_path_factory.mktemp("wan_data")
    pipe = root / "pipe"
    save_random_encoders(str(pipe), text_dim=16, z_dim=4)  # the debug flavor's text_dim and in_channels
    rng = np.random.default_rng(0)
    rows = []
    for i, cap in enumerate(CAPTIONS):
        kind = i % 3
        if kind == 0:  # mp4, two sizes: two buckets
            h, w = (16, 24) if i % 2 == 0 else (24, 16)
            write_mp4(root / f"v{i}.mp4", moving_square(rng, 9, h, w))
            rows.append(_row(f"v{i}.mp4", cap))
        elif kind == 1:  # an animated gif
            fr = [Image.fromarray(f) for f in moving_square(rng, 5, 16, 24)]
            fr[0].save(root / f"g{i}.gif", save_all=True, append_images=fr[1:], duration=125)
            rows.append(_row(f"g{i}.gif", cap))
        else:  # a folder of frames
            (root / f"f{i}").mkdir()
            for t, f in enumerate(moving_square(rng, 7, 16, 24)):
                Image.fromarray(f).save(root / f"f{i}" / f"{t:03d}.png")
            rows.append(_row(f"f{i}", cap))
    (root / "bad.mp4").write_bytes(b"not a video at all")
    lines = [json.dumps(r) for r in rows] + [
        "{not json", json.dumps({"messages": [{"role": "user", "content": "no video here"}]}),
        json.dumps(_row("missing.mp4", "a ball")), json.dumps(_row("bad.mp4", "a cube"))]
    (root / "rows.jsonl").write_text("\n".join(lines) + "\n")
    idx = cache([*DATA, "--data.dataset", str(root / "rows.jsonl"), "--data.encoders", str(pipe),
                 "--out", str(root / "cache"), "--rows-per-shard", "3"])
    return root / "rows.jsonl", pipe, root / "cache", idx


def _data(path, pipe=None, **kw) -> Data:
    cfg = load_config([*DATA, "--data.dataset", str(path), *(["--data.encoders", str(pipe)] if pipe else [])])
    for k, v in kw.items():
        setattr(cfg.data, k, v)
    return cfg.data


def _batches(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def test_cache_tool_writes_the_usable_rows_and_counts_the_malformed(clips):
    _, _, folder, idx = clips
    assert idx["skipped"] == {"malformed_json": 1, "no_video": 1, "missing_media": 1, "bad_video": 1}
    assert [len(s["rows"]) for s in idx["shards"]] == [3, 3, 2]
    src = CacheSource(str(folder))
    buckets = {r.bucket for r in src.rows}
    # 9 mp4 / 5 gif / 7 png frames: 1 + k x 2 each; 16 x 24 (or 24 x 16) is within 20000 / frames pixels
    assert buckets == {(9, 16, 24), (9, 24, 16), (5, 16, 24), (7, 16, 24)}, buckets
    lat, text = src.load(src.rows[0])
    n, h, w = src.rows[0].bucket
    assert lat.shape == (4, (n - 1) // 2 + 1, h // 2, w // 2) and text.shape == (len(CAPTIONS[0].split()) + 1, 16)


def test_geometry_follows_the_data_bounds(clips):
    enc = load_encoders(WAN.flavor("debug"), str(clips[1]))
    d = Data(video_fps=4.0, video_min_frames=1, video_max_frames=8, video_max_pixels=10 * 32 * 48)
    idx, h, w = geometry(40, 16.0, 64, 96, d, enc)  # 16 fps -> every 4th frame, at most 8 -> 7 (1 + 3 x 2)
    assert idx.tolist() == [0, 4, 8, 12, 16, 20, 24] and (h, w) == (36, 56) and h % 4 == 0 and w % 4 == 0
    assert geometry(3, 8.0, 8, 8, d, enc)[1:] == (8, 8)  # never upscaled
    with pytest.raises(Exception, match="too_short"):
        geometry(1, 8.0, 8, 8, Data(video_min_frames=4), enc)


def test_cache_and_in_pipeline_encoding_give_the_same_batches(clips):
    """The same sample, cached by the tool or encoded in the pipeline: the same batch, bit for bit (one encoding
    code path, the VAE's posterior mode), in the same order (both list the rows the same way)."""
    rows, pipe, folder, _ = clips
    raw = RawSource(_data(rows, pipe), load_encoders(WAN.flavor("debug"), str(pipe)))
    cached = CacheSource(str(folder))
    assert [r.sid for r in raw.rows] == [r.sid for r in cached.rows]
    assert raw.skipped == clips[3]["skipped"]
    kw = dict(micro_batch_size=2, n_micro=2, seed=3, prompt_dropout=0.25)
    a, b = ClipLoader(cached, CLIPS, **kw), ClipLoader(raw, CLIPS, **kw)
    for x, y in zip(_batches(a, 6), _batches(b, 6)):
        assert _same(x, y)
        assert x["text_states"].shape == (2, TEXT_LEN, 16) and x["latents"].shape[-1] == 4 * 1 * 2 * 2


def test_parquet_rows_with_the_video_in_a_column(clips, tmp_path):
    """lmms-engine's Parquet form: ``messages`` a JSON string, the video's bytes in the column its part names."""
    rows, pipe, folder, _ = clips
    msgs = [json.dumps([_row("clip", CAPTIONS[i])["messages"][0]]) for i in (0, 3)]
    videos = [(rows.parent / f"v{i}.mp4").read_bytes() for i in (0, 3)]
    pq.write_table(pa.table({"messages": msgs, "clip": videos}), tmp_path / "rows.parquet")
    raw = RawSource(_data(tmp_path / "rows.parquet", pipe), load_encoders(WAN.flavor("debug"), str(pipe)))
    assert [r.bucket for r in raw.rows] == [(9, 16, 24), (9, 24, 16)] and not raw.skipped
    src = CacheSource(str(folder))
    cached = {r.sid.rsplit(":", 1)[1]: r for r in src.rows}  # by rows.jsonl's line numbers
    for row, line in zip(raw.rows, ("1", "4")):  # v0.mp4 and v3.mp4 with their captions are lines 1 and 4
        assert all(torch.equal(a, b) for a, b in zip(raw.load(row), src.load(cached[line])))


def test_buckets_dp_shards_and_exact_resume(clips):
    src = CacheSource(str(clips[2]))
    kw = dict(micro_batch_size=2, seed=1)
    one = ClipLoader(src, CLIPS, n_micro=2, **kw)
    ref = _batches(one, 12)  # 6 steps x 2 micro-batches: more than one epoch (5 micro-batches)
    for b in ref:  # one bucket per micro-batch: every row's grid is the first row's
        assert torch.equal(b["grid_fhw"][0], b["grid_fhw"][1])
    # dp world 2: rank r reads slot r of each step
    for r in range(2):
        rank = _batches(ClipLoader(src, CLIPS, n_micro=1, dp_rank=r, dp_world=2, **kw), 6)
        assert all(_same(x, ref[2 * t + r]) for t, x in enumerate(rank))
    # stopped after step 2 and resumed (on another dp world): the straight run's batches
    stopped = ClipLoader(src, CLIPS, n_micro=2, **kw)
    _batches(stopped, 4)
    sd = stopped.state_dict()
    for r in range(2):
        resumed = ClipLoader(src, CLIPS, n_micro=1, dp_rank=r, dp_world=2, **kw)
        resumed.load_state_dict(sd)
        assert all(_same(x, ref[2 * (t + 2) + r]) for t, x in enumerate(_batches(resumed, 3)))


def test_prompt_dropout_zeroes_whole_rows_by_seed(clips):
    src = CacheSource(str(clips[2]))
    keep = _batches(ClipLoader(src, CLIPS, micro_batch_size=2, seed=5), 20)
    half = _batches(ClipLoader(src, CLIPS, micro_batch_size=2, seed=5, prompt_dropout=0.5), 20)
    dropped = 0
    for k, h in zip(keep, half):
        assert torch.equal(k["latents"], h["latents"])
        for r in range(2):
            zero = not h["text_states"][r].any()
            dropped += zero
            assert zero or torch.equal(h["text_states"][r], k["text_states"][r])
    assert 8 <= dropped <= 32  # 40 rows at p = 0.5 (the seed's draws: fixed, not a tolerance)
    assert all(not b["text_states"].any() for b in _batches(ClipLoader(src, CLIPS, micro_batch_size=2,
                                                                        prompt_dropout=1.0), 3))


def test_text_states_are_wan_pipelines(clips):
    """UMT5's states cut to the prompt's length, zero-padded by the loader: diffusers' WanPipeline prompt_embeds."""
    pipe = clips[1]
    enc = load_encoders(WAN.flavor("debug"), str(pipe))
    ref = diffusers.WanPipeline(tokenizer=enc.tokenizer, text_encoder=enc.text_encoder, vae=enc.vae,
                                scheduler=diffusers.FlowMatchEulerDiscreteScheduler())
    want = ref._get_t5_prompt_embeds(CAPTIONS[2], max_sequence_length=TEXT_LEN, device=torch.device("cpu"),
                                     dtype=torch.float32)[0]
    got = enc.text(CAPTIONS[2])
    assert torch.equal(want[: len(got)], got) and not want[len(got):].any()
    frames = np.random.default_rng(1).integers(0, 256, (5, 8, 12, 3), dtype=np.uint8)
    x = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1
    z = enc.vae.encode(x).latent_dist.mode()[0]
    mean, std = (torch.tensor(v).view(-1, 1, 1, 1) for v in (enc.vae.config.latents_mean, enc.vae.config.latents_std))
    assert torch.equal(enc.video(frames), (z - mean) / std)


def test_clip_data_mistakes_are_one_line(clips, tmp_path, capsys):
    rows, pipe, folder, _ = clips
    cfg = load_config([*DATA, "--data.dataset", str(rows)])
    with pytest.raises(ConfigError, match="set data.encoders"):
        preflight(cfg)
    cfg = load_config([*DATA, "--data.dataset", str(rows), "--data.encoders", str(tmp_path / "nope")])
    with pytest.raises(ConfigError, match="is not a folder"):
        preflight(cfg)
    with pytest.raises(ValueError, match="has no tokenizer/, text_encoder/, vae/"):
        load_encoders(WAN.flavor("debug"), str(tmp_path))
    for args, msg in (([*DATA, "--data.dataset", str(folder), "--out", str(tmp_path / "c")], "latent cache already"),
                      ([*DATA, "--data.dataset", str(rows), "--data.encoders", str(pipe), "--out", str(folder)],
                       "holds a latent cache already"),
                      (["--config", "debug_qwen3", "--data.encoders", str(pipe), "--out", str(tmp_path / "c")],
                       "trains on no captioned clips"),
                      ([*DATA, "--data.dataset", str(rows), "--data.encoders", str(pipe), "--out", str(tmp_path / "c"),
                        "--rows-per-shard", "0"], "--rows-per-shard must be >= 1"),
                      ([*DATA, "--data.prompt_dropout", "1.5", "--out", str(tmp_path / "c")],
                       "data.prompt_dropout must be in [0, 1]")):
        with pytest.raises(SystemExit) as e:
            cache(args)
        assert e.value.code == 2 and msg in capsys.readouterr().err


RUN = ["--config", "debug_wan_data", "--metrics.enable_tensorboard", "False", "--training.deterministic", "True",
       "--checkpoint.async_mode", "disabled"]


def _losses(run_dir):
    return {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items()}


def test_debug_wan_data_trains_from_a_cache_and_resumes_exactly(clips, tmp_path):
    """train_configs/debug_wan_data.toml from the cache the tool wrote: a run stopped at its step-4 checkpoint and
    resumed gives the straight run's losses bit for bit; the in-pipeline path gives the cached run's losses."""
    rows, pipe, folder, _ = clips

    def run(name, steps, *extra):
        return train([*RUN, "--data.dataset", str(folder), "--job.dump_folder", str(tmp_path), "--job.name", name,
                      "--training.steps", str(steps), *RESUME_ARGS, *extra])

    a = assert_resumes_exactly(run, tmp_path)
    assert run("raw", 4, "--data.dataset", str(rows), "--data.encoders", str(pipe)) == 0
    assert all(_losses(tmp_path / "raw")[s] == a[s] for s in range(1, 5))
