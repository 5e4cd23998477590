"""Graph pictures: the DOT structure (nodes, clusters, edges) against the model's own structure.

References are hand-written graphs of tiny models, the model's ``named_children`` / forward
hooks, and values compared directly between a trace and a fork; pixels are never compared.
One test renders SVG and PNG and checks the files are well-formed and non-trivial.
"""

from __future__ import annotations

import re
import shutil
import struct
import warnings
import xml.etree.ElementTree as ET

import pytest
import torch
from conftest import SmallMLP

import torchlens as tl
from torchlens.analysis.draw import AUTO_MAX_NODES
from torchlens.demo import TinyLM
from torchlens.errors import DrawingScaledDown, EmptySelectionError, GraphvizNotFoundError, InvalidArgumentError

NODE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)" \[(.*)\];$')
EDGE = re.compile(r'^\s*"((?:[^"\\]|\\.)*)" -> "((?:[^"\\]|\\.)*)";$')
CLUSTER = re.compile(r'^\s*subgraph "cluster:((?:[^"\\]|\\.)*)" \{$')
RED, ORANGE = "#e53935", "#ffcc80"

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz's dot is not installed "
                                                                   "(scripts/setup_env.sh installs it)")


def differs(a, b, atol: float = 0.0) -> bool:
    """Whether two op outputs (a tensor or a tuple of tensors) differ by more than ``atol``."""
    a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
    return any(not torch.allclose(x, y, atol=atol, rtol=0.0) for x, y in zip(a, b))


def parse(dot: str) -> dict:
    """Nodes (id -> attributes), edges, clusters (id -> parent cluster id) and each node's cluster."""
    nodes, edges, clusters, where = {}, set(), {}, {}
    stack: list[str | None] = [None]
    for line in dot.splitlines():
        if m := CLUSTER.match(line):
            clusters[m.group(1)] = stack[-1]
            stack.append(m.group(1))
        elif line.strip() == "}" and len(stack) > 1:
            stack.pop()
        elif m := EDGE.match(line):
            edges.add((m.group(1), m.group(2)))
        elif m := NODE.match(line):
            attrs = dict(re.findall(r'(\w+)=("(?:[^"\\]|\\.)*"|[^,\s]+)', m.group(2)))
            nodes[m.group(1)] = {k: v.strip('"') for k, v in attrs.items()}
            where[m.group(1)] = stack[-1]
    return {"nodes": nodes, "edges": edges, "clusters": clusters, "where": where}


@pytest.fixture(scope="module")
def lm12():
    torch.manual_seed(0)
    model = TinyLM(n_layers=12).eval()
    ids = torch.tensor([[1, 2, 3, 4]])
    return model, ids, tl.trace(model, ids)


def test_full_graph_of_a_small_mlp_is_the_hand_drawn_one(small_mlp, mlp_input):
    g = parse(tl.trace(small_mlp, mlp_input).to_dot(depth=None))
    assert set(g["nodes"]) == {"input_0", "linear_1", "relu_1", "linear_2", "output"}
    assert g["edges"] == {("input_0", "linear_1"), ("linear_1", "relu_1"), ("relu_1", "linear_2"),
                          ("linear_2", "output")}
    assert g["clusters"] == {"fc1:1": None, "act:1": None, "fc2:1": None}
    assert g["where"]["linear_1"] == "fc1:1" and g["where"]["relu_1"] == "act:1" and g["where"]["input_0"] is None
    assert g["nodes"]["linear_1"]["label"] == "linear_1\\nlinear\\n3×6"  # label, function, shape


def test_depth_one_shows_each_block_as_one_node_with_its_edges(lm12):
    model, _, trace = lm12
    g = parse(trace.to_dot(depth=1))
    children = [name for name, _ in model.named_children()]  # wte, wpe, blocks, ln_f
    blocks = [f"module:blocks.{i}:1" for i in range(12)]
    expected_modules = {f"module:{c}:1" for c in children if c != "blocks"} | set(blocks)
    assert {n for n in g["nodes"] if n.startswith("module:")} == expected_modules
    assert not g["clusters"], "depth=1 draws no nested boxes"
    for a, b in zip(blocks, blocks[1:]):
        assert (a, b) in g["edges"]  # block i feeds block i+1
    # each block is entered from the previous node only and leaves to the next only
    for b in blocks[1:-1]:
        assert len([e for e in g["edges"] if e[1] == b]) == 1 and len([e for e in g["edges"] if e[0] == b]) == 1
    assert g["nodes"]["module:blocks.0:1"]["label"] == "blocks.0\\nBlock\\n1×4×32"


def test_depth_two_nests_each_block_child_in_its_block(lm12):
    model, _, trace = lm12
    g = parse(trace.to_dot(depth=2))
    for i, block in enumerate(model.blocks):
        for name, _ in block.named_children():
            node = f"module:blocks.{i}.{name}:1"
            assert node in g["nodes"], node
            assert g["where"][node] == f"blocks.{i}:1"
    assert set(g["clusters"]) == {f"blocks.{i}:1" for i in range(12)}


def test_default_depth_keeps_a_twelve_block_model_readable(lm12):
    _, _, trace = lm12
    full = parse(trace.to_dot(depth=None))
    assert len(full["nodes"]) > AUTO_MAX_NODES  # so "auto" has to collapse
    auto = parse(trace.to_dot())
    assert len(auto["nodes"]) <= AUTO_MAX_NODES
    assert "module:blocks.11:1" in auto["nodes"]
    for depth in (1, 2):  # every collapsed level of 12 blocks stays a picture, not a hairball
        g = parse(trace.to_dot(depth=depth))
        assert len(g["edges"]) <= 3 * len(g["nodes"])


def test_focus_draws_one_region_at_full_detail(lm12):
    _, _, trace = lm12
    g = parse(trace.to_dot(focus="blocks.3.attn"))
    inside = {n: a for n, a in g["nodes"].items() if "dashed" not in a.get("style", "")}
    funcs = sorted(a["label"].split("\\n")[1] for a in inside.values())
    # TinyLM's Attention.forward, read by hand: qkv, split, 3 views, 3+1 transposes, sdpa, reshape, out
    assert funcs == sorted(["linear", "split", "view", "view", "view", "transpose", "transpose", "transpose",
                            "transpose", "scaled_dot_product_attention", "reshape", "linear"])
    context = {a["label"].split("\\n")[1] for n, a in g["nodes"].items() if n not in inside}
    assert context == {"layer_norm", "add"}  # what feeds it (ln_1) and what reads it (the residual add)
    assert {"blocks.3:1", "blocks.3.attn:1", "blocks.3.attn.qkv:1", "blocks.3.attn.out:1"} == set(g["clusters"])


def test_passes_unrolled_and_rolled(shared_twice):
    trace = tl.trace(shared_twice.model, *shared_twice.args)
    unrolled = parse(trace.to_dot(depth=None))
    assert {"block:1", "block:2", "block.0:1", "block.0:2"} <= set(unrolled["clusters"])
    assert unrolled["clusters"]["block.0:2"] == "block:2"
    rolled = parse(trace.to_dot(depth=None, rolled=True))
    assert "block" in rolled["clusters"] and "block:2" not in rolled["clusters"]
    # SharedTwice calls block twice: the second pass reads the first pass's tanh -> a loop edge
    tanh, linear = "tanh_1", "linear_2"
    assert rolled["where"][tanh] == "block.1" and rolled["where"][linear] == "block.0"
    assert (tanh, linear) in rolled["edges"]
    assert "tanh_2" not in rolled["nodes"]
    collapsed = parse(trace.to_dot(depth=1, rolled=True))
    assert ("module:block", "module:block") in collapsed["edges"]
    assert collapsed["nodes"]["module:block"]["label"].startswith("block ×2")
    assert {"module:block:1", "module:block:2"} <= set(parse(trace.to_dot(depth=1))["nodes"])


def test_fork_highlights_the_edit_and_what_replay_recomputed(lm12):
    _, _, trace = lm12
    fork = trace.fork("ablate").do(tl.module("blocks.5.mlp"), tl.zero_ablate())
    g = parse(fork.to_dot(depth=None))
    red = {n for n, a in g["nodes"].items() if a.get("fillcolor") == RED}
    orange = {n for n, a in g["nodes"].items() if a.get("fillcolor") == ORANGE}
    mlp_out = trace["blocks.5.mlp"].record.out_refs[0].index
    assert red == {trace.ops[mlp_out].label}
    # recomputed = every op whose value changed (compared directly), plus nothing upstream of the edit
    changed = {op.label for op in trace.ops if not op.is_input and op.index > mlp_out
               and differs(fork[op.label].out, trace[op.label].out)}
    assert changed and changed <= orange
    assert all(trace.op_index(n) > mlp_out for n in orange)
    collapsed = parse(fork.to_dot(depth=1))
    assert collapsed["nodes"]["module:blocks.5:1"]["fillcolor"] == RED
    assert collapsed["nodes"]["module:blocks.6:1"]["fillcolor"] == ORANGE
    assert collapsed["nodes"]["module:blocks.4:1"]["fillcolor"] != ORANGE


def test_comparison_highlights_first_divergence_and_changed_region(lm12):
    _, _, trace = lm12
    fork = trace.fork("scaled").do(tl.module("blocks.7"), tl.scale(2.0))
    result = tl.debug.compare(trace, fork)
    g = parse(tl.draw(result, depth=None).dot)
    red = {n for n, a in g["nodes"].items() if a.get("fillcolor") == RED}
    hot = red | {n for n, a in g["nodes"].items() if a.get("fillcolor") == ORANGE}
    changed = {op.label for op in trace.ops if differs(fork[op.label].out, trace[op.label].out, atol=1e-5)}
    assert changed and changed <= hot
    first = result.first_divergence
    assert first is not None and first.kind == "module" and first.label == "blocks.7"
    block_out = trace.ops[trace["blocks.7"].record.out_refs[0].index].label
    assert block_out in red
    collapsed = parse(tl.draw(result, depth=1).dot)
    assert collapsed["nodes"]["module:blocks.7:1"]["fillcolor"] == RED
    assert collapsed["nodes"]["module:blocks.8:1"]["fillcolor"] == ORANGE
    assert collapsed["nodes"]["module:blocks.6:1"]["fillcolor"] not in (RED, ORANGE)
    assert f"first divergence {first.label}" in tl.draw(result).dot  # the title says it too


def test_bad_arguments_raise_typed_errors(lm12, tmp_path):
    _, _, trace = lm12
    with pytest.raises(InvalidArgumentError):
        trace.to_dot(depth=0)
    with pytest.raises(InvalidArgumentError):
        tl.draw("not a trace")
    with pytest.raises(EmptySelectionError):
        trace.to_dot(focus=tl.func("conv2d"))
    with pytest.raises(InvalidArgumentError):
        trace.draw(tmp_path / "graph.gif")
    assert not (tmp_path / "graph.gif").exists()
    assert len(trace.ops) == 12 * 19 + 8  # nothing was lost


def test_missing_dot_raises_a_typed_error_and_dot_text_still_works(lm12, tmp_path, monkeypatch):
    _, _, trace = lm12
    monkeypatch.setenv("PATH", str(tmp_path))  # no dot on PATH
    with pytest.raises(GraphvizNotFoundError) as info:
        trace.draw(tmp_path / "graph.svg")
    assert "apt-get install graphviz" in info.value.remedy
    assert not (tmp_path / "graph.svg").exists()
    assert trace.to_dot().startswith("digraph")
    trace.draw(tmp_path / "graph.dot")  # DOT files need no Graphviz
    assert (tmp_path / "graph.dot").read_text().startswith("digraph")


@needs_dot
def test_renders_well_formed_svg_and_png(lm12, tmp_path):
    _, _, trace = lm12
    svg_path, png_path = tmp_path / "graph.svg", tmp_path / "graph.png"
    drawing = trace.draw(svg_path, depth=2)
    root = ET.parse(svg_path).getroot()
    assert root.tag.endswith("svg")
    n_nodes = len(parse(drawing.dot)["nodes"])
    svg_nodes = [g for g in root.iter() if g.tag.endswith("g") and g.get("class") == "node"]
    assert len(svg_nodes) == n_nodes
    assert float(root.get("width").rstrip("pt")) > 200 and float(root.get("height").rstrip("pt")) > 200
    trace.draw(png_path, depth=2)
    data = png_path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 200 and height > 200 and len(data) > 10_000
    assert drawing._repr_svg_().lstrip().startswith(("<?xml", "<svg", "<!--"))


@needs_dot
def test_a_png_graphviz_scales_down_warns_and_names_svg_or_depth(tiny_gpt2_12, tmp_path, capfd):
    trace = tl.trace(tiny_gpt2_12.model, *tiny_gpt2_12.args)
    with pytest.warns(DrawingScaledDown) as caught:
        trace.draw(tmp_path / "all.png", depth=None)  # every op of 12 blocks: taller than a bitmap may be
    (warning,) = caught
    message = str(warning.message)
    assert "SVG" in message and "depth=" in message and warning.filename == __file__
    width, height = struct.unpack(">II", (tmp_path / "all.png").read_bytes()[16:24])
    assert max(width, height) <= 32767  # what Graphviz shrank it to, as the warning says
    assert "too large" not in capfd.readouterr().err  # said once, as the warning, not also by dot
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrawingScaledDown)
        trace.draw(tmp_path / "all.svg", depth=None)  # vector formats are not scaled
        trace.draw(tmp_path / "blocks.png", depth=1)


def test_draw_leaves_the_trace_unchanged(small_mlp, mlp_input):
    trace = tl.trace(small_mlp, mlp_input)
    before = [(op.label, op.out.clone()) for op in trace.ops]
    trace.to_dot()
    fork = trace.fork().do("fc1", tl.zero_ablate())
    fork.to_dot()
    assert [(op.label) for op in trace.ops] == [label for label, _ in before]
    assert all(torch.equal(trace[label].out, v) for label, v in before)
    reference = SmallMLP().eval()
    reference.load_state_dict(small_mlp.state_dict())
    assert torch.equal(trace.output, reference(mlp_input))
