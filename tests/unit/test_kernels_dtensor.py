"""The DTensor wrappers (titan_mm.kernels.dtensor, local_map) on a 2-rank gloo CPU world: outputs and
gradients of sharded inputs equal the single-process result (CPU takes the reference path; the wrappers are
the same on CUDA where the Triton kernels run on each shard)."""

import os
import socket
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard, Replicate
    import titan_mm.kernels as K
    from titan_mm.kernels import dtensor as KD

    rank = int(sys.argv[1]); port = sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # same full tensors on both ranks
    x, r, w = torch.randn(2, 6, 8), torch.randn(2, 6, 8), torch.randn(8)
    def check(fn_full, fn_dt, full_args, placements, name):
        fa = [a.clone().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in full_args]
        out = fn_full(*fa); outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
        da = [distribute_tensor(a.detach().clone(), mesh, p).requires_grad_(True) if p is not None else a
              for a, p in zip(full_args, placements)]
        dout = fn_dt(*da); douts = dout if isinstance(dout, tuple) else (dout,)
        sum(o.sum() * (i + 1) for i, o in enumerate(douts)).backward()
        for o, d in zip(outs, douts):
            torch.testing.assert_close(d.full_tensor(), o.detach(), msg=name + " out")
        for a, d, p in zip(fa, da, placements):
            if p is not None and a.grad is not None:
                torch.testing.assert_close(d.grad.full_tensor(), a.grad, msg=name + " grad")
    check(lambda a, b: K.rms_norm(a, b, 1e-6), lambda a, b: KD.sp_rms_norm(mesh)(a, b, 1e-6),
          [x, w], [[Shard(1)], [Replicate()]], "sp_rms_norm")
    check(lambda a, b, c: K.add_rms_norm(a, b, c, 1e-6), lambda a, b, c: KD.sp_add_rms_norm(mesh)(a, b, c, 1e-6),
          [x, r, w], [[Shard(1)], [Shard(1)], [Replicate()]], "sp_add_rms_norm")
    check(K.swiglu, KD.tp_swiglu(mesh), [x, r], [[Shard(-1)], [Shard(-1)]], "tp_swiglu")
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    check(K.apply_rope, KD.tp_apply_rope(mesh), [q, k, cos, sin],
          [[Shard(2)], [Shard(2)], [Replicate()], [Replicate()]], "tp_apply_rope")
    cos3, sin3 = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    check(lambda *a: K.apply_mrope(*a, [2, 1, 1]), KD.tp_apply_mrope(mesh, [2, 1, 1]),
          [q, k, cos3, sin3], [[Shard(2)], [Shard(2)], [Replicate()], [Replicate()]], "tp_apply_mrope")
    check(K.bias_gelu, KD.tp_bias_gelu(mesh), [x, w], [[Shard(-1)], [Shard(0)]], "tp_bias_gelu")
    dist.barrier()
    dist.destroy_process_group()
    print("OK", rank, flush=True)
    # skip interpreter teardown: gloo's background threads can abort() in static destructors at exit
    # ("terminate called without an active exception"), which says nothing about the checks above
    os._exit(0)
    """
)


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


def test_local_map_wrappers_match_single_process(tmp_path):
    _run_two_ranks(tmp_path, "child.py", CHILD, interpret=False)


CHILD_VP_CE = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    assert os.environ.get("TRITON_INTERPRET") == "1"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor, Shard
    import titan_mm.kernels as K
    from titan_mm.models.common.loss import chunked_cross_entropy
    from titan_mm.parallel.tp import vocab_parallel_fused_cross_entropy

    rank = int(sys.argv[1]); port = sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)  # same full tensors on both ranks
    N, D, V = 19, 16, 80  # 40 rows per shard (not a power of two), a partial last chunk
    h, w = torch.randn(N, D), torch.randn(V, D) * 0.5
    labels = torch.randint(0, V, (N,))
    labels[::4] = -100
    for z, chunk in ((0.0, 0), (1e-2, 7)):
        hr, wr = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        ref = chunked_cross_entropy(hr, wr, labels, chunk_size=5, z_loss_weight=z)
        ref.backward()
        hs, ws = h.clone().requires_grad_(True), w[rank * 40:(rank + 1) * 40].clone().requires_grad_(True)
        got = K.vocab_parallel_linear_cross_entropy(hs, ws, labels, rank * 40, dist.group.WORLD, z_loss=z,
                                                    chunk_size=chunk)
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
    dist.barrier()
    dist.destroy_process_group()
    print("OK", rank, flush=True)
    os._exit(0)  # see CHILD
    """
)


def test_vocab_parallel_fused_ce_matches_single_process(tmp_path):
    """The fused Triton CE per vocabulary shard (loss parallel), through the Triton interpreter on 2 gloo ranks:
    loss and gradients equal the single-process chunked CE (with z-loss, ignored labels, several chunks)."""
    _run_two_ranks(tmp_path, "child_vp_ce.py", CHILD_VP_CE, interpret=True)
