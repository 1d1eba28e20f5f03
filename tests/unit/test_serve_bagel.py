"""BAGEL understanding through the serving engine (issue 47 item 4), fp32 on CPU, a tiny random BAGEL: prompts in
BAGEL's own layout (``[bos text eos]`` per run of text, an image pad per image, then the answer's ``bos``) decode
through the engine's paged KV cache to the tokens the training forward gives when the whole chat is re-run per token
(titan_mm.models.bagel.digits.greedy, under the training segment mask); several requests batched, with chunked and
packed prefill and a shared prefix. An image becomes the ViT split the VLM chat's rows give it (DataNeeds.splits:
one position, bidirectional, the ViT run in the prefill), whole in one chunk; a repeated image is a prefix-cache hit.
Slow: a one-step digits run served by ``python -m titan_mm.serve`` and queried with the openai client (completions
and a chat with an image part)."""

import base64
import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from titan_mm.config import Data
from titan_mm.data.builtin.images import digits_records
from titan_mm.data.schema import parse_record
from titan_mm.data.sources import Unit
from titan_mm.data.tokenizer import load_tokenizer
from titan_mm.launch.train import main as train
from titan_mm.models.bagel import digits
from titan_mm.models.bagel.config import FLAVORS
from titan_mm.models.bagel.data import BagelDocs, _unit_range, fitted, vit_fit
from titan_mm.models.bagel.model import BagelModel
from titan_mm.models.bagel.spec import expert_routing
from titan_mm.models.bagel.synthetic import BOS, DEBUG_IMAGE_PAD, EOS, _Sample
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import BadRequest, Engine, SamplingParams

CFG = FLAVORS["debug"]
ANSWER = 10
"""The answer split's tokens with its bos and eos: up to 9 generated tokens."""
DATA = Data(image_min_pixels=16, image_max_pixels=256)
"""Image bounds that keep the test images small (4 x 4 pixel patches: 1 to 16 ViT tokens)."""
PAD = DEBUG_IMAGE_PAD


def _model() -> BagelModel:
    """Random weights large enough that the logits are far from ties (the init's 0.02 makes them nearly flat)."""
    torch.manual_seed(0)
    m = BagelModel(CFG)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in n else
                    0.15 * torch.randn(p.shape, generator=g))
    m.init_buffers()
    return m.eval()


MODEL = _model()


def _prompts(n: int, shared: int = 0) -> list[list[int]]:
    """``n`` prompts of 3 + 4i random text ids (below the vocabulary, above the specials), the first ``shared``
    equal across prompts."""
    g = torch.Generator().manual_seed(1)
    head = torch.randint(10, CFG.llm_config.vocab_size, (shared,), generator=g).tolist()
    return [head + torch.randint(10, CFG.llm_config.vocab_size, (3 + 4 * i,), generator=g).tolist()
            for i in range(n)]


def _reference(prompts: list[list[int]], model: BagelModel = MODEL, bos: int = BOS, eos: int = EOS,
               answer: int = ANSWER) -> list[list[int]]:
    """The training forward's greedy answers (up to ``answer`` - 1 tokens, an ``eos`` kept): each chat a doc ``[bos
    prompt eos] [bos answer eos]`` (the VLM chat's text splits), re-run whole per token."""
    docs = []
    for p in prompts:
        s = _Sample(model.cfg)
        s.text([bos, *p, eos], loss=False)
        s.text([bos] + [0] * (answer - 2) + [eos], loss=True)
        docs.append(s.doc())
    got = digits.greedy(model, docs, answer, eos)
    return [a[:-1] if a and a[-1] == -1 else a + [eos] for a in got]  # the engine keeps the stop token


def _engine(**cfg) -> Engine:
    return Engine(MODEL, get_model_spec("bagel"), CFG, ServeConfig(**{"block_size": 4, "num_blocks": 96, **cfg}),
                  eos_token_ids=[EOS], data=DATA)


def _image(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _chat_doc(parts: list, answer: int = ANSWER, model: BagelModel = MODEL, specials=(BOS, EOS)):
    """The training doc of a chat: each text part ``[bos ids eos]``, each image its ViT split (the rows' fit), then
    an answer split of ``answer`` tokens."""
    bos, eos = specials
    s = _Sample(model.cfg)
    for p in parts:
        if isinstance(p, np.ndarray):
            s.vit_image(_unit_range(fitted(Image.fromarray(p), vit_fit(model.cfg), DATA)))
        else:
            s.text([bos, *p, eos], loss=False)
    s.text([bos] + [0] * (answer - 2) + [eos], loss=True)
    return s.doc()


def _chat_prompt(parts: list) -> tuple[list[int], list[np.ndarray]]:
    """(the engine's prompt of ``parts``: an image pad per image, then the answer's bos; its images)."""
    ids = [t for p in parts for t in ([PAD] if isinstance(p, np.ndarray) else [BOS, *p, EOS])]
    return ids + [BOS], [p for p in parts if isinstance(p, np.ndarray)]


def _image_chats(n: int, shared: int = 0) -> list[list]:
    """``n`` chats mixing images and text: an image then a question, a question then an image, two images around a
    question, text only; images of 8 x 8, 12 x 8 and 16 x 16 pixels. ``shared``: every chat is the same image then
    a question whose first ``shared`` tokens agree (the prefix cache's case)."""
    qs = _prompts(n, shared)
    if shared:
        return [[_image(8, 8, 0), q] for q in qs]
    kinds = [lambda i, q: [_image(8, 8, i), q], lambda i, q: [q, _image(12, 8, i)],
             lambda i, q: [_image(16, 16, i), q, _image(8, 8, i + 9)], lambda i, q: [q]]
    return [kinds[i % 4](i, q) for i, q in enumerate(qs)]


def _reference_chats(chats: list[list], model: BagelModel = MODEL, answer: int = ANSWER) -> list[list[int]]:
    got = digits.greedy(model, [_chat_doc(c, answer, model) for c in chats], answer, EOS)
    return [a[:-1] if a and a[-1] == -1 else a + [EOS] for a in got]  # the engine keeps the stop token


@pytest.mark.parametrize("cfg,shared", [({}, 0), ({"max_num_batched_tokens": 8, "max_num_seqs": 4}, 0),
                                         ({"mixed_attention": False}, 0),
                                         ({"packed_prefill": False, "mixed_attention": False}, 0), ({}, 9)],
                         ids=["batched", "chunked", "packed", "padded", "prefix_cache"])
def test_engine_greedy_equals_the_training_forward(cfg, shared):
    prompts = _prompts(4, shared)
    want = _reference(prompts)
    e = _engine(**cfg)
    ids, params = [[BOS, *p, EOS, BOS] for p in prompts], SamplingParams(temperature=0.0, max_tokens=ANSWER - 1)
    # a shared prefix: the first request's blocks are registered before the others come
    outs = e.generate(ids[:1], params) + e.generate(ids[1:], params) if shared else e.generate(ids, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any(len(a) > 3 for a in want)  # real answers, not an immediate end of turn
    assert e.stats()["kv_blocks_used"] == 0
    if shared:
        assert e.stats()["prefix_cache_hit_rate"] > 0


def test_text_rows_equal_the_routed_forward():
    """The engine's rows carry no expert indices: the forward then runs every token through the understanding
    expert, which is bitwise the routed forward of the same tokens with no latent token."""
    ids = torch.tensor([_prompts(2)[1][:7]])
    T = ids.numel()
    routed = MODEL(ids, **expert_routing(torch.zeros(T, dtype=torch.long)),  # every token text: no latent one
                   noisy_latents=torch.zeros(1, T, CFG.patch_latent_dim),
                   cond_latents=torch.zeros(1, T, CFG.patch_latent_dim), timesteps=torch.zeros(1, T),
                   latent_pos=torch.zeros(1, T, dtype=torch.long)).logits
    assert torch.equal(MODEL(ids).logits, routed)


@pytest.mark.parametrize("cfg,shared,n", [({}, 0, 4), ({"max_num_batched_tokens": 8, "max_num_seqs": 4}, 0, 4),
                                           ({"mixed_attention": False}, 0, 4),
                                           ({"packed_prefill": False, "mixed_attention": False}, 0, 4),
                                           ({}, 5, 4), ({"num_blocks": 18}, 0, 8)],
                         ids=["mixed", "chunked", "packed", "padded", "prefix_cache", "preemption"])
def test_engine_greedy_with_images_equals_the_training_forward(cfg, shared, n):
    """Image + question chats: each image the ViT split training builds, on one position and bidirectional inside,
    in one chunk even under an 8-token budget (a 16 x 16 image is an 18-token split); packed and mixed steps with a
    split take the dense mask; a repeated image with the same question head is a prefix-cache hit past the split;
    a request preempted for blocks is recomputed with its images."""
    chats = _image_chats(n, shared)
    want = _reference_chats(chats)
    e = _engine(**cfg)
    prompts = [_chat_prompt(c) for c in chats]
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER - 1)
    run = (lambda ps: e.generate([p for p, _ in ps], params, images=[im for _, im in ps]))
    outs = run(prompts[:1]) + run(prompts[1:]) if shared else run(prompts)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(len(a) > 3 for a in want) >= 2  # real answers, not an immediate end of turn
    assert e.stats()["kv_blocks_used"] == 0
    if shared:  # 5 shared question tokens after the 6-token split: 3 whole blocks of 4
        assert [o.metrics.prefix_hit_tokens for o in outs] == [0, 12, 12, 12]
    assert (e.scheduler.num_preemptions > 0) == ("num_blocks" in cfg)


def test_an_image_becomes_the_split_the_vlm_chat_rows_build():
    """The engine's split of an image is the training document's (BagelDocs on a chat record of the same PNG): ids,
    one position for the whole split and the next token one further, token kinds and the ViT's inputs."""
    e = _engine()
    buf = io.BytesIO()
    Image.fromarray(_image(12, 8, 3)).save(buf, format="PNG")
    e.add_request("r", [PAD, BOS, 11, EOS, BOS], SamplingParams(max_tokens=1), images=[buf.getvalue()])
    req = e.requests["r"]
    rgb = dataclasses.replace(CFG, vae_config=dataclasses.replace(CFG.vae_config, z_channels=3))  # the pixel codec's
    rows = BagelDocs(rgb, dataclasses.replace(DATA, encoders="pixels"), e.tokenizer, 0)
    doc = rows({"messages": [{"role": "user", "content": [{"type": "image", "image": buf.getvalue()}]},
                             {"role": "assistant", "content": "7"}]}, Unit("t", "t", "jsonl"), "t:0")
    (split,) = req.images
    assert (split.start, split.end) == (0, 2 + 6)  # [vs, 2 x 3 patches of the 12 x 8 image, ve]
    assert req.prompt[:8] == doc.input_ids[:8].tolist() and req.prompt[8:] == [BOS, 11, EOS, BOS]
    assert req.positions[0].tolist() == doc.positions[0, :9].tolist() + [2, 3, 4]  # the answer's bos at 1
    assert req.rope_delta == 5 - len(req.prompt)
    assert np.array_equal(split.split.seq["token_kind"], doc.seq["token_kind"][:8])
    for k in ("vit_patches", "vit_pos", "vit_lens"):
        assert np.array_equal(split.split.flat[k], doc.media[k][0]), k


def test_chat_prompt_is_the_training_layout():
    """A chat's prompt: each run of text ``[bos text eos]`` (no roles; a user's text stripped), an image pad per image
    part, then the answer's bos, as BagelDocs lays out the VLM chat's rows."""
    tok = load_tokenizer(None)
    sample = parse_record({"messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": [{"type": "text", "text": "Look: "},
                                                                     {"type": "image", "image": b"x"},
                                                                     {"type": "text", "text": "which digit?"}]}]})
    got = get_model_spec("bagel").data_needs(CFG).splits.chat(sample, tok)
    assert got == [BOS, *tok.encode("Be brief."), EOS, BOS, *tok.encode("Look:"), EOS, PAD,
                   BOS, *tok.encode("which digit?"), EOS, BOS]


@pytest.mark.parametrize("payload,say", [(np.zeros((3, 8, 8), np.float32), "images[0]"),
                                         (b"not an image", "cannot read the image"),
                                         ("/tmp/x.png", "opens no paths")])
def test_a_bad_image_is_one_line(payload, say):
    e = _engine()
    with pytest.raises(BadRequest) as err:
        e.add_request("r", [PAD, BOS, 11, EOS, BOS], SamplingParams(max_tokens=2), images=[payload])
    assert err.value.field == "images[0]" and say in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(BadRequest) as err:  # a pad without its image
        e.add_request("r", [PAD, BOS, 11, EOS, BOS], SamplingParams(max_tokens=2))
    assert err.value.field == "images" and "1 image pad" in str(err.value)


def test_the_spec_declares_the_kv_cache_path():
    assert get_model_spec("bagel").kv_cache
    assert dataclasses.replace(CFG).llm_config.max_position_embeddings == _engine().max_model_len


@pytest.mark.slow
def test_a_digits_run_served_over_http(tmp_path):
    """A one-step debug_bagel_digits run (the real Qwen3 tokenizer) served as a localhost process: a completion of
    BAGEL's prompt layout (token ids) is the offline engine's and the training forward's greedy answer; a chat with
    an image part (a held-out digit) is the offline engine's answer to the same chat, which is the training
    forward's on the run's own document of it (BagelDocs: its image sizes, the digits evaluator's chat). ~60 s on 2
    shared cores (training, then the server's start)."""
    serve = pytest.importorskip("tests.serve.test_serve_server")
    assert train(["--config", "debug_bagel_digits", "--job.dump_folder", str(tmp_path), "--job.name", "run",
                  "--training.steps", "1", "--metrics.enable_tensorboard", "False"]) == 0
    run = tmp_path / "run"
    offline = Engine.from_pretrained(str(run), ServeConfig(max_model_len=serve.MAX_LEN), device="cpu")
    tok = offline.tokenizer
    text = tok.encode("What digit is this?")
    prompt = [tok.im_start_id, *text, tok.im_end_id, tok.im_start_id]
    want = offline.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert [want.token_ids] == _reference([text], offline.model, tok.im_start_id, tok.im_end_id, answer=4 + 1)
    # a held-out digit as the evaluator asks it, through the chat path
    rec = digits_records(test=True)[0]
    png = rec["messages"][0]["content"][0]["image"]
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    question = rec["messages"][0]["content"][1]["text"]
    ids, images = offline.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": url},
                                                                    {"type": "text", "text": question}]}])
    assert ids[0] == tok.image_pad_id and ids[1:] == [tok.im_start_id, *tok.encode(question.strip()), tok.im_end_id,
                                                      tok.im_start_id]
    chat = offline.generate([ids], SamplingParams(temperature=0.0, max_tokens=2), images=[images])[0].outputs[0]
    rows = BagelDocs(offline.model.cfg, offline.data, tok, 0)
    doc = rows(rec, digits.CHAT, "digits_test:0")
    (ref,) = digits.greedy(offline.model, [doc], 3, tok.im_end_id)  # [bos digit eos]: up to 2 tokens
    assert chat.token_ids == (ref[:-1] if ref[-1:] == [-1] else ref + [tok.im_end_id])
    server = serve.Server(run).wait_up()
    try:
        got = server.client.completions.create(model="tiny", prompt=[prompt], max_tokens=4, temperature=0)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, want.finish_reason)
        assert got.usage.completion_tokens == len(want.token_ids)
        got = server.client.chat.completions.create(model="tiny", max_tokens=2, temperature=0, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": question}]}])
        assert (got.choices[0].message.content, got.choices[0].finish_reason) == (chat.text, chat.finish_reason)
        r = serve.httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}]}]})
        assert r.status_code == 400 and "image" in r.json()["error"]["message"], r.text
        server.wait_idle()
    finally:
        server.close()
