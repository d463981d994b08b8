"""The soak's verdicts and request shapes, without a server: each rule must catch what it is for."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.soak_checks import MIB, all_checks, check_idle, check_log, check_processes, check_rss, rss_limit
from benchmarks.soak_outcome import ABORTED, COMPLETED, ERROR, REJECTED, Outcome, Tally, judge_finish, judge_refusal
from benchmarks.soak_probe import Snapshot, metric_samples, step_transit_from_text
from benchmarks.soak_shapes import INVALID_KINDS, Mix, Shape, ShapeSource

IDLE = Snapshot(pids={"frontend": 10, "scheduler": 11, "worker-0": 12},
                rss={"frontend": 300 * MIB, "scheduler": 60 * MIB, "worker-0": 1000 * MIB},
                kv_used_blocks=0, kv_blocks=4096, running=0, waiting=0, frontend_in_flight=0, preemptions=3)


def _failed(checks: list) -> set[str]:
    return {c.name for c in checks if not c.ok}


def test_rss_limit_is_the_larger_allowance() -> None:
    assert rss_limit(100 * MIB, 15, 64) == 164 * MIB  # +64 MiB beats +15 % of a small process
    assert rss_limit(1000 * MIB, 15, 64) == 1150 * MIB  # +15 % beats +64 MiB of a large one


def test_rss_growth_past_the_limit_fails_only_that_process() -> None:
    final = dataclasses.replace(IDLE, rss={**IDLE.rss, "worker-0": 1151 * MIB, "frontend": 364 * MIB})
    assert _failed(check_rss(IDLE, final, 15, 64)) == {"rss worker-0"}
    gone = dataclasses.replace(IDLE, rss={"frontend": 300 * MIB, "scheduler": 60 * MIB})
    assert _failed(check_rss(IDLE, gone, 15, 64)) == {"rss worker-0"}


@pytest.mark.parametrize("change", [{"kv_used_blocks": 1}, {"running": 1}, {"waiting": 2}, {"frontend_in_flight": 1}])
def test_anything_left_open_fails_idle(change: dict[str, int]) -> None:
    assert not _failed(check_idle(IDLE))
    assert _failed(check_idle(dataclasses.replace(IDLE, **change)))
    assert not dataclasses.replace(IDLE, **change).idle


def test_a_restarted_service_fails() -> None:
    assert check_processes(IDLE, IDLE).ok
    assert not check_processes(IDLE, dataclasses.replace(IDLE, pids={**IDLE.pids, "scheduler": 99})).ok


def test_log_errors_fail_unless_allowed() -> None:
    lines = ['ts=1 level=info msg="fine"',
             'ts=2 level=error service=frontend msg="Error handling request" exc="Traceback\\n  File x\\n'
             'aiohttp.ClientConnectionResetError: Cannot write to closing transport"',
             '{"level": "error", "msg": "round failed"}']
    check = check_log(lines)
    assert not check.ok and "2 error records" in check.detail and "ClientConnectionResetError" in check.detail
    assert not check_log(lines, ["closing transport"]).ok  # the JSON record is still there
    assert check_log(lines, ["closing transport", "round failed"]).ok
    assert check_log(['level=warning msg="client went away"']).ok


def test_outcome_checks_need_no_errors_and_every_kind() -> None:
    tally = Tally()
    for kind in (COMPLETED, ABORTED, REJECTED):
        tally.add(Outcome(kind, "grpc", 3))
    assert not _failed(all_checks(tally, IDLE, IDLE, 15, 64, []))
    tally.add(Outcome(ERROR, "http-chat", 0, "finish reason 'abort'"))
    assert _failed(all_checks(tally, IDLE, IDLE, 15, 64, [])) == {"errors"}
    assert tally.examples == ["http-chat: finish reason 'abort'"] and tally.tokens == 9
    assert _failed(all_checks(Tally(), IDLE, IDLE, 15, 64, [])) == {"requests sent", "aborts exercised",
                                                                   "invalid requests exercised"}


def _shape(**kw: object) -> Shape:
    base: dict[str, object] = {"protocol": "grpc", "stream": True, "prompt": [5, 6], "sampling": {"max_tokens": 4}}
    return Shape(**{**base, **kw})  # type: ignore[arg-type]


def test_judging_finishes_and_refusals() -> None:
    assert judge_finish(_shape(), "length", 4).kind == COMPLETED
    assert judge_finish(_shape(), "stop", 1).kind == COMPLETED
    assert judge_finish(_shape(), "length", 3).kind == ERROR  # length means exactly max_tokens
    assert judge_finish(_shape(), "abort", 2).kind == ERROR
    assert judge_finish(_shape(invalid="top_p"), "length", 4).kind == ERROR  # an invalid request was served
    assert judge_refusal(_shape(invalid="top_p"), "INVALID_ARGUMENT", "").kind == REJECTED
    assert judge_refusal(_shape(invalid="top_p"), "INTERNAL", "").kind == ERROR
    assert judge_refusal(_shape(protocol="http-chat", invalid="top_p"), "400", "").kind == REJECTED
    assert judge_refusal(_shape(protocol="http-chat", invalid="top_p"), "500", "").kind == ERROR
    assert judge_refusal(_shape(protocol="http-chat"), "429", "busy").kind == ERROR  # a valid request refused


def test_shapes_fit_the_context_and_cover_every_kind() -> None:
    source = ShapeSource(seed=1, vocab_size=512, max_total_tokens=1024, mix=Mix(invalid=0.3, abort=0.3))
    shapes = [source.next() for _ in range(3000)]
    valid = [s for s in shapes if s.invalid is None]
    for s in valid:
        if isinstance(s.prompt, list):
            assert all(4 <= t < 512 for t in s.prompt) and len(s.prompt) + s.max_tokens <= 1024
        assert 1 <= s.max_tokens <= 256 and int(s.sampling.get("min_tokens", 0)) <= s.max_tokens
    assert {s.invalid for s in shapes} == {None, *INVALID_KINDS}
    assert {s.protocol for s in shapes} == {"grpc", "http-completion", "http-chat"}
    assert all(s.abort is None for s in shapes if s.invalid)
    assert 0.2 < sum(s.abort is not None for s in valid) / len(valid) < 0.4
    assert [source.next() for _ in range(3)] != [ShapeSource(2, 512, 1024).next() for _ in range(3)]
    again = ShapeSource(seed=1, vocab_size=512, max_total_tokens=1024, mix=Mix(invalid=0.3, abort=0.3))
    assert [again.next() for _ in range(50)] == shapes[:50], "a seed replays the same soak"


def test_step_transit_is_the_mean_and_the_share_over_5_ms_of_one_hop() -> None:
    lines = ["# TYPE spindle:step_transit_seconds histogram"]
    for hop, within_5ms, count, total in (("worker_to_frontend", 90, 100, 0.2), ("worker_to_scheduler", 1, 1, 9.0)):
        for le, cumulative in (("0.001", within_5ms // 2), ("0.005", within_5ms), ("+Inf", count)):
            lines.append(f'spindle:step_transit_seconds_bucket{{hop="{hop}",le="{le}"}} {cumulative}')
        lines += [f'spindle:step_transit_seconds_count{{hop="{hop}"}} {count}',
                  f'spindle:step_transit_seconds_sum{{hop="{hop}"}} {total}']
    text = "\n".join(lines) + "\n"
    assert step_transit_from_text(text, "worker_to_frontend") == pytest.approx({"mean_ms": 2.0, "share_over_5_ms": 0.1})
    assert step_transit_from_text(text, "nowhere") is None


def test_metric_samples_reads_labelled_series() -> None:
    text = ('# TYPE spindle:kv_cache_usage_perc gauge\n'
            'spindle:kv_cache_usage_perc{model_name="m",worker="0"} 0.25\n'
            'spindle:kv_cache_usage_perc{model_name="m",worker="1"} 0.5\n')
    assert metric_samples(text, "spindle:kv_cache_usage_perc") == [({"model_name": "m", "worker": "0"}, 0.25),
                                                                   ({"model_name": "m", "worker": "1"}, 0.5)]
