"""bench/timing.py: every bench step is timed once and its result kept, in order (the CUDA path, events between
back-to-back steps, runs in the GPU benches)."""

from bench.timing import step_times, timing_label


def test_step_times_on_the_host_time_each_step_and_keep_its_result():
    calls = []

    def step():
        calls.append(len(calls))
        return len(calls) * 10

    times, outs = step_times(step, 3, cuda=False)
    assert calls == [0, 1, 2] and outs == [10, 20, 30]
    assert len(times) == 3 and all(t >= 0 for t in times)
    assert timing_label(False) == "host" and timing_label(True) == "events"
