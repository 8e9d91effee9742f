"""The planner CLI, run as a user runs it: a real subprocess."""

import json
import subprocess
import sys


def kvbridge(*args):
    return subprocess.run(
        [sys.executable, "-m", "kvbridge.serving.cli", *args], capture_output=True, text=True, timeout=60
    )


def test_plan_json_pp2_to_tp2():
    out = kvbridge(
        "plan",
        "--prefill",
        "pp=2,tp=1",
        "--decode",
        "pp=1,tp=2",
        "--num-layers",
        "28",
        "--num-kv-heads",
        "4",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    transfers = [
        (t["decode_worker"]["tp"], t["prefill_worker"]["pp"], t["layers"][0], t["layers"][-1], t["kv_heads"])
        for t in doc["transfers"]
    ]
    assert transfers == [
        (0, 0, 0, 13, [0, 2]),
        (0, 1, 14, 27, [0, 2]),
        (1, 0, 0, 13, [2, 4]),
        (1, 1, 14, 27, [2, 4]),
    ]
    assert all(t["decode_worker"]["pp"] == 0 for t in doc["transfers"])
    # bf16, 128-wide heads, K and V: 14 layers x 2 heads x 2 x 128 x 2 bytes per token.
    assert doc["transfers"][0]["bytes_per_token"] == 14 * 2 * 2 * 128 * 2
    # Heads differ per worker, so kvbridge asks for head-outer pages: one run per (layer, block), not
    # one per (layer, block, token) as with vLLM's default heads-interleaved pages.
    assert doc["kv_layout"] == "LBHNC"
    assert doc["transfers"][0]["descriptors_scattered"] == 14 * 64
    assert doc["transfers"][0]["descriptors_contiguous"] == 14 * 64


def test_plan_table():
    # One layer: each KV head is held by two prefill ranks and read from one (a layer is never cut).
    out = kvbridge("plan", "--prefill", "tp=4", "--decode", "pp=1", "--num-layers", "1", "--num-kv-heads", "2")
    assert out.returncode == 0, out.stderr
    assert "prefill pp=1,tp=4  ->  decode pp=1,tp=1" in out.stdout
    assert "nobody reads from" in out.stdout


def test_invalid_layout_is_one_line_without_traceback():
    out = kvbridge("plan", "--prefill", "pp=2,tp=3", "--decode", "tp=1", "--num-layers", "28", "--num-kv-heads", "4")
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    assert out.stderr.strip().count("\n") == 0
    assert "tp=3 must divide the 4 KV heads" in out.stderr


def test_an_unparsable_layout_is_an_error_not_a_traceback():
    out = kvbridge("plan", "--prefill", "pp=two", "--decode", "tp=1", "--num-layers", "28", "--num-kv-heads", "4")
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert "cannot parse 'pp=two'" in out.stderr
