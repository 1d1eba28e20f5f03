"""Export a DCP checkpoint to a complete HF model folder that transformers loads.

    python -m titan_mm.export --checkpoint outputs/debug_qwen3 --out /tmp/debug_qwen3_hf [--dtype bfloat16]

``--checkpoint`` is a step folder (``.../checkpoints/step-00000100``), a checkpoints folder or a run folder
(its newest committed checkpoint whose files pass their checksums is taken; an explicit step
folder that fails them is an error). The model architecture comes from the config.toml saved inside
the checkpoint; only the model weights are read (no optimizer state), in one process, whatever the number
of processes that wrote the checkpoint.

Besides the safetensors and config.json (``spec.save_hf``), the folder gets what the run trained with
(:func:`hf_folder_files`): the tokenizer files and a tokenizer_config.json / chat_template.jinja holding the chat
template the processors rendered, generation_config.json (the run's stop and pad ids), and for a model that
takes images the image / video processor configs of titan_mm's vision processor. So
``AutoTokenizer.from_pretrained(out)``, ``pipeline("text-generation", out)`` and, for vision models,
``AutoProcessor.from_pretrained(out)`` work offline. A family without tokens writes its weights and config only
(Wan: a diffusers transformer folder that ``WanTransformer3DModel.from_pretrained(out)`` reads).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from PIL import Image

from titan_mm.checkpoint_io import CheckpointError, resolve_checkpoint
from titan_mm.config import ConfigError, JobConfig
from titan_mm.data.chat_templates import chat_template_jinja
from titan_mm.data.processors import ProcessorConfig
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.dtypes import DTYPES, torch_dtype
from titan_mm.loader import checkpoint_config, load_model, model_from_config, tokenizer_path
from titan_mm.objectives.diffusion import write_hf_note

# copied from the tokenizer's folder when there (tokenizer.json always; tokenizer_config.json is rewritten)
TOKENIZER_FILES = ("vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")


def hf_folder_files(cfg: JobConfig) -> dict[str, str | Path]:
    """The files of an HF folder besides the weights and config.json, for the run of ``cfg``: name -> text to
    write, or the Path of a file to copy. The tokenizer is the one the run trained with (data.tokenizer_path,
    else the model's HF folder when it holds one, else the built-in Qwen3 tokenizer); the chat template is the
    one its processors rendered (data.chat_template, else the family's); the vision sizes come from the
    family's DataNeeds and the resize bounds from [data]."""
    spec, model_cfg = model_from_config(cfg, torch.device("cpu"))
    if not spec.schema().tokens:  # a family without tokens (Wan: a diffusers transformer folder) has no tokenizer
        return {}
    needs = spec.data_needs(model_cfg)
    try:
        tok = load_tokenizer(tokenizer_path(cfg))
    except (OSError, ValueError) as e:
        raise ConfigError(f"the run's tokenizer cannot be loaded for the export: {e}") from None
    template = chat_template_jinja(ProcessorConfig(cfg.data, needs).chat_template)

    src = Path(tok.path).parent
    files: dict[str, str | Path] = {"tokenizer.json": Path(tok.path)}
    files.update({n: src / n for n in TOKENIZER_FILES if (src / n).is_file()})
    conf = dict(tok.config, chat_template=template)
    # the ids the processors used where the folder's own config names none (titan_mm.data.tokenizer)
    for key, i in (("eos_token", tok.eos_id), ("pad_token", tok.pad_id)):
        if conf.get(key) is None and i is not None:
            conf[key] = tok.id_to_token(i)
    files["tokenizer_config.json"] = json.dumps(conf, indent=2, ensure_ascii=False)
    files["chat_template.jinja"] = template  # transformers 5 reads it first, for the tokenizer and the processor
    # chat docs end in <|im_end|> (eos_id), text docs in <|endoftext|>: generation stops on either. No sampling
    # settings: training does not choose them.
    gen = {"eos_token_id": list(dict.fromkeys(i for i in (tok.eos_id, tok.endoftext_id) if i is not None))}
    if tok.pad_id is not None:
        gen["pad_token_id"] = tok.pad_id
    if isinstance(conf.get("bos_token"), str):
        gen["bos_token_id"] = tok.token_to_id(conf["bos_token"])
    files["generation_config.json"] = json.dumps(gen, indent=2)
    if needs.patch_size:  # titan_mm.data.vision: RGB, PIL bicubic resize, x / 255, (x - mean) / std of the layout

        d = cfg.data
        mean, std = needs.vision_layout.mean, needs.vision_layout.std
        common = dict(patch_size=needs.patch_size, temporal_patch_size=needs.temporal_patch_size,
                      merge_size=needs.merge_size, image_mean=list(mean), image_std=list(std),
                      do_resize=True, resample=int(Image.Resampling.BICUBIC), do_rescale=True,
                      rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True)
        image = dict(common, size={"shortest_edge": d.image_min_pixels, "longest_edge": d.image_max_pixels})
        # vision.process_video: fps sampling within [min, max] frames, no per-frame pixel cap
        video = dict(common, size={"shortest_edge": d.video_min_pixels, "longest_edge": d.video_max_pixels},
                     do_sample_frames=True, fps=d.video_fps, min_frames=d.video_min_frames,
                     max_frames=d.video_max_frames, cap_pixels_per_frame=False)
        files["preprocessor_config.json"] = json.dumps(image, indent=2)
        files["video_preprocessor_config.json"] = json.dumps(video, indent=2)
    return files


def export(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the HF folder ``out`` of ``checkpoint``: weights + config.json, then :func:`hf_folder_files`."""
    first = resolve_checkpoint(checkpoint)
    files = hf_folder_files(checkpoint_config(first))  # a bad tokenizer fails before the weights are read
    got = load_model(checkpoint)
    ck = got.path
    if ck != first:  # a corrupt newest checkpoint was skipped: the files of the one loaded
        files = hf_folder_files(checkpoint_config(ck))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kw = {"dtype": torch_dtype(dtype)} if dtype else {}
    got.spec.save_hf(got.model, got.model_cfg, str(out), **kw)
    mode = (out / "config.json").stat().st_mode & 0o777  # safetensors writes 0600; the weights get the others' mode
    for f in out.glob("*.safetensors"):
        f.chmod(mode)

    write_hf_note(out, got.job, got.spec, got.model_cfg)  # diffusion LMs: "titan_mm_objective" in config.json
    for name, body in files.items():
        if isinstance(body, Path):
            shutil.copyfile(body, out / name)
        else:
            (out / name).write_text(body)
    print(f"[titan_mm] exported {ck} -> {out} ({', '.join(['weights', 'config.json', *sorted(files)])})")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_mm.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="step folder, checkpoints folder or run folder")
    ap.add_argument("--out", required=True, help="output HF folder (created)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="dtype of the saved tensors (default: as trained, float32)")
    a = ap.parse_args(argv)
    try:
        export(a.checkpoint, a.out, a.dtype)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
