"""Pipeline schedules as data: which torch schedule a name means, where its stages sit, its action lists, and a
replay of those lists with per-stage costs (step time, bubble, activations in flight). No process group needed.

    cls = schedule_class("Interleaved1F1B")             # torch.distributed.pipelining's (one-line error if absent)
    stages = stage_ids(rank, pp=4, virtual=2, schedule="Interleaved1F1B")   # [rank, rank + 4]
    orders = action_lists("ZBVZeroBubble", pp=4, virtual=2, n_micro=8)      # {rank: [(kind, stage, mb), ...]}
    t = replay(orders, fwd=[...], bwd_input=[...], bwd_weight=[...])        # Timeline: makespan, bubble, in flight

The action lists are the schedule's own (``pipeline_order``, computed by torch from the schedule's rules), so the
bubble and the activations in flight follow from the schedule itself, not from timing noise. Each rank runs its
compute actions in list order; an action starts when its rank is free and what it depends on has finished (plus
``comm`` seconds when that ran on another rank):

    F(s, m)        after F(s - 1, m)
    B(s, m), I(s, m)  after F(s, m) and B / I(s + 1, m)      B = full backward, I = input gradients only
    W(s, m)        after I(s, m)                             the weight gradients (zero-bubble schedules)

DualPipeV's overlapped F + B pairs run as their two actions one after the other (the overlap hides
communication, which this replay does not model per action). Memory: a stage's micro-batch holds its activations
from the start of F until its B ends (until W ends for the split backward: the weight gradients still read the
saved inputs).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch.distributed.pipelining import schedules

__all__ = ["SCHEDULES", "SPLIT_BACKWARD", "Timeline", "action_lists", "replay", "schedule_class", "stage_ids",
           "virtual_stages"]

# name -> placement of a rank's stages: "single" (one stage), "loop" (rank r: r, r + pp, ...), "v" (r, 2 pp - 1 - r)
SCHEDULES = {
    "GPipe": "single",
    "1F1B": "single",
    "Interleaved1F1B": "loop",
    "LoopedBFS": "loop",
    "InterleavedZeroBubble": "loop",
    "ZBVZeroBubble": "v",
    "DualPipeV": "v",
}

# schedules that split the backward into input gradients (I) and weight gradients (W, run later)
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def schedule_class(name: str):
    """torch's schedule class for ``name``; ValueError (one line) when the name is unknown or this torch lacks it."""
    if name not in SCHEDULES:
        raise ValueError(f"parallel.pp_schedule={name!r} is not a schedule; use one of {', '.join(SCHEDULES)}.")
    try:
        return schedules.get_schedule_class(name)
    except (ValueError, AttributeError):
        raise ValueError(f"parallel.pp_schedule={name!r} is not in this torch ({torch.__version__}); use one of "
                         f"{', '.join(n for n in SCHEDULES if _available(n))}.") from None


def _available(name: str) -> bool:
    try:
        schedules.get_schedule_class(name)
        return True
    except (ValueError, AttributeError):
        return False


def virtual_stages(schedule: str, virtual: int = 0) -> int:
    """Stages per rank: ``virtual`` checked against the schedule (0: the schedule's own, 1 or 2)."""
    kind = SCHEDULES.get(schedule)
    if kind is None:
        schedule_class(schedule)  # raises the one-line error
    if virtual < 0:
        raise ValueError(f"parallel.pp_virtual_stages must be >= 0 (0: the schedule's own), got {virtual}.")
    if kind == "single":
        if virtual not in (0, 1):
            raise ValueError(f"parallel.pp_schedule={schedule} runs one stage per rank, but pp_virtual_stages="
                             f"{virtual}; use Interleaved1F1B / LoopedBFS / InterleavedZeroBubble for more.")
        return 1
    if kind == "v":
        if virtual not in (0, 2):
            raise ValueError(f"parallel.pp_schedule={schedule} runs exactly 2 stages per rank (a V), but "
                             f"pp_virtual_stages={virtual}; set it to 0 or 2.")
        return 2
    if virtual == 1:
        raise ValueError(f"parallel.pp_schedule={schedule} needs at least 2 stages per rank (pp_virtual_stages="
                         "1); use 1F1B or GPipe for one.")
    return virtual or 2


def stage_ids(rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    """The global stage indices rank ``rank`` of ``pp`` runs, in increasing order."""
    if SCHEDULES[schedule] == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(virtual)]


def _stub(stage: int, n_stages: int, pp: int):
    # what a schedule's constructor reads of a stage (torch's own schedule tests use such stand-ins)
    return types.SimpleNamespace(stage_index=stage, num_stages=n_stages, group_size=pp, group_rank=0,
                                 is_first=stage == 0, is_last=stage == n_stages - 1, submod=torch.nn.Identity())


def action_lists(schedule: str, pp: int, virtual: int, n_micro: int) -> dict[int, list[tuple[str, int, int]]]:
    """{rank: [(kind, stage, micro-batch), ...]} of compute actions, kind in F / B / I / W, as the torch schedule
    orders them (``pipeline_order`` of the multi-stage schedules, overlapped pairs split in two; GPipe / 1F1B: the
    order of their loops, :func:`_single_order`). ValueError (one line) for a combination the schedule refuses,
    e.g. too few micro-batches."""
    cls = schedule_class(schedule)
    v = virtual_stages(schedule, virtual)
    n_stages = pp * v
    if SCHEDULES[schedule] == "single":
        if schedule == "1F1B" and n_micro < pp:
            raise ValueError(f"parallel.pp_schedule=1F1B needs at least pp={pp} micro-batches, got {n_micro}.")
        return {r: _single_order(schedule, r, pp, n_micro) for r in range(pp)}
    stubs = [_stub(s, n_stages, pp) for s in stage_ids(0, pp, v, schedule)]
    try:
        sched = cls(stubs[0] if SCHEDULES[schedule] == "single" else stubs, n_microbatches=n_micro,
                    loss_fn=lambda out, target: out, scale_grads=False)
    except (ValueError, RuntimeError, AssertionError) as e:
        raise ValueError(f"parallel.pp_schedule={schedule} with pp={pp}, {v} stage(s) per rank and {n_micro} "
                         f"micro-batches: {str(e).strip().splitlines()[0]}") from None
    order = sched.pipeline_order
    if not order:
        raise ValueError(f"parallel.pp_schedule={schedule}: this torch ({torch.__version__}) exposes no action "
                         "list for it (pipeline_order).")
    kinds = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}
    out: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in order.items():
        seq = []
        for a in actions:
            if a is None:
                continue
            for x in (getattr(a, "sub_actions", None) or (a,)):
                k = kinds.get(x.computation_type.name)
                if k is not None:
                    seq.append((k, x.stage_index, x.microbatch_index))
        out[rank] = seq
    return out


def _single_order(schedule: str, stage: int, pp: int, n_micro: int) -> list[tuple[str, int, int]]:
    """The order GPipe's / 1F1B's ``_step_microbatches`` loops run (their ``pipeline_order`` is a drawing aid and,
    in torch 2.13, numbers 1F1B's last-stage forwards from 1): GPipe all forwards then all backwards; 1F1B
    ``min(n_micro, pp - stage)`` forwards, then one backward and one forward in turn, then the backwards left."""
    if schedule == "GPipe":
        return [("F", stage, m) for m in range(n_micro)] + [("B", stage, m) for m in range(n_micro)]
    warm = min(n_micro, pp - stage)
    out = [("F", stage, m) for m in range(warm)]
    for m in range(n_micro):
        out.append(("B", stage, m))
        if warm + m < n_micro:
            out.append(("F", stage, warm + m))
    return out


@dataclass(frozen=True)
class Timeline:
    makespan: float
    """Time from the first action's start to the last one's end."""
    busy: dict[int, float]
    """Compute time per rank."""
    in_flight: dict[int, int]
    """Per stage: the most micro-batches whose activations it held at once."""
    peak_bytes: dict[int, float]
    """Per rank: the largest sum of its stages' held activations (``act_bytes`` per stage and micro-batch)."""
    first_backward: dict[int, float]
    """Per rank: when its first backward action started."""

    @property
    def bubble(self) -> float:
        """Idle fraction of the ranks over the makespan."""
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)


def replay(orders: dict[int, list[tuple[str, int, int]]], fwd: list[float], bwd_input: list[float],
           bwd_weight: list[float], comm: float = 0.0, act_bytes: list[float] | None = None) -> Timeline:
    """Run the action lists with per-stage costs (seconds per micro-batch: forward, input-gradient backward,
    weight-gradient backward; a full backward costs their sum) and ``comm`` seconds per send between ranks."""
    n_stages = len(fwd)
    rank_of = {s: r for r, acts in orders.items() for _, s, _ in acts}
    cost = {"F": fwd, "I": bwd_input, "W": bwd_weight,
            "B": [i + w for i, w in zip(bwd_input, bwd_weight)]}
    done: dict[tuple[str, int, int], float] = {}
    start: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in orders}
    pos = {r: 0 for r in orders}

    def ready(kind, s, m):
        """Earliest start allowed by the dependencies, or None while one of them has not run."""
        deps = []
        if kind == "F" and s > 0:
            deps.append(("F", s - 1, m))
        elif kind in ("B", "I"):
            deps.append(("F", s, m))
            if s < n_stages - 1:
                deps.append(("B" if ("B", s + 1, m) in done or ("I", s + 1, m) not in done else "I", s + 1, m))
        elif kind == "W":
            deps.append(("I", s, m))
        t = 0.0
        for d in deps:
            if d not in done:
                return None
            t = max(t, done[d] + (comm if rank_of[d[1]] != rank_of[s] else 0.0))
        return t

    total = sum(len(a) for a in orders.values())
    while len(done) < total:
        progressed = False
        for r, acts in orders.items():
            while pos[r] < len(acts):
                a = acts[pos[r]]
                t = ready(*a)
                if t is None:
                    break
                st = max(t, free[r])
                start[a] = st
                done[a] = free[r] = st + cost[a[0]][a[1]]
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: acts[pos[r]] for r, acts in orders.items() if pos[r] < len(acts)}
            raise RuntimeError(f"the action lists deadlock at {stuck}")
    t0 = min(start.values())
    busy = {r: sum(cost[k][s] for k, s, _ in acts) for r, acts in orders.items()}
    # activations: held from F's start to the end of B (or W, for a split backward)
    events = []
    for (k, s, m), st in start.items():
        if k == "F":
            events.append((st, 1, s))
        elif k == "B" or k == "W":
            events.append((done[(k, s, m)], -1, s))
    events.sort(key=lambda e: (e[0], e[1]))
    held = {s: 0 for s in range(n_stages)}
    in_flight = dict(held)
    ab = act_bytes or [1.0] * n_stages
    peak = {r: 0.0 for r in orders}
    for _, d, s in events:
        held[s] += d
        in_flight[s] = max(in_flight[s], held[s])
        r = rank_of[s]
        peak[r] = max(peak[r], sum(held[x] * ab[x] for x in held if rank_of[x] == r))
    first_b = {r: min((start[a] for a in acts if a[0] in "BI"), default=0.0) - t0 for r, acts in orders.items()}
    return Timeline(max(done.values()) - t0, busy, in_flight, peak, first_b)
