"""Run a function on N CPU processes joined by a gloo process group, and collect what each returns.

Reusable by every room's multi-process tests::

    from _harness import run_multiproc   # pytest puts tests/multiproc/ on sys.path (no __init__.py)

    def _worker(rank, world_size, scale):      # module level, so spawn can import it
        t = torch.full((2,), float(rank)) * scale
        torch.distributed.all_reduce(t)
        return t

    results = run_multiproc(_worker, world_size=2, args=(3.0,))   # list indexed by rank

* Processes are started with the ``spawn`` context (no fork of a torch-initialised parent), on a free
  TCP port on 127.0.0.1, with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set
  as torchrun would, one intra-op thread each, and ``torch.distributed.init_process_group("gloo")``
  already called before ``fn`` runs (``destroy_process_group`` is called after it returns).
* Return values travel back through ``torch.save`` files in a temporary folder (tensors, dicts,
  lists, numbers); keep them small.
* Any exception on any rank, a crash (non-zero exit code) or a timeout raises ``MultiprocError`` whose
  message holds every failing rank's full traceback and exit code; processes still alive after a
  failure or timeout are terminated (only the ones this call started).
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class MultiprocError(RuntimeError):
    pass


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, args, kwargs, out_dir, env):
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args, **kwargs)
        torch.save({"ok": True, "result": result}, path)
    except BaseException:  # noqa: BLE001 - reported to the parent verbatim, then re-raised as exit code
        torch.save({"ok": False, "traceback": traceback.format_exc()}, path)
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure must not hide the first error
                pass


def run_multiproc(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    timeout_s: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo processes; return results by rank.

    ``fn`` must be defined at module level (spawn imports it by name). ``env`` adds environment variables
    to every child before torch.distributed is initialised. A port another test took between its pick and the
    store's bind (pytest-xdist runs tests side by side) is retried once on a fresh port.
    """
    try:
        return _run(fn, world_size, args, kwargs, timeout_s, env)
    except MultiprocError as e:
        if "address already in use" not in str(e).lower():
            raise
        return _run(fn, world_size, args, kwargs, timeout_s, env)


def _run(fn, world_size, args, kwargs, timeout_s, env) -> list[Any]:
    ctx = mp.get_context("spawn")
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="titan_mm_mp_") as out_dir:
        procs = []
        for rank in range(world_size):
            p = ctx.Process(
                target=_entry,
                args=(fn, rank, world_size, port, args, kwargs or {}, out_dir, dict(env or {})),
                daemon=False,
            )
            p.start()
            procs.append(p)

        deadline = time.monotonic() + timeout_s
        timed_out = False
        failed_early = False
        while any(p.is_alive() for p in procs):
            if time.monotonic() > deadline:
                timed_out = True
                break
            # one rank dying usually leaves the others blocked in a collective: stop waiting for them
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(2.0)  # let peers that will fail anyway write their tracebacks
                failed_early = True
                break
            time.sleep(0.05)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()

        results, errors = [], []
        for rank, p in enumerate(procs):
            path = os.path.join(out_dir, f"rank{rank}.pt")
            if os.path.exists(path):
                rec = torch.load(path, weights_only=False)
                if rec["ok"]:
                    results.append(rec["result"])
                    continue
                errors.append(f"--- rank {rank} raised (exit code {p.exitcode}):\n{rec['traceback']}")
            else:
                why = "timed out" if timed_out else ("stopped after another rank failed" if failed_early else "crashed")
                errors.append(f"--- rank {rank} {why} without a result (exit code {p.exitcode})")
            results.append(None)
        if errors or timed_out:
            head = f"run_multiproc({getattr(fn, '__qualname__', fn)}, world_size={world_size})"
            if timed_out:
                head += f" timed out after {timeout_s:.0f}s (raise timeout_s or look for a rank stuck in a collective)"
            raise MultiprocError(head + " failed:\n" + "\n".join(errors))
        return results
