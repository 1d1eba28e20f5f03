"""Continuous batching and admission control.

The scheduler alone (no model: a driver marks scheduled tokens computed and appends a token where a row reaches the
end of its sequence): token budget and seats per step, chunked prefill next to decode, preemption of the lowest
class / latest request when blocks run out and its recompute, no deadlock on a tiny pool, higher classes preempting
preemptible ones, deadline order within a class, chunks that never cut an image. The engine over a tiny model: a
full queue and a spent token rate answer QueueFull, deadlines and aborts end requests and free their blocks at
once, bad requests raise one BadRequest naming the field, and requests added from another thread while it steps
all finish."""

import itertools
import random
import threading

import pytest
import torch

from tests.unit._serve_helpers import engine, prompt
from titan_mm.config import ConfigError
from titan_mm.serve.core.block_manager import BlockManager
from titan_mm.serve.config import ServeConfig
from titan_mm.serve.errors import BadRequest, QueueFull
from titan_mm.serve.sampling_params import SamplingParams
from titan_mm.serve.core.scheduler import Scheduler
from titan_mm.serve.core.sequence import Image, Request, RequestMetrics, Sequence, Status

_ids = itertools.count()


def req(rid, n_prompt, max_tokens=4, priority=0, arrival=0.0, deadline=None, images=()):
    seq = Sequence(next(_ids), list(range(n_prompt)), n_prompt)
    return Request(rid, list(seq.tokens), SamplingParams(temperature=0.0, max_tokens=max_tokens), priority, deadline,
                   RequestMetrics(arrival), [seq], list(images))


def sched(num_blocks=64, block_size=4, **cfg):
    c = ServeConfig(block_size=block_size, num_blocks=num_blocks, **cfg)
    return Scheduler(c, BlockManager(num_blocks, block_size, c.enable_prefix_caching))


def step(s: Scheduler):
    """Schedule, then do what the engine does with the rows (one token, id 1, per finished chunk)."""
    out = s.schedule()
    for r in out.rows:
        r.seq.num_computed = r.start + r.n
        if r.samples:
            r.seq.tokens.append(1)
            if len(r.seq.output) >= r.req.params.max_tokens:
                r.seq.finish_reason = "length"
                s.finish(r.req)
    return out


def run(s: Scheduler, limit=2000):
    steps = []
    while s.running or s.waiting:
        steps.append(step(s))
        assert len(steps) < limit, "no progress"
    return steps


def test_budget_and_seats_bound_every_step():
    s = sched(max_num_batched_tokens=64, max_num_seqs=4)
    reqs = [req(f"r{i}", 30, max_tokens=5, arrival=i) for i in range(10)]
    for r in reqs:
        s.add(r)
    steps = run(s)
    assert all(o.num_tokens <= 64 for o in steps)
    assert max(len(o.rows) for o in steps) == 4
    mixed = [o for o in steps if any(r.n == 1 for r in o.rows) and any(r.n > 1 for r in o.rows)]
    assert mixed, "no step ran prefill chunks next to decode tokens"
    assert all(r.status is Status.FINISHED and len(r.seqs[0].output) == 5 for r in reqs)
    assert s.blocks.num_free == s.blocks.num_blocks


def test_chunked_prefill_splits_a_long_prompt():
    s = sched(max_num_batched_tokens=32)
    s.add(req("long", 100, max_tokens=2))
    chunks = [[(r.start, r.n) for r in step(s).rows] for _ in range(5)]
    assert chunks == [[(0, 32)], [(32, 32)], [(64, 32)], [(96, 4)], [(100, 1)]]
    whole = sched(max_num_batched_tokens=128, enable_chunked_prefill=False)
    whole.add(req("a", 100))
    whole.add(req("b", 100, arrival=1))
    assert [(r.req.request_id, r.n) for r in step(whole).rows] == [("a", 100)]  # b's prompt waits for room


def test_preemption_takes_the_lowest_class_latest_and_recomputes():
    s = sched(num_blocks=10, max_num_batched_tokens=64)
    a, b, c = req("a", 12, 12, 0, 0.0), req("b", 12, 12, 1, 1.0), req("c", 12, 12, 1, 2.0)
    for r in (a, b, c):
        s.add(r)
    steps = run(s)
    assert c.metrics.num_preemptions >= 1 and a.metrics.num_preemptions == 0
    assert s.num_preemptions >= 1
    assert all(len(r.seqs[0].output) == 12 for r in (a, b, c))
    # the recompute prefilled c's prompt and its generated tokens again
    recompute = [r for o in steps for r in o.rows if r.req is c and r.start == 0 and r.n > 12]
    assert recompute
    assert s.blocks.num_free == 10


def test_no_deadlock_on_a_tiny_pool():
    rng = random.Random(0)
    s = sched(num_blocks=12, block_size=2, max_num_batched_tokens=16, max_num_seqs=6)
    reqs = []
    for i in range(30):
        n, m = rng.randrange(1, 14), rng.randrange(1, 9)  # at most 22 tokens = 11 blocks: fits alone
        reqs.append(req(f"r{i}", n, m, rng.randrange(3), float(i)))
        s.add(reqs[-1])
    run(s, limit=5000)
    assert all(len(r.seqs[0].output) == r.params.max_tokens for r in reqs)
    assert s.num_preemptions > 0 and s.blocks.num_free == 12


def test_a_higher_class_preempts_a_preemptible_one():
    s = sched(max_num_seqs=2, preemptible_priority=2)
    low1, low2 = req("low1", 8, 20, 2, 0.0), req("low2", 8, 20, 2, 1.0)
    s.add(low1)
    s.add(low2)
    step(s)
    mid = req("mid", 8, 2, 1, 2.0)
    s.add(mid)
    out = step(s)
    assert mid.status is Status.RUNNING and low2.status is Status.WAITING and low1.status is Status.RUNNING
    assert {r.req.request_id for r in out.rows} == {"low1", "mid"}
    # a class that is not preemptible is never pushed out
    t = sched(max_num_seqs=1, preemptible_priority=2)
    one = req("one", 8, 20, 1, 0.0)
    t.add(one)
    step(t)
    t.add(req("top", 8, 2, 0, 1.0))
    step(t)
    assert one.status is Status.RUNNING and t.waiting[0].request_id == "top"


def test_waiting_order_is_class_then_deadline_then_arrival():
    s = sched(max_num_seqs=1)
    for r in (req("late", 4, arrival=0.0, deadline=50.0), req("soon", 4, arrival=1.0, deadline=10.0),
              req("none", 4, arrival=0.5), req("first", 4, priority=0, arrival=3.0, deadline=20.0)):
        r.priority = 0 if r.request_id == "first" else 1
        s.add(r)
    order = []
    while s.running or s.waiting:
        for r in step(s).rows:
            if r.req.request_id not in order:
                order.append(r.req.request_id)
    assert order == ["first", "soon", "late", "none"]


def test_a_chunk_never_ends_inside_an_image():
    im = Image(10, 30, torch.zeros(1, 1), torch.tensor([[1, 1, 1]]), key=1)
    s = sched(max_num_batched_tokens=16)
    r = req("img", 34, 1, images=[im])
    s.add(r)
    s.add(req("other", 3, 3, arrival=1.0))
    steps, spans = [], []
    while s.running or s.waiting:
        steps.append(step(s))
        spans += [(x.start, x.start + x.n) for x in steps[-1].rows if x.req is r]
    assert spans[:3] == [(0, 10), (10, 30), (30, 34)]
    assert steps[1].num_tokens == 20 and len(steps[1].rows) == 1  # the 20-token image runs whole, alone
    assert all(not (10 < end < 30) for _, end in spans)


# ---- admission control in the engine ----
class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_a_full_queue_answers_queue_full():
    e = engine(max_queue_len=2)
    e.add_request("a", prompt(4), SamplingParams(max_tokens=2))
    e.add_request("b", prompt(4), SamplingParams(max_tokens=2))
    with pytest.raises(QueueFull, match="2 requests are waiting"):
        e.add_request("c", prompt(4), SamplingParams(max_tokens=2))
    e.step()  # both admitted: the queue has room again
    e.add_request("c", prompt(4), SamplingParams(max_tokens=2))


def test_the_token_rate_limit_refills_with_time():
    clock = Clock()
    e = engine(clock=clock, token_rate_limit=100.0, token_rate_burst_s=1.0)
    cost = SamplingParams(max_tokens=40)  # 10 + 40 tokens each
    for rid in "abc":  # 100 -> 50 -> 0 -> -50: admitted while the bucket is not in debt
        e.add_request(rid, prompt(10), cost)
    with pytest.raises(QueueFull, match="token rate limit"):
        e.add_request("d", prompt(10), cost)
    clock.t += 0.6  # +60 tokens
    e.add_request("d", prompt(10), cost)


def test_a_deadline_ends_the_request_and_frees_its_blocks():
    clock = Clock()
    e = engine(clock=clock)
    e.add_request("slow", prompt(10), SamplingParams(max_tokens=50), deadline_s=1.0)
    e.add_request("free", prompt(10), SamplingParams(max_tokens=3))
    e.step()
    assert e.stats()["kv_blocks_used"] > 0
    clock.t += 2.0
    outs = {o.request_id: o for o in e.step()}
    o = outs["slow"]
    assert o.finished and o.outputs[0].finish_reason == "abort" and o.metrics.deadline_exceeded
    while e.has_unfinished():
        e.step()
    assert e.stats()["kv_blocks_used"] == 0


def test_abort_frees_blocks_at_once_and_reports():
    e = engine()
    e.add_request("x", prompt(20), SamplingParams(max_tokens=30))
    e.step()
    assert e.stats()["kv_blocks_used"] == 5
    e.abort("x")
    assert e.stats()["kv_blocks_used"] == 0 and e.has_unfinished()
    outs = e.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("x", True, "abort")]
    assert not e.has_unfinished()
    e.abort("x")  # unknown / finished ids are ignored
    e.abort("never")


@pytest.mark.parametrize("call, field", [
    (lambda e: e.add_request("r", [], SamplingParams()), "prompt"),
    (lambda e: e.add_request("r", [1, 300], SamplingParams()), "prompt"),
    (lambda e: e.add_request("r", prompt(256), SamplingParams()), "prompt"),
    (lambda e: e.add_request("r", prompt(200), SamplingParams(max_tokens=100)), "max_tokens"),
    (lambda e: e.add_request("r", prompt(4), SamplingParams(stop_token_ids=[999])), "stop_token_ids"),
    (lambda e: e.add_request("r", prompt(4), SamplingParams(), priority=3), "priority"),
    (lambda e: e.add_request("r", prompt(4), SamplingParams(), deadline_s=-1), "deadline_s"),
    (lambda e: e.add_request("r", prompt(4), SamplingParams(), images=[b"x"]), "images"),
    (lambda e: e.add_request("", prompt(4), SamplingParams()), "request_id"),
    (lambda e: e.add_request("r", prompt(4), SamplingParams(temperature=-1)), "temperature"),
    (lambda e: e.add_request("r", prompt(100), SamplingParams(n=8, temperature=1.0, max_tokens=100)), "max_tokens"),
])
def test_bad_requests_name_the_field(call, field):
    e = engine(num_blocks=64)
    with pytest.raises(BadRequest) as err:
        call(e)
    assert err.value.field == field, err.value
    assert not e.has_unfinished()


def test_a_request_id_in_use_is_refused():
    e = engine()
    e.add_request("r", prompt(4), SamplingParams())
    with pytest.raises(BadRequest, match="already in use"):
        e.add_request("r", prompt(4), SamplingParams())


def test_settings_that_cannot_run_are_config_errors():
    with pytest.raises(ConfigError, match="max_num_batched_tokens >= max_model_len"):
        engine(enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="must be >= max_num_seqs"):
        engine(max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ConfigError, match="serve.block_size must be a positive int"):
        ServeConfig(block_size=0).check()


def test_requests_from_another_thread_while_stepping():
    e = engine()
    done: dict = {}
    errors: list = []

    def client(k):
        try:
            for i in range(5):
                e.add_request(f"t{k}-{i}", prompt(3 + i, k * 10 + i), SamplingParams(temperature=0.0, max_tokens=4))
        except Exception as ex:  # surfaced below
            errors.append(ex)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) or e.has_unfinished():
        for o in e.step():
            if o.finished:
                done[o.request_id] = o
    for t in threads:
        t.join()
    assert not errors and len(done) == 15
    assert all(len(o.outputs[0].token_ids) == 4 for o in done.values())
    assert e.stats()["kv_blocks_used"] == 0
