"""`hetero plan -o plan.svg`: the plan drawn, read back as XML against the same plan as JSON.

The command runs as a user runs it (datasheet devices, a synthetic 8B shape: nothing loaded),
once writing the plan's JSON and once its drawing. Each device's row must say what the plan
says (device, layers, weights mode, kernels, memory) and its bars must stand where the layers
are: a stage of layers [a, b) covers the same fraction of the layer track.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from hetero.planner.drawing import GB, plan_svg

SVG = "{http://www.w3.org/2000/svg}"
ARGS = ("synth:llama3-8b:q4_k_m", "--devices", "rtx3060,desktop-ddr5", "--use-all-devices",
        "-c", "16", "--context", "8192")  # fmt: skip


def hetero_plan(*args: str) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run(
        [str(Path(sys.executable).parent / "hetero"), "plan", *args],
        check=True,
        capture_output=True,
        env=env,
        timeout=300,
    )


@pytest.fixture(scope="module")
def drawn(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan")
    hetero_plan(*ARGS, "-o", str(folder / "plan.json"))
    hetero_plan(*ARGS, "-o", str(folder / "plan.svg"))
    plan = json.loads((folder / "plan.json").read_text())
    return plan, ET.parse(folder / "plan.svg").getroot()


def texts(node) -> list[str]:
    return [t.text for t in node.iter(SVG + "text")]


def test_each_device_row_says_what_the_plan_says(drawn):
    plan, svg = drawn
    rows = svg.findall(f"{SVG}g[@class='stage']")
    assert len(plan["stages"]) == len(rows) == 2
    for s, g in zip(plan["stages"], rows):
        assert g.get("data-device") == s["device"]
        assert g.get("data-layers") == f"{s['layer_start']}-{s['layer_end'] - 1}"
        assert g.get("data-weights") == s["weights"]
        words = " ".join(texts(g))
        assert f"weights {s['weights']}, KV {s['kv_dtype']} ({s['num_kv_blocks']} blocks)" in words
        assert s["kernels"]["qlinear"] in words and s["kernels"]["paged_attention"] in words
        assert f"{s['weight_bytes'] / GB:.2f} GB weights, {s['kv_bytes'] / GB:.2f} GB KV" in words
        assert f"of {s['memory_budget'] / GB:.1f} GB" in words
    notes = " ".join(texts(svg))
    assert f"{plan['single_stream_tok_s']:.1f} tok/s single stream" in notes


def test_bars_stand_where_the_layers_are(drawn):
    plan, svg = drawn
    n = plan["n_layers"]
    rows = svg.findall(f"{SVG}g[@class='stage']")
    for s, g in zip(plan["stages"], rows):
        track, mem_track = g.findall(f"{SVG}rect[@class='track']")
        bar = g.find(f"{SVG}rect[@class='layers']")
        x0, width = float(track.get("x")), float(track.get("width"))
        assert float(bar.get("x")) == pytest.approx(x0 + width * s["layer_start"] / n, abs=0.01)
        assert float(bar.get("width")) == pytest.approx(
            width * (s["layer_end"] - s["layer_start"]) / n, abs=0.01
        )
        # the memory bar: weights then KV, as shares of the device's budget
        w = g.find(f"{SVG}rect[@class='weights']")
        kv = g.find(f"{SVG}rect[@class='kv']")
        full, budget = float(mem_track.get("width")), s["memory_budget"]
        assert float(w.get("width")) == pytest.approx(full * s["weight_bytes"] / budget, abs=0.01)
        assert float(kv.get("width")) == pytest.approx(full * s["kv_bytes"] / budget, abs=0.01)
        assert float(kv.get("x")) == pytest.approx(float(w.get("x")) + float(w.get("width")))
    # the stages tile the model: together their bars cover the whole track once
    spans = sorted((float(b.get("x")), float(b.get("width"))) for b in svg.iter(SVG + "rect")
                   if b.get("class") == "layers")  # fmt: skip
    for (x, w), (nx, _) in zip(spans, spans[1:]):
        assert x + w == pytest.approx(nx, abs=0.01)


def test_text_from_a_device_name_is_escaped():
    class Stage:
        device, layer_start, layer_end, weights, kv_dtype = "<cpu&1>", 0, 4, "qdot", "fp16"
        kernels, num_kv_blocks, kv_bytes, weight_bytes = {"qlinear": "a<b"}, 8, 10, 20

    root = ET.fromstring(plan_svg([Stage()], 4, 'model "x" & <y>'))  # parses: well-formed
    assert root.find(f"{SVG}g").get("data-device") == "<cpu&1>"
    assert 'model "x" & <y>' in texts(root)
