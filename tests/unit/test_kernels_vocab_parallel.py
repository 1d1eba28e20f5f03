"""Loss parallel's cross-entropies on 2 gloo CPU ranks, each holding half of the head's vocabulary rows: the
fused Triton CE per shard (titan_mm.kernels.vocab_parallel_linear_cross_entropy, through the Triton
interpreter) and the PyTorch chunked CE with ``group=`` (titan_mm.nn.loss.chunked_cross_entropy)
give the single-process loss and gradients (grad_W: this rank's rows)."""

import os
import socket
import subprocess
import sys
import textwrap


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_two_ranks(tmp_path, name: str, code: str, interpret: bool) -> None:
    """Run ``code`` as 2 gloo ranks (argv: rank, port) in fresh interpreters (TRITON_INTERPRET must be set, or
    unset, before triton is imported); each must exit 0 and print OK."""
    script = tmp_path / name
    script.write_text(code)
    port = str(_free_port())
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    procs = [
        subprocess.Popen([sys.executable, "-W", "ignore", str(script), str(r), port], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "OK" in out


CHILD_VP_CE = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard
    import titan_mm.kernels as K
    from titan_mm.nn.loss import chunked_cross_entropy
    from titan_mm.parallel.tp import vocab_parallel_fused_cross_entropy

    rank = int(sys.argv[1]); port = sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # same full tensors on both ranks
    N, D, V = 19, 16, 80  # 40 rows per shard (not a power of two), a partial last chunk
    h, w = torch.randn(N, D), torch.randn(V, D) * 0.5
    labels = torch.randint(0, V, (N,))
    labels[::4] = -100
    wts = 1.0 / (0.05 + torch.rand(N))  # per-token weights (a diffusion objective's 1/t)
    for z, chunk, wt in ((0.0, 0, None), (1e-2, 7, None), (1e-2, 7, wts)):
        hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ref = chunked_cross_entropy(hr, wr, labels, chunk_size=5, z_loss_weight=z, weights_N=wt)
        ref.backward()
        hs, ws = h.clone().requires_grad_(True), w[rank * 40:(rank + 1) * 40].clone().requires_grad_(True)
        got = K.vocab_parallel_linear_cross_entropy(hs, ws, labels, rank * 40, dist.group.WORLD, z_loss=z,
                                                    chunk_size=chunk, weights=wt)
        (got * 2.0).backward()
        torch.testing.assert_close(got.detach(), ref.detach(), msg=f"loss z={z}")
        torch.testing.assert_close(hs.grad, 2 * hr.grad, msg=f"grad h z={z}")
        torch.testing.assert_close(ws.grad, 2 * wr.grad[rank * 40:(rank + 1) * 40], msg=f"grad w z={z}")
    # through titan_mm.parallel.tp (what loss parallel installs for a model on the fused CE), DTensor weight
    hd = h.clone().requires_grad_(True)
    wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_(True)
    got = vocab_parallel_fused_cross_entropy(hd, wd, labels, 4096, 0.0)
    got.backward()
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = chunked_cross_entropy(hr, wr, labels)
    ref.backward()
    torch.testing.assert_close(got.detach(), ref.detach())
    torch.testing.assert_close(hd.grad, hr.grad)
    torch.testing.assert_close(wd.grad.full_tensor(), wr.grad)
    # the PyTorch chunked CE over the vocabulary shards (group=): as the single-process CE, float64 and fp32
    for dt, z, chunk, wt in ((torch.float64, 0.0, 4, None), (torch.float64, 1e-2, 7, None),
                             (torch.float64, 1e-2, 7, wts), (torch.float32, 1e-3, 4096, None)):
        hr, wr = h.to(dt, copy=True).requires_grad_(True), w.to(dt, copy=True).requires_grad_(True)
        ref = chunked_cross_entropy(hr, wr, labels, chunk_size=chunk, z_loss_weight=z, weights_N=wt)
        ref.backward()
        hs = h.to(dt, copy=True).requires_grad_(True)
        ws = w[rank * 40:(rank + 1) * 40].to(dt, copy=True).requires_grad_(True)
        got = chunked_cross_entropy(hs, ws, labels, chunk_size=chunk, z_loss_weight=z, group=dist.group.WORLD,
                                    weights_N=wt)
        (got * 3.0).backward()
        tol = dict(rtol=1e-12, atol=1e-12) if dt == torch.float64 else {}
        torch.testing.assert_close(got.detach(), ref.detach(), **tol, msg=f"group loss {dt} z={z}")
        torch.testing.assert_close(hs.grad, 3 * hr.grad, **tol, msg=f"group grad h {dt} z={z}")
        torch.testing.assert_close(ws.grad, 3 * wr.grad[rank * 40:(rank + 1) * 40], **tol, msg=f"group grad w {dt}")
    # labels all in the other shard, all ignored, and an explicit vocab_start
    for lab in (torch.full((N,), 79), torch.full((N,), -100)):
        ref = chunked_cross_entropy(h, w, lab)
        got = chunked_cross_entropy(h, w[rank * 40:(rank + 1) * 40], lab, group=dist.group.WORLD,
                                    vocab_start=rank * 40)
        torch.testing.assert_close(got, ref)
    # through titan_mm.parallel.tp (what loss parallel installs for a model on the PyTorch CE), DTensor weight
    from titan_mm.parallel.tp import vocab_parallel_cross_entropy
    hd = h.clone().requires_grad_(True)
    wd = distribute_tensor(w.clone(), mesh, [Shard(0)]).requires_grad_(True)
    got = vocab_parallel_cross_entropy(hd, wd, labels, 5, 1e-3)
    got.backward()
    hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    ref = chunked_cross_entropy(hr, wr, labels, chunk_size=5, z_loss_weight=1e-3)
    ref.backward()
    torch.testing.assert_close(got.detach(), ref.detach())
    torch.testing.assert_close(hd.grad, hr.grad)
    torch.testing.assert_close(wd.grad.full_tensor(), wr.grad)
    dist.barrier()
    dist.destroy_process_group()
    print("OK", rank, flush=True)
    # skip interpreter teardown: gloo's background threads can abort() in static destructors at exit
    # ("terminate called without an active exception"), which says nothing about the checks above
    os._exit(0)
    """
)


def test_vocab_parallel_ces_match_single_process(tmp_path):
    """The fused Triton CE and the PyTorch chunked CE per vocabulary shard (loss parallel) on 2 gloo ranks: loss
    and gradients equal the single-process chunked CE (with z-loss, ignored labels, several chunks)."""
    _run_two_ranks(tmp_path, "child_vp_ce.py", CHILD_VP_CE, interpret=True)
