"""config.json values are type-checked where the family readers read them (titan_mm.models.hf_config): a value of
the wrong type is one line naming the key (from the top of the file), the value and the type wanted, on every path
that reads an HF folder: the trainer (model.hf_path -> "config error: ..." and exit 2), the one model loader that
export, serve, eval and the tools use (titan_mm.loader.load_model -> ConfigError), and the server's start-up
(exit 2 and one line, the port never opened). Before, ``rope_scaling: "yarn"`` fell back to default RoPE,
``tie_word_embeddings: "false"`` tied the head, and ``hidden_size: 64.5`` / ``rms_norm_eps: [1e-6]`` /
``num_attention_heads: null`` gave tracebacks or a server that answered 500. The folders are tiny random models
saved by transformers, with one value of config.json edited."""

import json
import re
import shutil
import subprocess
import sys

import pytest
import transformers
import uvicorn

from titan_mm.config import ConfigError
from titan_mm.loader import load_model
from titan_mm.models.hf_config import HFConfigError
from titan_mm.models.hf_io import HFCheckpointError, read_hf_config
from titan_mm.models.qwen2_5_omni.config import FLAVORS as OMNI25
from titan_mm.models.qwen2_5_omni.config import Qwen2_5OmniConfig
from titan_mm.models.qwen2_5_vl.config import FLAVORS as VL25
from titan_mm.models.qwen2_5_vl.config import Qwen2_5_VLConfig
from titan_mm.models.qwen3.config import Qwen3Config
from titan_mm.models.qwen3_5.config import MOE_FLAVORS as Q35_MOE
from titan_mm.models.qwen3_5.config import Qwen3_5Config
from titan_mm.models.qwen3_omni_moe.config import FLAVORS as OMNI3
from titan_mm.models.qwen3_omni_moe.config import Qwen3OmniMoeConfig
from titan_mm.serve.__main__ import main as serve_main
from titan_mm.launch.train import main as train_main

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)
TRAIN_CONFIG = {"qwen3": "debug_qwen3", "qwen3_moe": "debug_qwen3_moe", "qwen2": "debug_qwen2",
                "qwen3_vl": "debug_qwen3_vl"}
VL = {"qwen3_vl"}  # families whose text keys sit in text_config
TOP_KEYS = ("tie_word_embeddings", "image_token_id", "vision_config")  # keys a VL config.json keeps on top

# (key in config.json, value, the type the line must name); the first five are issue 45's
CASES = [
    ("rope_scaling", "yarn", "a dict or null"),
    ("tie_word_embeddings", "false", "a bool (true / false)"),
    ("hidden_size", 64.5, "a positive int"),
    ("rms_norm_eps", [1e-6], "a number"),
    ("num_attention_heads", None, "a positive int"),
    ("hidden_size", 64.0, "a positive int"),  # transformers refuses 64.0 too
    ("vocab_size", True, "a positive int"),
    ("num_key_value_heads", 0, "a positive int or null"),  # sizes: 0 divided by zero deep in the reader
    ("intermediate_size", 128.0, "an int"),
    ("max_position_embeddings", "512", "an int"),
    ("rope_parameters.rope_theta", "1e6", "a number"),
    ("layer_types", "full_attention", "a list of strings or null"),
    ("head_dim", [16], "a positive int or null"),
    ("eos_token_id", "2", "an int or a list of ints or null"),
]
FAMILY_CASES = {
    "qwen3_moe": [("num_experts", 4.0, "an int"), ("norm_topk_prob", "true", "a bool (true / false)")],
    "qwen2": [("use_sliding_window", "no", "a bool (true / false)")],
    "qwen3_vl": [("vision_config.depth", 1.5, "a positive int"), ("image_token_id", "7", "an int"),
                 ("rope_parameters.mrope_section", "2,3,3", "a list of ints"),
                 ("vision_config.deepstack_visual_indexes", [0.0], "a list of ints")],
}


def _table():
    for fam in TRAIN_CONFIG:
        for key, value, want in CASES + FAMILY_CASES.get(fam, []):
            yield pytest.param(fam, key, value, want, id=f"{fam}-{key}={json.dumps(value)}")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """One tiny random HF folder per family, as transformers saves it."""
    root = tmp_path_factory.mktemp("hf")
    vl_text = dict(TINY, head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                        "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=8,
                  num_position_embeddings=64, deepstack_visual_indexes=[0])
    models = {
        "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**TINY, head_dim=16)),
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **TINY, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
        "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY)),
        "qwen3_vl": lambda: transformers.Qwen3VLForConditionalGeneration(
            transformers.Qwen3VLConfig(text_config=vl_text, vision_config=vision)),
    }
    for fam, make in models.items():
        make().save_pretrained(root / fam)
    return root


def edited(folders, tmp_path, fam, key, value):
    """A copy of ``fam``'s folder with ``key`` (dotted) of config.json set to ``value`` -> (folder, full key)."""
    out = tmp_path / fam
    shutil.copytree(folders / fam, out)
    cfg = json.loads((out / "config.json").read_text())
    full = key if fam not in VL or key.startswith(TOP_KEYS) else f"text_config.{key}"
    *path, last = full.split(".")
    d = cfg
    for k in path:
        d = d[k]
    d[last] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out, full


@pytest.mark.parametrize("fam,key,value,want", _table())
def test_loader_refuses_the_value_in_one_line(folders, tmp_path, fam, key, value, want):
    """Export, serve, eval and the tools read an HF folder through titan_mm.loader.load_model."""
    d, full = edited(folders, tmp_path, fam, key, value)
    with pytest.raises(ConfigError) as e:
        load_model(d)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"{d / 'config.json'}: {full} = {json.dumps(value)}")
    assert msg.endswith(f"; it must be {want} in config.json")


BRIEF = [c[:2] for c in CASES[:5]]


@pytest.mark.parametrize("fam", list(TRAIN_CONFIG))
@pytest.mark.parametrize("key,value", BRIEF, ids=[f"{k}={json.dumps(v)}" for k, v in BRIEF])
def test_trainer_says_config_error_and_exits_2(folders, tmp_path, capsys, fam, key, value):
    d, full = edited(folders, tmp_path, fam, key, value)
    rc = train_main(["--config", TRAIN_CONFIG[fam], "--model.hf_path", str(d), "--job.dump_folder",
                     str(tmp_path / "runs"), "--data.dataset", "synthetic"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith(f"config error: {d / 'config.json'} (model.name {fam!r}): {full} = {json.dumps(value)}")
    assert not (tmp_path / "runs").exists()  # refused before anything was written


@pytest.mark.parametrize("fam", list(TRAIN_CONFIG))
@pytest.mark.parametrize("key,value", BRIEF, ids=[f"{k}={json.dumps(v)}" for k, v in BRIEF])
def test_transformers_refuses_them_too(folders, tmp_path, fam, key, value):
    """The reference names the same field (rope_scaling is its legacy spelling of rope_parameters)."""
    d, full = edited(folders, tmp_path, fam, key, value)
    with pytest.raises(Exception, match="rope_parameters" if key == "rope_scaling" else full.split(".")[-1]):
        transformers.AutoConfig.from_pretrained(d)


def test_the_types_json_allows_are_read(folders, tmp_path):
    """An int where a float goes, a list of EOS ids (the first is the model's), null where HF derives the value."""
    d, _ = edited(folders, tmp_path, "qwen3", "rms_norm_eps", 1)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(eos_token_id=[7, 9], num_key_value_heads=None, tie_word_embeddings=True)
    (d / "config.json").write_text(json.dumps(cfg))
    got = Qwen3Config.from_hf(d)
    assert (got.rms_norm_eps, got.eos_token_id, got.num_key_value_heads, got.tie_word_embeddings) == (1, 7, 4, True)
    assert isinstance(got.tie_word_embeddings, bool)


def test_a_rope_scaling_dict_wins_over_rope_parameters_as_in_transformers(folders, tmp_path):
    """A legacy rope_scaling dict beside rope_parameters is what transformers applies (it was dropped before)."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    d, _ = edited(folders, tmp_path, "qwen3", "rope_scaling", yarn)
    ref = transformers.AutoConfig.from_pretrained(d).rope_parameters
    got = Qwen3Config.from_hf(d)
    assert {**got.rope_scaling, "rope_theta": got.rope_theta} == ref


def _omni25_full():
    thinker = OMNI25["debug"].to_hf_dict()
    return {"model_type": "qwen2_5_omni", "thinker_config": thinker}


def _omni3_full():
    return {"model_type": "qwen3_omni_moe", "thinker_config": OMNI3["debug"].to_hf_dict()}


def _vl25_flat():
    d = VL25["debug"].to_hf_dict()
    return {**{k: v for k, v in d.items() if k != "text_config"}, **d["text_config"], "model_type": "qwen2_5_vl"}


# the other families' readers, on their debug flavors' config.json: (reader, config.json, key, value, type named)
DICT_CASES = [
    (Qwen2_5_VLConfig, lambda: VL25["debug"].to_hf_dict(), "text_config.rms_norm_eps", "1e-6", "a number"),
    (Qwen2_5_VLConfig, _vl25_flat, "hidden_size", 64.5, "a positive int"),  # the released flat layout: text keys on top
    (Qwen2_5_VLConfig, lambda: VL25["debug"].to_hf_dict(), "vision_config.fullatt_block_indexes", 1,
     "a list of ints"),
    (Qwen3_5Config, lambda: Q35_MOE["debug"].to_hf_dict(), "text_config.num_experts", 8.0, "an int"),
    (Qwen3_5Config, lambda: Q35_MOE["debug"].to_hf_dict(), "text_config.rope_parameters", "default",
     "a dict or null"),
    (Qwen3_5Config, lambda: Q35_MOE["debug"].to_hf_dict(), "tie_word_embeddings", 0, "a bool (true / false)"),
    (Qwen2_5OmniConfig, _omni25_full, "thinker_config.text_config.hidden_size", 128.5, "a positive int"),
    (Qwen2_5OmniConfig, _omni25_full, "thinker_config.audio_config.d_model", "64", "a positive int"),
    (Qwen2_5OmniConfig, _omni25_full, "thinker_config.vision_config.depth", -2, "a positive int"),
    (Qwen2_5OmniConfig, _omni25_full, "thinker_config.seconds_per_chunk", None, "an int"),
    (Qwen2_5OmniConfig, _omni25_full, "thinker_config", None, "a dict"),
    (Qwen3OmniMoeConfig, _omni3_full, "thinker_config.text_config.num_experts", "8", "an int"),
    (Qwen3OmniMoeConfig, lambda: OMNI3["debug"].to_hf_dict(), "text_config.rope_scaling", "yarn", "a dict or null"),
    (Qwen3OmniMoeConfig, lambda: OMNI3["debug"].to_hf_dict(), "audio_config.dropout", [0.0], "a number"),
    (Qwen3OmniMoeConfig, lambda: OMNI3["debug"].to_hf_dict(), "vision_config.hidden_size", 64.0, "a positive int"),
    (Qwen3OmniMoeConfig, lambda: OMNI3["debug"].to_hf_dict(), "audio_config.encoder_layers", 0, "a positive int"),
]


@pytest.mark.parametrize("cls,make,key,value,want", DICT_CASES,
                         ids=[f"{c[0].__name__}-{c[2]}={json.dumps(c[3])}" for c in DICT_CASES])
def test_every_family_names_the_nested_key(cls, make, key, value, want):
    d = make()
    assert cls.from_hf_dict(json.loads(json.dumps(d))) is not None  # as written, it reads
    *path, last = key.split(".")
    node = d
    for k in path:
        node = node[k]
    node[last] = value
    with pytest.raises(HFConfigError) as e:
        cls.from_hf_dict(d)
    assert str(e.value) == f"{key} = {json.dumps(value)}{'' if value is None else ' is ' + _kind(value)}; " \
                           f"it must be {want} in config.json"


def _kind(v):
    return {bool: "a bool", int: "an int", float: "a float", str: "a string", list: "a list", dict: "a dict"}[type(v)]


@pytest.mark.parametrize("body,why", [("{\"model_type\": ", "is not valid JSON"), ("[1, 2]", "holds a JSON list"),
                                      (b"\xff\xfe{}", "is not valid JSON")])
def test_an_unreadable_config_json_is_one_line(tmp_path, body, why):
    f = tmp_path / "config.json"
    f.write_bytes(body if isinstance(body, bytes) else body.encode())
    with pytest.raises(HFCheckpointError, match=why) as e:
        read_hf_config(tmp_path)
    assert "\n" not in str(e.value) and str(f) in str(e.value)
    with pytest.raises(ConfigError, match=why):
        load_model(tmp_path)


def test_broken_side_files_and_tokenizer_are_one_line_before_the_weights(folders, tmp_path):
    d, _ = edited(folders, tmp_path, "qwen3", "rms_norm_eps", 1e-6)
    (d / "model.safetensors").unlink()  # nothing may reach the weights
    (d / "generation_config.json").write_text("{\"eos_token_id\": ")
    with pytest.raises(ConfigError, match=r"generation_config.json cannot be read as JSON"):
        load_model(d)
    (d / "generation_config.json").write_text("{\"eos_token_id\": \"2\"}")
    with pytest.raises(ConfigError, match=r"eos_token_id = '2' must be an int"):
        load_model(d)
    (d / "generation_config.json").unlink()
    (d / "preprocessor_config.json").write_text("{\"size\": {\"longest_edge\": \"big\"}}")
    with pytest.raises(ConfigError, match=r"preprocessor_config.json: size.longest_edge = 'big' must be a positive"):
        load_model(d)
    (d / "preprocessor_config.json").unlink()
    (d / "tokenizer.json").write_text("{not a tokenizer")
    with pytest.raises(ConfigError, match=rf"the tokenizer of {re.escape(str(d))} cannot be loaded: .*is not a "):
        load_model(d)


def _broken(folders, tmp_path, what):
    d, _ = edited(folders, tmp_path, "qwen3", "rms_norm_eps", [1e-6] if what == "rms_norm_eps" else 1e-6)
    if what == "tokenizer":
        (d / "tokenizer.json").write_text("[]")
    if what == "config_json":
        (d / "config.json").write_text("{\"model_type\": \"qwen3\",")
    want = {"rms_norm_eps": f"error: {d / 'config.json'}: rms_norm_eps = [1e-06] is a list; it must be a number",
            "tokenizer": f"error: the tokenizer of {d} cannot be loaded: ",
            "config_json": f"error: {d / 'config.json'} is not valid JSON"}[what]
    return d, want


def test_the_server_process_exits_2_with_one_line(folders, tmp_path):
    """It used to start on rms_norm_eps = [1e-6] and answer 500 to every request. The timeout only guards against a
    server that did start."""
    d, want = _broken(folders, tmp_path, "rms_norm_eps")
    p = subprocess.run([sys.executable, "-m", "titan_mm.serve", "--model", str(d), "--device", "cpu", "--port", "0"],
                       capture_output=True, text=True, timeout=300)
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1 and err[0].startswith(want), (p.returncode, err)


@pytest.mark.parametrize("what", ["tokenizer", "config_json"])
def test_the_server_says_why_in_one_line(folders, tmp_path, capsys, monkeypatch, what):
    """A broken tokenizer or config.json gave 21-28-line tracebacks; the port must never open."""
    d, want = _broken(folders, tmp_path, what)

    def started(*a, **k):
        raise AssertionError("the server started")

    monkeypatch.setattr(uvicorn, "run", started)
    assert serve_main(["--model", str(d), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(want), err
