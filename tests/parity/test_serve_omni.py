"""The serving engine's greedy outputs with audio in the prompt are token-identical to transformers' thinker
``generate`` (fp32, CPU, tiny random Qwen2.5-Omni and Qwen3-Omni-MoE thinkers saved as HF folders): 5 prompts run
together, with one or two generated clips (a 300 ms sine, 200 ms of noise), an image beside a clip, text only, and
two prompts of the same tokens whose clips differ (the prefix cache must not mix them up); once with whole prefills
and once with chunks of 16 tokens (a chunk never cuts a clip). The clips go to the engine as waveforms and are
processed there as in training (titan_mm.data.audio); HF gets the same log-mel features, one prompt at a time.

Run: pytest -q tests/parity/test_serve_omni.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.qwen3_omni_moe")

from tests.parity import test_qwen2_5_omni_parity as q25  # noqa: E402
from tests.parity import test_qwen3_omni_moe_parity as q3  # noqa: E402
from tests.parity._qwen3_helpers import titan_from_hf  # noqa: E402
from tests.parity.test_qwen3_vl_parity import randomize_  # noqa: E402
from titan_mm.config import Data  # noqa: E402
from titan_mm.data import audio, vision  # noqa: E402
from titan_mm.data.processors import ProcessorConfig  # noqa: E402
from titan_mm.serve.config import ServeConfig  # noqa: E402
from titan_mm.serve.engine import Engine  # noqa: E402
from titan_mm.serve.sampling_params import SamplingParams  # noqa: E402

MAX_NEW = 6
RATE = 16000
DATA = Data(image_min_pixels=64, image_max_pixels=32 * 32)  # tiny images: 4-pixel patches, 2x2 merge
CASES = {"whole": dict(block_size=4, num_blocks=256),
         "chunked": dict(block_size=4, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=2)}


def sine(ms: int, hz: float = 440.0) -> np.ndarray:
    t = np.arange(ms * RATE // 1000) / RATE
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def noise(ms: int, seed: int = 0) -> np.ndarray:
    return (0.1 * np.random.default_rng(seed).standard_normal(ms * RATE // 1000)).astype(np.float32)


def _image(h: int, w: int, seed: int):
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8))


def hf_thinker(family: str, folder):
    """The family's tiny HF thinker (the parity tests' config with Whisper's 128 mel bins, what the processor
    makes), randomized, saved to ``folder``; -> (model, its token ids)."""
    torch.manual_seed(0)
    if family == "qwen2_5_omni":
        c = q25.hf_config()
        c.audio_config.num_mel_bins = 128
        m = transformers.Qwen2_5OmniThinkerForConditionalGeneration._from_config(c, attn_implementation="sdpa")
        randomize_(m.float())
        tok = dict(aud=q25.AUD, a_start=q25.A_START, a_end=q25.A_END, img=q25.IMG, vs=q25.V_START, ve=q25.V_END)
    else:
        c = q3.hf_config()
        c.audio_config.num_mel_bins = 128
        m = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(c)
        with torch.no_grad():  # as the parity test: LayerNorms / biases off their 1 / 0
            for p in m.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p) * 0.1)
        tok = dict(aud=q3.AUD, a_start=q3.AS, a_end=q3.AE, img=q3.IMG, vs=q3.VS, ve=q3.VE)
    m = m.eval()
    m.save_pretrained(folder)
    return m, tok


def titan_model(folder):
    tm, spec, cfg = titan_from_hf(folder, vision_attn_backend="sdpa")
    return tm.eval(), spec, cfg


def prompts(tok: dict):
    """(prompt ids with one pad per clip / image, their clips, their images)."""
    g = torch.Generator().manual_seed(1)

    def text(n):
        return torch.randint(0, 150, (n,), generator=g).tolist()

    clip = [tok["a_start"], tok["aud"], tok["a_end"]]
    head = text(5)
    out = [
        (head + clip + text(3), [sine(300)], []),
        (text(3) + clip + text(2) + clip + text(4), [sine(300, 660.0), noise(1300, 1)], []),  # 2 chunks at 1 s
        ([tok["vs"], tok["img"], tok["ve"]] + text(2) + clip + text(3), [noise(200, 2)], [_image(16, 24, 0)]),
        (text(6), [], []),
    ]
    out.append((out[0][0], [noise(300, 3)], []))  # the same tokens as the first, another clip
    return out


def hf_generate(hf, tok: dict, pcfg: ProcessorConfig, ids: list[int], clips: list, images: list) -> list[int]:
    """HF's greedy tokens for one prompt, its clips and images processed by titan_mm's processors (as training)."""
    a_items = [audio.process_audio(c, pcfg) for c in clips]
    i_items = [vision.process_image(im, pcfg) for im in images]
    expanded, ia, ii = [], iter(a_items), iter(i_items)
    for t in ids:
        expanded += [t] * (next(ia).n_tokens if t == tok["aud"] else next(ii).n_tokens if t == tok["img"] else 1)
    x = torch.tensor([expanded])
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x))
    if a_items:
        feats = [torch.from_numpy(it.tensors["input_features"]).T for it in a_items]  # [128, frames]
        n = max(f.shape[1] for f in feats)
        kw["input_features"] = torch.stack([F.pad(f, (0, n - f.shape[1])) for f in feats])
        kw["feature_attention_mask"] = torch.stack([torch.arange(n) < f.shape[1] for f in feats]).long()
    if i_items:
        kw["pixel_values"] = torch.cat([torch.from_numpy(it.tensors["pixel_values"]) for it in i_items])
        kw["image_grid_thw"] = torch.cat([torch.from_numpy(it.tensors["image_grid_thw"]) for it in i_items])
    with torch.no_grad():
        out = hf.generate(**kw, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, x.shape[1]:].tolist()


_REF: dict = {}


def reference(family: str, tmp_path_factory):
    if family not in _REF:
        folder = tmp_path_factory.mktemp(family)
        hf, tok = hf_thinker(family, folder)
        tm, spec, cfg = titan_model(folder)
        pcfg = ProcessorConfig(DATA, spec.data_needs(cfg))
        ps = prompts(tok)
        refs = [hf_generate(hf, tok, pcfg, *p) for p in ps]
        _REF[family] = tm, spec, cfg, ps, refs
    return _REF[family]


@pytest.mark.slow  # two tiny thinkers and 10 HF generates: ~30 s on 2 cores
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family", ["qwen2_5_omni", "qwen3_omni_moe"])
def test_audio_prompts_match_transformers_generate(family, case, tmp_path_factory):
    tm, spec, cfg, ps, refs = reference(family, tmp_path_factory)
    if family == "qwen2_5_omni":  # its answer depends on the clip: a prefix-cache mix-up of the two would show
        assert refs[0] != refs[4]
    engine = Engine(tm, spec, cfg, ServeConfig(max_model_len=256, **CASES[case]), data=DATA)
    outs = engine.generate([p[0] for p in ps], SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True),
                           images=[p[2] for p in ps], audios=[p[1] for p in ps])
    got = [o.outputs[0].token_ids for o in outs]
    bad = [i for i in range(len(ps)) if got[i] != refs[i]]
    assert not bad, f"prompts {bad} differ from HF generate: got {[got[i] for i in bad]}, HF {[refs[i] for i in bad]}"
    assert engine.stats()["kv_blocks_used"] == 0
