"""bench/towers.py's CPU smoke (``--cpu --tiny``: the families' debug flavors, one timed step, in this process): every
tower runs forward + backward, its FLOPs are its family's counter's, its profile split has GEMM and attention time,
the JSON and the table name the device; a wrong tower name is one error and exit 2; docs/efficiency.md's towers
block is what the generator renders from the committed GPU results (none yet: what to run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_mm.models.bagel import flops as bagel_flops
from titan_mm.models.bagel.model import SiglipNaViT
from titan_mm.models.qwen2_5_vl.vision import VisionTower

ROOT = Path(__file__).resolve().parents[2]
towers = pytest.importorskip("bench.towers")


def test_cpu_tiny_smoke(tmp_path, capsys):
    out = tmp_path / "towers.json"
    assert towers.main(["--cpu", "--tiny", "--warmup", "1", "--steps", "1", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    rows = {r["tower"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(towers.TOWERS)
    cpu = torch.device("cpu")
    for name, r in rows.items():
        assert "error" not in r, r
        t, cfg = towers.tower_config(name, True, cpu)
        if "images" in t:  # BAGEL's counter takes the model config and the images' patch counts
            want = t["flops"](cfg, torch.tensor([h * w for h, w in t["images"]]))
        else:
            want = t["flops"](towers.encoder_config(t, cfg), torch.tensor(t["clips"] if "clips" in t else t["grids"]))
        assert r["flops"] == want > 0  # the family's own counter, on the inputs it ran
        assert r["device"] == "cpu" and r["mfu"] is None and r["backend"] == "sdpa" and r["compile"] == "none"
        p_ms = r["profile_ms"]
        assert p_ms["gemm"] > 0 and p_ms["attention"] > 0 and p_ms["step"] > 0 and p_ms["idle"] >= 0
        assert r["tflops"] == pytest.approx(r["flops"] / r["step_time_s"] / 1e12)
    assert "| qwen3_vl_vit | CPU | qwen3_vl debug | 3 images, 148 patches |" in stdout
    assert "| qwen3_omni_moe_audio | CPU | qwen3_omni_moe debug | 3 clips, 417 mel frames |" in stdout
    assert "| bagel_vit | CPU | bagel debug | 3 images, 37 patches |" in stdout


def test_varied_sizes_on_bucketed_patch_counts(tmp_path, capsys):
    """--vary: a new input set each step (FLOPs: the family counter's mean over the sets); --bucket: the ViT on
    patch counts rounded up (the row records both and keys on them, beside the plain row)."""
    out = tmp_path / "towers.json"
    argv = ["--cpu", "--tiny", "--towers", "qwen3_vl_vit", "--warmup", "1", "--steps", "2", "--out", str(out)]
    assert towers.main(argv) == 0
    assert towers.main(argv + ["--vary", "3", "--bucket", "256"]) == 0
    plain, r = json.loads(out.read_text())["rows"]
    assert plain.get("bucket") is None and r["bucket"] == 256 and r["vary"] == 3 and "error" not in r
    t, cfg = towers.tower_config("qwen3_vl_vit", True, torch.device("cpu"))
    sets = [towers.varied(t, i, True)["grids"] for i in range(3)]
    assert len({tuple(g) for g in sets}) == 3
    assert r["flops"] == pytest.approx(sum(t["flops"](cfg.vision, torch.tensor(g)) for g in sets) / 3, rel=1e-12)
    assert "| qwen3_vl_vit (bucket 256) (vary 3) | CPU |" in capsys.readouterr().out


def test_floor_times_every_linear_and_convolution(tmp_path, capsys):
    """--floor: the GEMMs recorded in one forward are every linear's, however it is called (Qwen2.5-VL's patch
    embedding is an F.linear), the convolutions every conv of the stem (Qwen3-Omni's three Conv2d); the floor is
    their times alone plus the run's attention; the floors' table prints."""
    out = tmp_path / "towers.json"
    argv = ["--cpu", "--tiny", "--towers", "qwen2_5_vl_vit,qwen3_omni_moe_audio", "--warmup", "1", "--steps", "1",
            "--floor", "--out", str(out)]
    assert towers.main(argv) == 0
    rows = {r["tower"]: r for r in json.loads(out.read_text())["rows"]}
    vl, audio = rows["qwen2_5_vl_vit"]["floor"], rows["qwen3_omni_moe_audio"]["floor"]
    _, cfg = towers.tower_config("qwen2_5_vl_vit", True, torch.device("cpu"))
    assert vl["linears"] == 1 + 5 * cfg.vision.depth + 2 and vl["convs"] == 0  # patch, q/k/v, o, MLP, merger
    _, cfg = towers.tower_config("qwen3_omni_moe_audio", True, torch.device("cpu"))
    assert audio["linears"] == 1 + 6 * cfg.audio.encoder_layers + 2 and audio["convs"] == 3
    for name, f in (("qwen2_5_vl_vit", vl), ("qwen3_omni_moe_audio", audio)):
        assert 0 < f["gemm_flops"] < rows[name]["flops"] and f["gemm_ms"] > 0 and f["gemm_aligned_ms"] > 0
        assert f["ms"] == pytest.approx(f["gemm_ms"] + f["conv_ms"] + f["attention_ms"], abs=2e-3)
        assert rows[name]["compile"] == "none" and f["mfu"] is None  # the CPU: eager, no peak
    assert (audio["conv_ms"] > 0) and "| convolutions ms | attention ms | floor MFU |" in capsys.readouterr().out


def test_mistakes_are_one_error(capsys):
    for argv, want in ((["--towers", "qwen3_vl_vitt", "--cpu"],
                        "error: --towers: unknown ['qwen3_vl_vitt']; choose from " + str(list(towers.TOWERS))),
                       (["--towers", "qwen2_5_omni_audio", "--bucket", "64", "--cpu"],
                        "error: --bucket 64: ['qwen2_5_omni_audio'] take no bucket; give --towers "
                        "qwen3_vl_vit,qwen2_5_vl_vit with it")):
        with pytest.raises(SystemExit) as e:
            towers.main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].endswith(want)


def test_the_tower_is_the_familys():
    """The tower the bench times is the module the family's model holds, with the trainer's init."""
    t, cfg = towers.tower_config("qwen2_5_vl_vit", True, torch.device("cpu"))
    tower = towers.build_tower(t, cfg, torch.device("cpu"), torch.float32)
    assert type(tower) is VisionTower and not any(p.is_meta for p in tower.parameters())
    x, inputs, flops, what, n = towers.tower_inputs(t, cfg, torch.device("cpu"))
    merged, deepstack = tower(x, *inputs)
    assert merged.shape == (n // cfg.vision.spatial_merge_size**2, cfg.vision.out_hidden_size) and deepstack == []


def test_bagel_vit_is_the_models_tower_and_its_count():
    """BAGEL's SigLIP NaViT as the bench times it: the model's own ``vit`` module, on the patches, positions and
    per-image mask prepare_batch would build; its FLOPs are BAGEL's count of the ViT less the connector."""
    t, cfg = towers.tower_config("bagel_vit", True, torch.device("cpu"))
    tower = towers.build_tower(t, cfg, torch.device("cpu"), torch.float32)
    assert type(tower) is SiglipNaViT and not any(p.is_meta for p in tower.parameters())
    x, inputs, flops, what, n = towers.tower_inputs(t, cfg, torch.device("cpu"))
    assert tower(x, *inputs).shape == (n, cfg.vit_config.hidden_size) and what == "3 images, 37 patches"
    lens = [h * w for h, w in t["images"]]
    D, Dv = cfg.llm_config.hidden_size, cfg.vit_config.hidden_size
    assert bagel_flops.flops(cfg, [], vit_lens=lens) - flops == 6 * n * (Dv * D + D * D)


def test_efficiency_doc_towers_block_is_current():
    doc = (ROOT / "docs/efficiency.md").read_text()
    a, b = "<!-- towers:begin -->", "<!-- towers:end -->"
    block = doc[doc.index(a) + len(a): doc.index(b)]
    want = towers.render_doc(sorted((ROOT / "bench/results").glob("towers_*.json")))
    assert block == "\n" + want + "\n", "rerun: python3 bench/towers.py --doc docs/efficiency.md"
