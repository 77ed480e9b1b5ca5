"""nD timeline: one Chrome trace for all ranks, with spans for every rank and microbatch, plus a PNG."""

from __future__ import annotations

from vescale.core.testing import multi_rank

MB, T, VOCAB = 2, 8, 64


@multi_rank(world_sizes=[2])
def test_trace_has_every_rank_and_microbatch(gpt_pipeline, tmp_path):
    import json

    import torch
    import torch.distributed as dist

    from vescale.core.mesh import init_mesh
    from vescale.core.testing.models import cross_entropy
    from vescale.pipe import PipeEngine, timeline

    model, stages_by_count = gpt_pipeline
    mesh = init_mesh({"pp": 2})
    M = 4
    engine = PipeEngine(stages_by_count[2], mesh, schedule="zb_h1", num_microbatches=M, loss_fn=cross_entropy)
    opt = torch.optim.SGD(engine.parameters(), lr=0.1)
    x = torch.randint(0, VOCAB, (M * MB, T), generator=torch.Generator().manual_seed(1))
    with timeline.Timeline(mesh) as tl:
        engine.step(x, x)
        opt.step()
        with timeline.span("user work", cat="user"):
            dist.all_reduce(torch.ones(3))  # any torch.distributed program: collectives are recorded too
    path = tmp_path / "trace.json"
    trace = tl.export(path)
    assert timeline.active() is None
    if dist.get_rank() != 0:
        assert trace is None
        return
    on_disk = json.loads(path.read_text())
    assert on_disk == json.loads(json.dumps(trace))
    events = on_disk["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (pp=0)", 1: "rank 1 (pp=1)"}
    spans = [e for e in events if e["ph"] == "X"]
    for rank in (0, 1):
        mine = [e for e in spans if e["pid"] == rank]
        for cat in ("forward", "backward_input", "backward_weight"):
            assert sorted(e["args"]["mb"] for e in mine if e["cat"] == cat) == list(range(M)), (rank, cat)
        assert any(e["cat"] == "p2p" for e in mine)
        assert any(e["cat"] == "optimizer" and e["name"] == "SGD.step" for e in mine)
        assert any(e["cat"] == "collective" and e["name"] == "all_reduce" for e in mine)
        assert any(e["name"] == "user work" for e in mine)
        assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in mine)
    # the spans of one microbatch follow the pipeline: stage 0 forward ends before stage 1 forward starts
    f0 = next(e for e in spans if e["pid"] == 0 and e["cat"] == "forward" and e["args"]["mb"] == 0)
    f1 = next(e for e in spans if e["pid"] == 1 and e["cat"] == "forward" and e["args"]["mb"] == 0)
    assert f0["ts"] + f0["dur"] <= f1["ts"] + 1e-3  # one host: one clock, so causality shows exactly
    measured = timeline.bubble(trace)
    assert 0.0 <= measured["fraction"] < 1.0
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "trace.png").stat().st_size > 1000
    else:  # the PNG is optional: skipped with a message, the JSON is still written
        assert not (tmp_path / "trace.png").exists()


def test_legend_gives_every_category_its_own_colour():
    from vescale.pipe import timeline

    legend = timeline._legend()
    assert len(set(legend.values())) == len(legend), legend  # no two entries share a colour
    # every lane's category is in the legend, with the colour its spans are drawn in
    for cat in timeline._LANES:
        assert legend[cat] == timeline._COLORS[cat], cat
    assert timeline._OTHER_COLOR not in timeline._COLORS.values()


def test_legend_clear_of_the_ms_label():
    import pytest

    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vescale.pipe import timeline

    trace = {"traceEvents": [{"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}}
                             for r in range(2)]
             + [{"ph": "X", "name": cat, "cat": cat, "pid": r, "ts": 10.0 * i, "dur": 8.0}
                for r in range(2) for i, cat in enumerate([*timeline._COLORS, "user"])]}
    fig = timeline._gantt_figure(trace)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(renderer)
        label = ax.xaxis.label.get_window_extent(renderer)
        assert not legend.overlaps(label), (legend, label)
        assert not legend.overlaps(ax.get_window_extent(renderer))  # beside the bars, not over them
        assert [t.get_text() for t in ax.get_legend().get_texts()] == list(timeline._legend())
    finally:
        plt.close(fig)
