"""BAGEL understanding through the serving engine (issue 47 item 4), fp32 on CPU, a tiny random BAGEL: text prompts
in BAGEL's own layout (``[bos prompt eos]`` then the answer's ``bos``) decode through the engine's paged KV cache to
the tokens the training forward gives when the whole chat is re-run per token (titan_mm.models.bagel.digits.greedy,
under the training segment mask); several requests batched, with chunked and packed prefill and a shared prefix.
Images are refused in one line: the engine's image path cannot take BAGEL's ViT splits yet (docs/bagel.md). Slow: a
one-step digits run served by ``python -m titan_mm.serve`` and queried with the openai client."""

import base64
import dataclasses
import io

import numpy as np
import pytest
import torch
from PIL import Image

from titan_mm.launch.train import main as train
from titan_mm.models.bagel import digits
from titan_mm.models.bagel.config import FLAVORS
from titan_mm.models.bagel.model import BagelModel
from titan_mm.models.bagel.synthetic import BOS, EOS, _Sample
from titan_mm.registry import get_model_spec
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.engine import BadRequest, Engine, SamplingParams

CFG = FLAVORS["debug"]
ANSWER = 10
"""The answer split's tokens with its bos and eos: up to 9 generated tokens."""


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
                  eos_token_ids=[EOS])


@pytest.mark.parametrize("cfg,shared", [({}, 0), ({"max_num_batched_tokens": 8, "max_num_seqs": 4}, 0),
                                         ({"packed_prefill": True}, 0), ({}, 9)],
                         ids=["batched", "chunked", "packed", "prefix_cache"])
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
    routed = MODEL(ids, und_index=torch.arange(T), gen_index=torch.zeros(0, dtype=torch.long),
                   noisy_latents=torch.zeros(1, T, CFG.patch_latent_dim),
                   cond_latents=torch.zeros(1, T, CFG.patch_latent_dim), timesteps=torch.zeros(1, T),
                   latent_pos=torch.zeros(1, T, dtype=torch.long)).logits
    assert torch.equal(MODEL(ids).logits, routed)


def test_images_are_refused_in_one_line():
    e = _engine()
    with pytest.raises(BadRequest) as err:
        e.add_request("r", [BOS, 11, EOS, BOS], SamplingParams(max_tokens=2), images=[torch.zeros(3, 8, 8).numpy()])
    assert err.value.field == "images" and "\n" not in str(err.value)


def test_the_spec_declares_the_kv_cache_path():
    assert get_model_spec("bagel").kv_cache
    assert dataclasses.replace(CFG).llm_config.max_position_embeddings == _engine().max_model_len


@pytest.mark.slow
def test_a_digits_run_served_over_http(tmp_path):
    """A one-step debug_bagel_digits run (the real Qwen3 tokenizer) served as a localhost process: a completion of
    BAGEL's prompt layout (token ids) is the offline engine's and the training forward's greedy answer; a chat with
    an image part is a 400 naming the field. ~50 s on 2 shared cores (training, then the server's start)."""
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
    server = serve.Server(run).wait_up()
    try:
        got = server.client.completions.create(model="tiny", prompt=[prompt], max_tokens=4, temperature=0)
        assert (got.choices[0].text, got.choices[0].finish_reason) == (want.text, want.finish_reason)
        assert got.usage.completion_tokens == len(want.token_ids)
        buf = io.BytesIO()
        Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        r = serve.httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "What digit is this?"}, {"type": "image_url", "image_url": {"url": url}}]}]})
        assert r.status_code == 400 and "image" in r.json()["error"]["message"], r.text
        server.wait_idle()
    finally:
        server.close()
