"""Encode captioned clips once with a family's frozen encoders and write the latent cache the trainer streams
(titan_mm.data.clips; docs/wan.md "Data"); or, for a family that builds its documents with a frozen encoder
(DocLayout.cache: BAGEL's VAE images, docs/bagel.md "Data"), write the encoder's outputs once, which data.encoders
then names in the encoder's place.

    python -m titan_mm.tools.cache --config debug_wan_data.toml --data.dataset clips.jsonl \\
        --data.encoders Wan2.1-T2V-1.3B-Diffusers --out cache/clips
    # then train with --data.dataset cache/clips (data.encoders is not read then)

The rows (lmms-engine's format: a video part and its caption), the frame rate, frame and pixel bounds are the job
config's [data] (data.video_fps, data.video_max_frames, data.video_min_frames, data.video_max_pixels), so the cache
holds exactly what the in-pipeline path encodes. Malformed rows are skipped and counted (printed, and kept in the
index). Other --section.key flags override the job config, as they do for the trainer.

    python -m titan_mm.tools.cache --config my_bagel.toml --data.encoders ae.safetensors --out cache/vae
    # then train with --data.encoders cache/vae (the same records, image sizes and model)
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from titan_mm.config import ConfigError, load_config
from titan_mm.data.clips import CacheWriter, RawSource, is_cache, uses_cache
from titan_mm.data.sources import SkipSample
from titan_mm.data.tokenizer import load_tokenizer, tokenizer_for
from titan_mm.loader import model_from_config
from titan_mm.models.hf_io import local_hf_dir
from titan_mm.registry import SpecError


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.tools.cache", description=__doc__.split("\n\n")[0],
                                 epilog="Other --section.key flags override the job config (run_train.sh --help).",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    ap.add_argument("--config", default=None, help="a TOML in train_configs/ or a path (its [model] and [data])")
    ap.add_argument("--out", required=True, help="the cache folder to write (must not hold a cache yet)")
    ap.add_argument("--rows-per-shard", type=int, default=256, help="clips (or latents) per safetensors shard")
    ap.add_argument("--device", default="cpu", help="where the encoders run (cpu, cuda)")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = _parser()
    args, rest = ap.parse_known_args(argv)
    try:
        cfg = load_config((["--config", args.config] if args.config else []) + rest)
        spec, model_cfg = model_from_config(cfg, torch.device("cpu"))
        needs = spec.data_needs(model_cfg)
        docs, clips = needs.docs, needs.clips
        if args.rows_per_shard < 1:
            raise ConfigError(f"--rows-per-shard must be >= 1, got {args.rows_per_shard}")
        if docs is not None and docs.cache is not None:
            return _docs_cache(ap, args, cfg, docs)
        if clips is None:
            raise ConfigError(f"model {cfg.model.name!r} trains on no captioned clips and caches no encoder outputs; "
                              "there is nothing to cache")
        if uses_cache(cfg.data):
            raise ConfigError(f"data.dataset {cfg.data.dataset!r} is a latent cache already; give the raw rows")
        if is_cache(args.out):
            raise ConfigError(f"--out {args.out!r} holds a latent cache already; give another folder or delete it")
        enc = clips.encoders(cfg.data.encoders, device=args.device)
        t0 = time.perf_counter()
        source = RawSource(cfg.data, enc)
    except (ConfigError, SpecError, ValueError, OSError) as e:
        ap.error(str(e))
    skipped = dict(source.skipped)
    writer = CacheWriter(args.out, args.rows_per_shard)
    for row in source.rows:
        try:
            writer.add(row, *source.load(row))
        except SkipSample as e:  # the header read but the frames did not decode
            skipped[e.reason] = skipped.get(e.reason, 0) + 1
    idx = writer.close(skipped, {"model": cfg.model.name, "encoders": os.path.abspath(cfg.data.encoders)})
    n = sum(len(s["rows"]) for s in idx["shards"])
    print(f"cache: {n} clips in {len(idx['shards'])} shards at {args.out} ({time.perf_counter() - t0:.1f} s); "
          f"skipped {sum(skipped.values())}: {skipped or 'none'}")
    return idx


def _docs_cache(ap: argparse.ArgumentParser, args, cfg, docs) -> dict:
    """The encoder outputs of a family building its own documents (DocLayout.cache), written to --out."""
    try:
        if os.path.isdir(args.out) and os.listdir(args.out):
            raise ConfigError(f"--out {args.out!r} holds files already; give a new or empty folder")
        hf_dir = local_hf_dir(cfg.model.hf_path) if cfg.model.hf_path else None
        tok = load_tokenizer(tokenizer_for(cfg.data.tokenizer_path, hf_dir))
        t0 = time.perf_counter()
        idx = docs.cache(cfg.data, tok, cfg.training.seed, args.out, device=args.device,
                         rows_per_shard=args.rows_per_shard)
    except (ConfigError, SpecError, ValueError, OSError) as e:
        ap.error(str(e))
    skipped = idx["skipped"]
    print(f"cache: {idx['images']} latents in {len(idx['shards'])} shards at {args.out} "
          f"({time.perf_counter() - t0:.1f} s); records skipped {sum(skipped.values())}: {skipped or 'none'}")
    return idx


if __name__ == "__main__":
    main()
