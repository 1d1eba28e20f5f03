"""Config: TOML -> dataclasses, CLI overrides, clear errors for unknown keys / wrong types / missing files."""

import subprocess
import sys
from pathlib import Path

import pytest

from titan_mm.config import (
    CONFIG_DIR,
    ConfigError,
    JobConfig,
    all_keys,
    from_dict,
    load_config,
    load_toml,
    resolved_toml,
    save_config,
)

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_toml_then_cli_override(tmp_path):
    p = _write(tmp_path, "[training]\nsteps = 7\nmax_norm = 2\n[optimizer]\nlr = 1e-3\n")
    cfg = load_config(["--config", str(p), "--training.steps", "3", "--compile.enable", "True"])
    assert cfg.training.steps == 3 and cfg.optimizer.lr == 1e-3
    assert cfg.training.max_norm == 2.0 and isinstance(cfg.training.max_norm, float)
    assert cfg.compile.enable is True
    assert cfg.job.name == "c"  # run name defaults to the config stem


def test_unknown_toml_key_names_closest(tmp_path):
    p = _write(tmp_path, "[training]\nstpes = 7\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'training.stpes'.*training.steps"):
        load_config(["--config", str(p)])
    p = _write(tmp_path, "[trainig]\nsteps = 7\n")
    with pytest.raises(ConfigError, match=r"'trainig'.*'training'"):
        load_toml(p)


def test_unknown_cli_key_names_closest():
    with pytest.raises(ConfigError, match=r"--optimizer.lrr.*optimizer.lr"):
        load_config(["--optimizer.lrr", "1"])


def test_fsdp_prefetch_bounds():
    with pytest.raises(ConfigError, match=r"parallel.fsdp_prefetch must be >= 0"):
        load_config(["--parallel.fsdp_prefetch", "-1"])
    with pytest.raises(ConfigError, match=r"fsdp_prefetch is not supported with parallel.pp > 1"):
        load_config(["--parallel.fsdp_prefetch", "2", "--parallel.pp", "2"])
    assert load_config(["--parallel.fsdp_prefetch", "2"]).parallel.fsdp_prefetch == 2


def test_wrong_type_toml(tmp_path):
    p = _write(tmp_path, '[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=r"'training.steps' has the wrong type: got 'ten'.*expected int"):
        load_toml(p)
    with pytest.raises(ConfigError, match=r"activation_checkpoint.mode.*one of 'none', 'full', 'selective'"):
        from_dict({"activation_checkpoint": {"mode": "fulll"}})
    with pytest.raises(ConfigError, match=r"expected bool"):
        from_dict({"compile": {"enable": 1}})


def test_wrong_type_cli_is_reported(tmp_path):
    # one line naming the flag, the value and the type (not tyro's box), exit status 2
    r = subprocess.run([sys.executable, "-m", "titan_mm.config", "--training.steps", "ten"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr == "config error: --training.steps expects int, got 'ten'\n"


def test_missing_config_file():
    with pytest.raises(ConfigError, match=r"config file 'nope_qwen3.toml' not found"):
        load_config(["--config", "nope_qwen3.toml"])


def test_config_name_resolution_and_roundtrip(tmp_path):
    for name in ("debug_qwen3", "debug_qwen3.toml", str(CONFIG_DIR / "debug_qwen3.toml")):
        cfg = load_config(["--config", name])
        assert cfg.job.name == "debug_qwen3"
    assert load_config(["--config", "qwen3_1.7b"]).model.flavor == "1.7B"  # ".7b" is not a file suffix
    cfg.data.mixture = {"builtin:text": 1.0}
    save_config(cfg, tmp_path / "resolved.toml")
    again = load_toml(tmp_path / "resolved.toml")
    assert again == cfg


def test_every_shipped_config_loads():
    names = sorted(CONFIG_DIR.glob("*.toml"))
    assert {"debug_qwen3.toml", "debug_qwen3_moe.toml", "qwen3_1.7b.toml"} <= {p.name for p in names}
    for p in names:
        load_toml(p)


def test_help_lists_every_field():
    r = subprocess.run([sys.executable, "-m", "titan_mm.config", "--help"], capture_output=True, text=True,
                       cwd=ROOT, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    out = r.stdout
    assert r.returncode == 0
    missing = [k for k in all_keys() if "--" + k.replace("_", "-") not in out and "--" + k not in out]
    assert not missing, missing
    assert "Peak learning rate." in out


def test_every_field_has_a_docstring():
    import dataclasses

    from titan_mm.config import field_docs

    for sec in dataclasses.fields(JobConfig):
        cls = type(getattr(JobConfig(), sec.name))
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"[{sec.name}] fields without a docstring: {missing}"


def test_docs_reference_is_current():
    from titan_mm.config import markdown_reference

    doc = (ROOT / "docs" / "configs.md").read_text()
    # the trainer's sections (data / parallel are extended by their own rooms and may run ahead of the doc)
    for block in markdown_reference().split("### ")[1:]:
        if block.startswith(("[data]", "[parallel]")):
            continue
        assert block.strip() in doc, f"docs/configs.md is stale for {block.splitlines()[0]}: " \
                                     "paste the output of `python -m titan_mm.config --markdown`"


def test_resolved_toml_is_valid_toml():
    import tomllib

    tomllib.loads(resolved_toml(JobConfig()))


def test_kernel_ops_default_and_bad_name():
    import torch

    from titan_mm.train.setup import model_from_config

    cfg = load_config(["--model.name", "qwen3", "--model.flavor", "debug", "--kernels.mode", "triton"])
    _, mc = model_from_config(cfg, torch.device("cpu"))
    assert mc.kernels == "all"
    cfg = load_config(["--model.name", "qwen3", "--model.flavor", "debug", "--kernels.ops", "all,-rmsnorm"])
    with pytest.raises(ConfigError, match=r"kernels.ops='all,-rmsnorm'.*unknown kernel op.*rms_norm"):
        model_from_config(cfg, torch.device("cpu"))


@pytest.mark.parametrize("dtype,device,want", [("bfloat16", "cuda", "flex"), ("float16", "cuda", "flex"),
                                                ("float32", "cuda", "sdpa"), ("bfloat16", "cpu", "sdpa")])
def test_auto_attention_backend(dtype, device, want):
    # fp32's flex backward at head dim 128 has no kernel config on torch 2.11 (loader.model_from_config)
    import torch

    from titan_mm.train.setup import model_from_config

    cfg = load_config(["--model.name", "qwen3", "--model.flavor", "debug", "--training.param_dtype", dtype])
    assert model_from_config(cfg, torch.device(device))[1].attn_backend == want


# ---------------------------------------------------------------- data source on the command line
def _mixture_toml(tmp_path):
    return _write(tmp_path, '[data]\ndataset = "ignored"\n[data.mixture]\n"/d/llava_ov/*.jsonl" = 0.7\n'
                            '"/d/doc_vqa.parquet" = 0.3\n', name="mix.toml")


def test_cli_dataset_replaces_toml_mixture(tmp_path, caplog):
    p = _mixture_toml(tmp_path)
    assert load_config(["--config", str(p)]).data.mixture == {"/d/llava_ov/*.jsonl": 0.7, "/d/doc_vqa.parquet": 0.3}
    with caplog.at_level("WARNING", logger="titan_mm.config"):
        cfg = load_config(["--config", str(p), "--data.dataset", "builtin:digits"])
    assert cfg.data.dataset == "builtin:digits" and cfg.data.mixture == {}
    said = [r.getMessage() for r in caplog.records if r.name == "titan_mm.config"]
    assert len(said) == 1 and "replaces the config file's [data.mixture] (2 sources)" in said[0]
    # the saved config reads back as the one source
    save_config(cfg, tmp_path / "resolved.toml")
    again = load_config(["--config", str(tmp_path / "resolved.toml")])
    assert again.data.dataset == "builtin:digits" and again.data.mixture == {}


def test_cli_mixture_replaces_toml_mixture_whole(tmp_path):
    p = _mixture_toml(tmp_path)
    for args in (["--data.mixture", '{"a/*.jsonl": 0.7, "b.parquet": 0.3}'],
                 ['--data.mixture={"a/*.jsonl": 0.7, "b.parquet": 0.3}']):
        cfg = load_config(["--config", str(p), *args])
        assert cfg.data.mixture == {"a/*.jsonl": 0.7, "b.parquet": 0.3}
    from titan_mm.data.loader import resolve_sources

    assert resolve_sources(cfg.data.dataset, cfg.data.mixture) == [("a/*.jsonl", 0.7), ("b.parquet", 0.3)]


@pytest.mark.parametrize("args,msg", [
    (["--data.dataset", "x.jsonl", "--data.mixture", '{"a": 1}'], r"--data.dataset and --data.mixture are both given"),
    (["--data.mixture", '{"a": 0.7, "b": 0.3'], r"--data.mixture must be a JSON object.*Expecting"),
    (["--data.mixture", '["a", "b"]'], r"--data.mixture must be a JSON object"),
    (["--data.mixture", "{}"], r"names no source"),
    (["--data.mixture", '{"a": 0.7, "b": 0}'], r"data.mixture entry 'b': 0 is not a positive number"),
    (["--data.mixture", '{"a": 0.7, "b": "0.3"}'], r"data.mixture entry 'b': '0.3' is not a positive number"),
    (["--data.mixture", '{"a": -1}'], r"entry 'a': -1 is not a positive number"),
    (["--data.mixture", '{"a": NaN}'], r"entry 'a': nan is not a positive number"),
    (["--data.mixture", '{"a": true}'], r"entry 'a': True is not a positive number"),
])
def test_bad_data_source_flags_are_one_line_errors(tmp_path, args, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        load_config(["--config", str(_mixture_toml(tmp_path)), *args])
    assert "\n" not in str(e.value)


def test_bad_toml_mixture_weight_names_the_entry(tmp_path):
    p = _write(tmp_path, '[data.mixture]\n"a.jsonl" = 1\n"b.jsonl" = "half"\n')
    with pytest.raises(ConfigError, match=r"data.mixture entry 'b.jsonl': 'half' is not a positive number"):
        load_config(["--config", str(p)])


def test_help_shows_exactly_the_accepted_flags():
    """--help of a config with [data.mixture]: one --data.mixture flag taking JSON, no per-key flags, and
    every flag it shows is one the parser accepts (and every key has its flag)."""
    import re

    from titan_mm.config import _cli_key

    r = subprocess.run([sys.executable, "-m", "titan_mm.config", "--config", "qwen3_vl_moe", "--help"],
                       capture_output=True, text=True, cwd=ROOT, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "--data.mixture JSON" in r.stdout and "--data.mixture." not in r.stdout
    shown = set(re.findall(r"(?<![\w-])--[A-Za-z][^\s\[\]'\"(),]*", r.stdout)) - {"--config", "--help"}
    for flag in shown:
        _cli_key(flag)  # raises ConfigError for a flag the parser rejects
    assert {f[2:].replace("-", "_") for f in shown} == set(all_keys())


@pytest.mark.parametrize("word,want", [("false", False), ("FALSE", False), ("no", False), ("0", False),
                                       ("true", True), ("On", True), ("1", True)])
def test_booleans_take_any_common_spelling(word, want):
    cfg = load_config(["--config", "debug_qwen3", "--checkpoint.resume", word, f"--compile.enable={word}"])
    assert cfg.checkpoint.resume is want and cfg.compile.enable is want
