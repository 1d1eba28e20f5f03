"""The GPU suite cut to fit the device tool's 10-minute calls (scripts/gpu_verify.sh reads this).

SMOKE: the most telling cases, at most 5 minutes: a kernel set (every Triton kernel forward + backward, tuned and
untuned, no host sync; the fused CE at full shape), a compiled 1.7B model step with kernels, the trainer's train
step, and a CUDA-graph serving step.
AREAS: every GPU test exactly once (tests/unit/test_gpu_shards.py checks it against tests/gpu/*.py and the
gpu-marked tests elsewhere), each at most 8 minutes. An entry is a file (its GPU tests) or file::test (all its
cases); the seconds are estimates from the tests' sizes (cold compiles included) until the lead's runs replace
them with measured ones. qwen3_5_fla compiles fla's kernels cold (~400 s on the H200, 2026-12-02); run it before
qwen3_5 on the same warm machine, whose .triton_cache (scripts/gpu_setup.sh) then saves qwen3_5 most of its
compiles.

    python3 -m tests.gpu.shards list [AREA]              # pytest node ids, one a line
    python3 -m tests.gpu.shards summary AREA JUNIT_XML LOG SECONDS RC OUT_JSON
"""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET

LIMIT_S = {"smoke": 300, "area": 480}

SMOKE: dict[str, int] = {
    "tests/gpu/test_kernels_gpu.py::test_no_host_syncs": 30,
    "tests/gpu/test_kernels_gpu.py::test_full_shape_matches_reference[linear_cross_entropy-dtype1]": 30,
    "tests/gpu/test_qwen3_gpu.py::test_qwen3_1p7b_fwd_bwd_compiled_no_syncs[flex-kernels]": 90,
    "tests/gpu/test_train_step_gpu.py::test_device_skip_matches_host_path_on_cuda": 30,
    "tests/gpu/test_serve_gpu.py::test_cuda_graph_decode_equals_eager[qwen3-kernels]": 45,
}

AREAS: dict[str, dict[str, int]] = {
    "kernels": {"tests/gpu/test_kernels_gpu.py": 240, "tests/gpu/test_paged_decode_gpu.py": 45,
                "tests/gpu/test_norm_rope_cache_gpu.py": 150},
    "ops": {"tests/gpu/test_moe_routing_gpu.py": 60, "tests/gpu/test_grouped_mm_gpu.py": 60,
            "tests/unit/test_attention_kinds.py": 150, "tests/unit/test_kv_cache.py": 30,
            "tests/unit/test_muon.py": 20, "tests/gpu/test_tp_norm_gpu.py": 30,
            "tests/gpu/test_bagel_encode_gpu.py": 45},  # BAGEL's VAE on the trainer's device (the train area is full)
    "models": {"tests/gpu/test_qwen3_gpu.py": 360, "tests/gpu/test_wan_gpu.py": 45, "tests/gpu/test_bagel_gpu.py": 75},
    "vl": {"tests/gpu/test_qwen3_vl_gpu.py": 90, "tests/gpu/test_omni_gpu.py": 90, "tests/gpu/test_dllm_gpu.py": 90,
           "tests/gpu/test_towers_gpu.py": 120, "tests/gpu/test_serve_omni_gpu.py": 60},  # serve's area is full
    "qwen3_5_fla": {"tests/gpu/test_qwen3_5_gpu.py::test_fla_matches_reference_on_packed_rows": 420},
    "qwen3_5": {"tests/gpu/test_qwen3_5_gpu.py::test_no_host_sync_bf16": 300},
    "train": {"tests/gpu/test_train_step_gpu.py": 330, "tests/gpu/test_objectives_gpu.py": 30,
              "tests/gpu/test_checkpoint_faults_gpu.py": 90, "tests/gpu/test_wan_data_gpu.py": 30},
    "eval": {"tests/gpu/test_eval_gpu.py": 120, "tests/gpu/test_profile_gpu.py": 60, "tests/gpu/test_fp16_gpu.py": 60,
             "tests/gpu/test_rl_gpu.py": 150, "tests/gpu/test_bagel_sample_gpu.py": 30,
             "tests/unit/test_bench_bagel_peer.py": 45},
    "serve": {"tests/gpu/test_serve_gpu.py": 300, "tests/gpu/test_serve_media_gpu.py": 90,
              "tests/gpu/test_serve_weights_gpu.py": 90},
    # the mixed-row paged attention kernel and serve.mixed_attention, serve.graph_sampling, BAGEL's text and image
    # chats (kernels, serve and eval had no room left)
    "serve_mixed": {"tests/gpu/test_paged_attention_gpu.py": 120, "tests/gpu/test_serve_graph_sampling_gpu.py": 150,
                    "tests/gpu/test_serve_bagel_gpu.py": 75},
}


def nodes(area: str) -> list[str]:
    """The pytest node ids of ``area`` ("smoke" or a key of AREAS)."""
    if area == "smoke":
        return list(SMOKE)
    if area not in AREAS:
        raise KeyError(f"unknown GPU area {area!r}; choose one of: smoke, {', '.join(AREAS)}")
    return list(AREAS[area])


def device_name() -> str:
    import torch  # only here: `list` runs without torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA device)"


_VERBOSE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED)")
_KIND = {"PASSED": "passed", "FAILED": "failure", "ERROR": "error", "SKIPPED": "skipped"}


def _cases(junit: str, log: str) -> list[tuple[str, str, float]]:
    """(node id, passed | failure | error | skipped, seconds) per test: from pytest's JUnit XML, or, when the time
    limit killed pytest before it wrote one, from its -v log (the tests that finished, without their times)."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        try:
            lines = open(log, errors="replace").read().splitlines()
        except OSError:
            return []
        return [(m[1], _KIND[m[2]], 0.0) for m in map(_VERBOSE.match, lines) if m]
    cases = []
    for tc in root.iter("testcase"):
        node = tc.get("classname", "").replace(".", "/") + ".py::" + tc.get("name", "")
        kind = next((c.tag for c in tc if c.tag in ("failure", "error", "skipped")), "passed")
        cases.append((node, kind, float(tc.get("time", 0))))
    return cases


def summarize(area: str, junit: str, log: str, seconds: float, rc: int) -> dict:
    """The run's summary: counts, the failed node ids, the slowest tests, wall seconds, exit code, device."""
    cases = _cases(junit, log)
    failed = [n for n, k, _ in cases if k in ("failure", "error")]
    count = {k: sum(c[1] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
    return {"area": area, "device": device_name(), "tests": len(cases), "passed": count["passed"],
            "failed": count["failure"], "errors": count["error"], "skipped": count["skipped"],
            "seconds": round(seconds, 1), "exit_code": rc, "timed_out": rc in (124, 137),
            "ok": rc == 0 and not failed and count["passed"] > 0, "failed_tests": failed,
            "slowest": sorted(((round(t, 1), n) for n, _, t in cases), reverse=True)[:10]}


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"] and len(argv) <= 2:
        try:
            print("\n".join(nodes(argv[1] if len(argv) == 2 else "smoke")))
        except KeyError as e:
            print(f"gpu_verify: {e.args[0]}", file=sys.stderr)
            return 2
        return 0
    if argv[:1] == ["summary"] and len(argv) == 7:
        area, junit, log, seconds, rc, out = argv[1:]
        s = summarize(area, junit, log, float(seconds), int(rc))
        with open(out, "w") as f:
            json.dump(s, f, indent=1)
        print(json.dumps({k: s[k] for k in ("area", "device", "tests", "passed", "failed", "errors", "skipped",
                                            "seconds", "exit_code")}))
        return 0
    print("usage: python3 -m tests.gpu.shards list [AREA] | summary AREA JUNIT_XML LOG SECONDS RC OUT_JSON",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
