"""Special tokens by role under Qwen3 or Qwen2.5-Omni names, the built-in Qwen2.5-Omni tokenizer (Qwen3's BPE with
the special-token names the family declares, ModelSpec.tokenizer), placeholders written by the tokenizer's own names,
and the dtmf eval tasks."""

import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from titan_mm.data.builtin.dtmf import dtmf_record
from titan_mm.data.packing import IGNORE_INDEX
from titan_mm.data.processors import Processor, ProcessorConfig, check_special_tokens
from titan_mm.data.schema import parse_record
from titan_mm.data.tokenizer import Tokenizer, load_tokenizer, renamed_tokenizer_dir, tokenizer_dir
from titan_mm.models.qwen2_5_omni.config import FLAVORS
from titan_mm.registry import TokenizerNames, get_model_spec

OMNI = "builtin:qwen2_5_omni"
SRC = "The keypad tones 4*07 and #, then <think> and digits 12345."


@pytest.fixture(scope="module")
def needs():
    return get_model_spec("qwen2_5_omni").data_needs(FLAVORS["debug"])


@pytest.fixture(scope="module")
def omni():
    return load_tokenizer(OMNI)


def test_builtin_omni_has_qwen2_5_omni_tokens_at_their_ids(omni):
    assert omni.names == {"vision_start": "<|vision_bos|>", "vision_end": "<|vision_eos|>", "image_pad": "<|IMAGE|>",
                          "video_pad": "<|VIDEO|>", "audio_start": "<|audio_bos|>", "audio_end": "<|audio_eos|>",
                          "audio_pad": "<|AUDIO|>"}
    for i, name in get_model_spec("qwen2_5_omni").tokenizer.renames.items():
        assert omni.token_to_id(name) == i and omni.id_to_token(i) == name
    assert (omni.audio_pad_id, omni.audio_start_id, omni.audio_end_id) == (151646, 151647, 151648)
    assert (omni.image_pad_id, omni.video_pad_id, omni.vision_start_id, omni.vision_end_id) == (
        151655, 151656, 151652, 151653)
    qwen3 = load_tokenizer()
    assert omni.encode(SRC) == qwen3.encode(SRC)  # the same BPE; only special-token names differ
    assert (omni.eos_id, omni.pad_id, omni.max_id, len(omni)) == (qwen3.eos_id, qwen3.pad_id, qwen3.max_id, len(qwen3))
    assert qwen3.names["audio_pad"] is None and qwen3.audio_pad_id is None
    cfg = json.loads((Path(omni.path).parent / "tokenizer_config.json").read_text())
    assert cfg["added_tokens_decoder"]["151646"]["content"] == "<|AUDIO|>"
    assert "<|IMAGE|>" in cfg["additional_special_tokens"] and "<|image_pad|>" not in cfg["additional_special_tokens"]
    assert pickle.loads(pickle.dumps(omni)).names == omni.names


def test_builtin_folder_is_written_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = Tokenizer(OMNI)
    folder = Path(a.path).parent
    assert folder.parent == tmp_path / "titan_mm" / "tokenizers"
    assert sorted(p.name for p in folder.iterdir()) == ["merges.txt", "tokenizer.json", "tokenizer_config.json",
                                                        "vocab.json"]
    stamp = (folder / "tokenizer.json").stat().st_mtime_ns
    assert tokenizer_dir(OMNI) == str(folder) and (folder / "tokenizer.json").stat().st_mtime_ns == stamp
    # other renames are another folder: a changed declaration never reads a stale one
    other = renamed_tokenizer_dir("qwen2_5_omni", TokenizerNames("qwen3", {151646: "<|AUDIO|>"}))
    assert Path(other).parent == folder.parent and other != str(folder)


def test_a_bad_declaration_is_one_line():
    for names, msg in ((TokenizerNames("nope", {}), r"renames the vocabulary 'nope'.*built-in ones \(qwen3\)"),
                       (TokenizerNames("qwen3", {5: "<|x|>"}), r"renames ids \[5\], which are no added tokens")):
        with pytest.raises(ValueError, match=msg) as e:
            renamed_tokenizer_dir("fam", names)
        assert "\n" not in str(e.value)


def test_unknown_builtin_is_one_line():
    with pytest.raises(ValueError, match=r"builtin:nope.*builtin:qwen3, builtin:qwen2_5_omni") as e:
        Tokenizer("builtin:nope")
    assert "\n" not in str(e.value)


def test_debug_flavor_ids_match_the_builtin_and_the_hint_names_it(omni, needs):
    check_special_tokens(omni, needs)
    with pytest.raises(ValueError, match=r"audio_pad the id None, the model expects 151646.*builtin:qwen2_5_omni"):
        check_special_tokens(load_tokenizer(), needs)


def test_placeholders_use_the_tokenizers_names(omni, needs):
    proc = Processor(omni, ProcessorConfig(needs=needs))
    rec = dtmf_record(5, "dtmf_digits")
    text, _, media = proc.render(parse_record(rec))
    assert "<|vision_bos|><|IMAGE|><|vision_eos|><|audio_bos|><|AUDIO|><|audio_eos|>" in text
    assert [m.type for m in media] == ["image", "audio"]
    doc = proc(parse_record(rec))
    ids = doc.input_ids.tolist()
    n_audio, a0 = ids.count(151646), ids.index(151646)
    frames = int(doc.media["audio_feature_lengths"][0][0])
    assert n_audio == ((frames - 1) // 2 + 1 - 2) // 2 + 1 and ids[a0 - 1] == 151647  # conv stride 2, pool 2
    assert ids[a0 + n_audio] == 151648 and ids.count(151655) == int(np.prod(doc.media["image_grid_thw"][0])) // 4
    answer = omni.decode(doc.input_ids[1:][doc.labels[:-1] != IGNORE_INDEX])
    assert answer == rec["answer"] + "<|im_end|>"
    # the generation prompt is the training doc up to the first answer token
    prompt = proc.prompt_doc(parse_record({"messages": rec["messages"][:-1]}))
    first = int(np.nonzero(doc.labels != IGNORE_INDEX)[0][0])
    np.testing.assert_array_equal(prompt.input_ids, doc.input_ids[:first + 1])
    np.testing.assert_array_equal(prompt.positions, doc.positions[:, :first + 1])


def test_dtmf_tasks():  # decoded by the serving engine: tests/unit/test_eval_omni.py
    from titan_mm.eval.tasks import load_task

    t = load_task("dtmf", limit=3)
    assert (t.name, t.metric_name, len(t.items)) == ("dtmf", "accuracy", 3)
    assert t.items[0]["reference"] == dtmf_record(0)["keys"]
    assert t.items[0]["messages"][-1]["role"] == "user"
    m = load_task("dtmf_digits", limit=2)
    assert m.items[1]["reference"].startswith("key ")
    assert load_task("dtmf_seq", limit=1).items[0]["reference"] == dtmf_record(0, "dtmf_seq")["keys"]
