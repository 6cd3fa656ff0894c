"""benchmarks/tools/generate_memory.py's replay of an allocator trace (the GPU run: ``python
benchmarks/tools/generate_memory.py`` on a CUDA machine)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "tools"))
from generate_memory import frame_label, peak_groups  # noqa: E402


def _frames(where: str) -> list[dict]:
    return [
        {"filename": "/usr/lib/python3/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
        {"filename": f"/work/main/hf_paged/{where}.py", "line": 7, "name": where},
    ]


def test_the_peak_is_found_by_replay_and_grouped_by_our_frame():
    events = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": _frames("cache")},
        {"action": "alloc", "addr": 2, "size": 50, "frames": _frames("attention")},
        {"action": "free_requested", "addr": 1, "size": 100},  # not yet free: a stream may still use it
        {"action": "alloc", "addr": 3, "size": 30, "frames": _frames("attention")},  # the peak: 180
        {"action": "free_completed", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 4, "size": 120, "frames": _frames("cache")},  # 200 > 180: the peak moves here
        {"action": "free_completed", "addr": 4, "size": 120},
        {"action": "alloc", "addr": 5, "size": 10, "frames": []},
    ]
    peak, groups, num_events = peak_groups({"device_traces": [events]})
    assert (peak, num_events) == (200, 8)
    assert groups == {"main/hf_paged/cache.py:7 cache": 120, "main/hf_paged/attention.py:7 attention": 80}


def test_labels_join_our_innermost_frames():
    frames = [*_frames("attention"), {"filename": "/x/site-packages/transformers/a.py", "line": 2, "name": "f"}]
    assert frame_label(frames) == "main/hf_paged/attention.py:7 attention < transformers/a.py:2 f"


def test_a_block_of_no_frame_of_ours_takes_the_innermost_frame():
    frames = [{"filename": "/x/site-packages/torch/_ops.py", "line": 3, "name": "__call__"}]
    assert frame_label(frames) == "torch/_ops.py:3 __call__"
    assert frame_label([]) == "(no frames)"
