"""Tensor-parallel serving on 2 gloo processes (titan_mm/serve/runner/tp.py): greedy outputs of 16 mixed-length prompts
batched together are token-identical to transformers' ``generate`` and to the single-process engine, for Qwen3
(loaded from an HF folder: meta build, the plan, each rank reads its shards and stacks its q/k/v and gate/up
shards into one GEMM each) and Qwen3-MoE (a model in memory, split by the plan; its experts stay replicated over
tp, as the plan has them). One launch runs every case of a test: prefix caching and unseeded sampling (whose
tokens must agree between the ranks: the engine's seed is rank 0's). Every block comes back, each rank's pool
holds its kv heads only, and a tp degree the world or the heads cannot take is one line. Marked slow: forced preemption, chunked prefill under a 16-token budget, n-gram and
draft-model speculation, beam search (against one process); Qwen3-VL and Qwen3-VL-MoE with images; the server
under torchrun.

Run: OMP_NUM_THREADS=1 pytest -q tests/multiproc/test_serve_tp.py   (-m slow: the slow ones)
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from _harness import run_multiproc  # noqa: E402
from tests.parity.test_serve_generate import MAX_NEW, draft_model, text_reference  # noqa: E402
from titan_mm.registry import get_model_spec  # noqa: E402

# name -> (ServeConfig fields, SamplingParams fields, compared with: "hf" (and one process), "one" process, or
# only the other rank). Each case's first steps are slow on CPU: DTensor propagates the sharding of every op once
# per new input shape, and chunked prefill / speculation make many shapes.
GREEDY, POOL = dict(temperature=0.0), dict(block_size=4, num_blocks=256)
CASES = {
    "prefix_cache": (dict(POOL, max_num_seqs=4), GREEDY, "hf"),  # admitted in waves: later ones hit
    "preemption": (dict(block_size=4, num_blocks=22, max_num_seqs=16), GREEDY, "hf"),
    "sampled": (POOL, dict(temperature=1.0), "ranks"),
    "chunked_prefill": (dict(POOL, max_num_seqs=8, max_num_batched_tokens=16), GREEDY, "hf"),
    "spec_ngram": (dict(POOL, speculative_method="ngram", num_speculative_tokens=3), GREEDY, "hf"),
    "spec_draft": (dict(POOL, speculative_method="draft", num_speculative_tokens=3), GREEDY, "hf"),
    "beam": (POOL, dict(use_beam_search=True, best_of=4, n=2), "one"),
}
FAST = ("prefix_cache", "sampled")  # the quick suite; preemption, chunks, speculation and beams run with -m slow
def _run_cases(cases, make_engine, prompts, draft):
    """{case: (token ids per prompt on this rank, stats)}; a rank > 0 records the outputs its steps produced."""
    from titan_mm.serve.config import ServeConfig
    from titan_mm.serve.sampling_params import SamplingParams

    got = {}
    for case in cases:
        fields, sampling, _ = CASES[case]
        cfg = ServeConfig(max_model_len=256, tensor_parallel_size=2, **fields)
        engine = make_engine(cfg, draft() if cfg.speculative_method == "draft" else None)
        seen = {}
        if engine.tp_rank:  # the outputs this rank computed while following rank 0's steps
            step_at = engine._step_at

            def spy(t, step_at=step_at, seen=seen):
                outs = step_at(t)
                seen.update({o.request_id: [c.token_ids for c in o.outputs] for o in outs if o.finished})
                return outs

            engine._step_at = spy
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, **sampling))
        if engine.tp_rank:
            tokens = [seen[k] for k in sorted(seen, key=lambda k: int(k.rsplit("-", 1)[1]))]
        else:
            tokens = [[c.token_ids for c in o.outputs] for o in outs]
        st = engine.stats()
        st = {k: st[k] for k in ("kv_blocks_used", "num_running", "num_preemptions", "prefix_cache_hit_tokens",
                                 "kv_blocks_total")}
        st["kv_heads"] = engine.runner.cache.k[0].shape[2]  # this rank's pool: its local kv heads only
        st["qkv_sizes"] = engine.model.layers["0"].attn.qkv_sizes  # fused (from_pretrained): this rank's q, k, v rows
        got[case] = (tokens, st)
    return got


def _config_errors(spec, model_cfg) -> list[str]:
    """The one-line errors of a tp degree the world or the model cannot take."""
    import dataclasses

    from titan_mm.config import ConfigError
    from titan_mm.serve.runner.tp import tensor_parallel

    msgs = []
    for fn in (lambda: tensor_parallel(4, "cpu"),
               lambda: tensor_parallel(2, "cpu").check(spec, dataclasses.replace(model_cfg, num_key_value_heads=1))):
        try:
            fn()
        except ConfigError as e:
            msgs.append(str(e))
    return msgs


def _plain(sd, cfg):
    from titan_mm.models.qwen3.model import Qwen3Model

    m = Qwen3Model(cfg)
    m.load_state_dict(sd)
    return m


def _worker(rank, world, cases, folder, moe, draft, prompts):
    from titan_mm.serve.engine import Engine

    out = {}
    dense_prompts, dense_eos = prompts["qwen3"]
    first = []

    spec = get_model_spec("qwen3")

    def draft_of():  # whole, the same on both ranks: the engine splits it by its plan
        return _plain(*draft), spec, draft[1]

    def dense_engine(cfg, d):  # from the folder once; the later engines take its split model (and tokenizer)
        if not first:
            first.append(Engine.from_pretrained(folder, cfg, device="cpu", eos_token_ids=[dense_eos], draft=d))
            return first[0]
        e = first[0]
        return Engine(e.model, spec, e.model_cfg, cfg, tokenizer=e.tokenizer, eos_token_ids=[dense_eos], draft=d)

    out["qwen3"] = _run_cases(cases, dense_engine, dense_prompts, draft_of)

    def moe_engine(cfg, d):  # a whole model in memory, the same on both ranks, split by the engine
        return Engine(_plain(*moe), spec, moe[1], cfg, tokenizer=first[0].tokenizer,
                      eos_token_ids=[prompts["qwen3_moe"][1]], draft=d)

    out["qwen3_moe"] = _run_cases(cases, moe_engine, prompts["qwen3_moe"][0], draft_of)
    out["errors"] = _config_errors(first[0].spec, first[0].model_cfg)
    return out


@pytest.mark.parametrize("cases", [FAST, pytest.param(tuple(c for c in CASES if c not in FAST), marks=pytest.mark.slow)],
                         ids=["fast", "chunked_spec_beam"])
def test_tp2_matches_one_process_and_transformers(tmp_path, cases):
    from titan_mm.serve.config import ServeConfig
    from titan_mm.serve.engine import Engine
    from titan_mm.serve.sampling_params import SamplingParams

    refs, prompts, single = {}, {}, {}
    folder = tmp_path / "qwen3"
    for name, moe in (("qwen3", False), ("qwen3_moe", True)):
        hf, tm, ps, eos, ref = text_reference(moe)
        refs[name], prompts[name] = ref, (ps, eos)
        if not moe:
            hf.save_pretrained(folder)
            d = draft_model(tm)[0]
            draft = (d.state_dict(), d.cfg)
        else:
            moe_model = (tm.state_dict(), tm.cfg)
        single[name] = {}
        for case in cases:
            fields, sampling, vs = CASES[case]
            if vs != "ranks":
                cfg = ServeConfig(max_model_len=256, **fields)
                e = Engine(tm, get_model_spec("qwen3"), tm.cfg, cfg, eos_token_ids=[eos],
                           draft=(_plain(*draft), get_model_spec("qwen3"), draft[1]) if cfg.speculative_method == "draft"
                           else None)
                single[name][case] = [[c.token_ids for c in o.outputs] for o in
                                      e.generate(ps, SamplingParams(max_tokens=MAX_NEW, **sampling))]
    ranks = run_multiproc(_worker, 2, args=(cases, str(folder), moe_model, draft, prompts), timeout_s=400)
    for name in refs:
        for case in cases:
            vs = CASES[case][2]
            (t0, s0), (t1, s1) = ranks[0][name][case], ranks[1][name][case]
            where = f"{name}/{case}"
            assert t0 == t1 and s0 == s1, f"{where}: the ranks differ: {t0} / {s0} vs {t1} / {s1}"
            assert s0["kv_blocks_used"] == 0 and s0["num_running"] == 0, (where, s0)  # every block came back
            if vs != "ranks":
                assert t0 == single[name][case], f"{where}: tp2 {t0} != one process {single[name][case]}"
            if vs == "hf":
                bad = [i for i, r in enumerate(refs[name]) if t0[i] != [r]]
                assert not bad, f"{where}: prompts {bad} differ from HF generate"
            if case == "preemption":
                assert s0["num_preemptions"] > 0, (where, s0)
            if case == "prefix_cache":
                assert s0["prefix_cache_hit_tokens"] > 0, (where, s0)
            assert s0["kv_heads"] == 1, (where, s0)  # 2 kv heads over 2 ranks
            # the dense model came from a folder: fused, each of q, k, v split over the ranks inside wqkv (4 heads, 2
            # kv heads of 16); the MoE model was given to Engine(): served as given
            assert s0["qkv_sizes"] == ((32, 16, 16) if name == "qwen3" else (0, 0, 0)), (where, s0)
    assert ranks[0]["errors"] == [
        "serve.tensor_parallel_size=4 but 2 processes were launched; start torchrun with --nproc-per-node 4",
        "serve.tensor_parallel_size=2 cannot split the model: tp(2) does not divide num_key_value_heads(1).",
    ], ranks[0]["errors"]


def test_tp_needs_its_processes():
    from titan_mm.config import ConfigError
    from titan_mm.serve.config import ServeConfig
    from titan_mm.serve.engine import Engine

    with pytest.raises(ConfigError, match="must be a positive int"):
        ServeConfig(tensor_parallel_size=0).check()
    _, tm, *_ = text_reference(False)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=2 needs 2 processes; launch with torchrun"):
        Engine(tm, get_model_spec("qwen3"), tm.cfg, ServeConfig(tensor_parallel_size=2))


@pytest.mark.slow  # torchrun, 2 processes, the HTTP server: about 25 s on 2 cores
def test_torchrun_server_answers_as_one_process(tmp_path):
    """``torchrun --nproc-per-node 2 -m titan_mm.serve --tensor-parallel-size 2``: rank 0 serves the same greedy
    completions as the single-process engine, and the blocks come back."""
    import os
    import subprocess
    import sys
    import time

    import httpx
    from _harness import find_free_port

    from titan_mm.serve.config import ServeConfig
    from titan_mm.serve.engine import Engine
    from titan_mm.serve.sampling_params import SamplingParams

    hf, *_ = text_reference(False)
    hf.save_pretrained(tmp_path)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    one = Engine.from_pretrained(tmp_path, ServeConfig(max_model_len=256, num_blocks=64), device="cpu")
    want = [o.outputs[0].token_ids for o in one.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))]
    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(find_free_port()), "-m", "titan_mm.serve", "--model", str(tmp_path), "--tensor-parallel-size", "2",
           "--device", "cpu", "--port", str(port), "--serve.max_model_len", "256", "--serve.num_blocks", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=10)[0][-3000:]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        body = {"model": tmp_path.name, "prompt": prompts, "max_tokens": 6, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
        assert [c["text"] for c in r["choices"]] == [one.tokenizer.decode(w) for w in want], r
        used = [line for line in httpx.get(url + "/metrics").text.splitlines()
                if line.startswith("titan_mm_serve_kv_blocks_used ")]
        assert used == ["titan_mm_serve_kv_blocks_used 0.0"], used
    finally:
        proc.terminate()
        proc.wait(30)


def _vl_worker(rank, world, cases):
    from titan_mm.serve.config import ServeConfig
    from titan_mm.serve.engine import Engine
    from titan_mm.serve.sampling_params import SamplingParams

    out = {}
    for name, (tm, spec, prompts, images, eos, data) in cases.items():
        cfg = ServeConfig(max_model_len=256, tensor_parallel_size=2, block_size=4, num_blocks=256, max_num_seqs=4)
        engine = Engine(tm, spec, tm.cfg, cfg, eos_token_ids=[eos], data=data)
        outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW), images=images)
        out[name] = ([o.outputs[0].token_ids for o in outs] if rank == 0 else None, engine.stats()["kv_blocks_used"])
    return out


@pytest.mark.slow  # the vision towers run replicated on both ranks: about 50 s on 2 cores
def test_tp2_vl_with_images_matches_transformers():
    """Qwen3-VL and Qwen3-VL-MoE under tp 2 (the language model split by the plan, the vision tower replicated, as
    without parallel.encoder_tp): the 16 prompts with images give HF's greedy tokens."""
    from tests.parity.test_serve_generate import vl_setup

    cases, refs = {}, {}
    for moe in (False, True):
        tm, spec, prompts, images, eos, ref, data = vl_setup(moe)
        cases[spec.name], refs[spec.name] = (tm, spec, prompts, images, eos, data), ref
    ranks = run_multiproc(_vl_worker, 2, args=(cases,), timeout_s=400)
    for name, ref in refs.items():
        got, used = ranks[0][name]
        bad = [i for i, r in enumerate(ref) if got[i] != r]
        assert not bad, f"{name}: prompts {bad} differ from HF generate"
        assert used == ranks[1][name][1] == 0, name
